"""Settings for the test suite: a real PostgreSQL (DATABASE_URL, else the embedded server)."""

import os

from tests.dbserver import database_settings

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_default = database_settings()
DATABASES = {
    "default": _default,
    # A second PostgreSQL database on the same server, for db_manager(using) tests.
    "other": {**_default, "NAME": f"{_default['NAME']}_other", "TEST": {"NAME": f"test_{_default['NAME']}_other"}},
    # Not PostgreSQL: only used to show the system check refusing it.
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

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
    "tests.testapp",
    "tests.compatapp",
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
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"

# Behind PgBouncer in transaction pooling mode (.ci/with-pgbouncer) LISTEN does not work: poll.
BEHIND_PGBOUNCER = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))
PG_LEASE_LISTEN = not BEHIND_PGBOUNCER
