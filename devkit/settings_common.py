"""The development settings, all but the database: the admin, pgtrigger/pghistory, the lease app and
the test app. ``devkit.settings`` adds a real server (the stress tool's processes run on it);
``tests.settings`` and ``tests.settings_typecheck`` add the suite's own app and their database."""

import os
from typing import Any

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "pgtrigger",
    "pghistory",
    "pg_lease_django",
    "devkit.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "devkit.urls"
STATIC_URL = "static/"

# Behind PgBouncer in transaction pooling mode (.ci/with-pgbouncer) LISTEN does not work: poll.
BEHIND_PGBOUNCER = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))
PG_LEASE_LISTEN = not BEHIND_PGBOUNCER


def _other_name(name: str) -> str:
    """The ``other`` alias's database beside ``name``.

    A child process of a pytest-xdist worker (``PYTEST_XDIST_WORKER`` inherited) is handed the
    worker's test database, ``test_<name>_gw0``, whose ``other`` pytest-django named
    ``test_<name>_other_gw0`` (it appends the worker's suffix to each test database's name).
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and name.endswith(f"_{worker}"):
        return f"{name.removesuffix(f'_{worker}')}_other_{worker}"
    return f"{name}_other"


def databases(default: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``DATABASES`` around the ``default`` entry."""
    return {
        "default": default,
        # A second PostgreSQL database on the same server, for db_manager(using) tests.
        "other": {**default, "NAME": _other_name(default["NAME"]), "TEST": {"NAME": f"test_{default['NAME']}_other"}},
        # Not PostgreSQL: only used to show the system check refusing it.
        "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }
