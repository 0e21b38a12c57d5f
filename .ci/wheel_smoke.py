"""The installed wheel's smoke test, run by .ci/wheel-smoke with the fresh virtualenv's python.

In the current folder (a temporary one, outside the checkout): ``django-admin startproject``, the
app added as docs/installation.md says, a database of its own on ``DATABASE_URL``'s server (created
here, dropped afterwards); then ``migrate`` (the baseline runs ``sql/schema.sql``: it fails if the
SQL files are not in the wheel), ``check --database default``, a lease taken from ``manage.py
shell``, ``manage.py leases list`` / ``show``, the admin's lease page rendered with the app's own
template, and a pytest-django test module that needs the pytest plugin (its fixtures, and the
flush after ``transaction=True`` tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psycopg

HERE = Path.cwd()
VENV = Path(sys.prefix)


def run(cwd: Path, *args: str) -> str:
    """``python ARGS`` in ``cwd``; its stdout; fails the smoke test on a non-zero exit."""
    environ = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"FAILED: python {' '.join(args)} exited {done.returncode}\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def database(url: str, name: str) -> dict[str, str]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


ADMIN_PAGE = """
from django.contrib.auth import get_user_model
from django.template.loader import get_template
from django.test import Client
from django.test.utils import setup_test_environment

setup_test_environment()  # records the templates each response rendered, allows "testserver"
for name in ("change_form.html", "force_release_confirmation.html"):
    origin = get_template(f"admin/pg_lease_django/lease/{name}").origin.name
    assert origin.startswith(VENV), (name, origin)
user = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
client = Client()
client.force_login(user)
response = client.get("/admin/pg_lease_django/lease/smoke/change/")
assert response.status_code == 200, response.status_code
used = [t.name for t in response.templates]
assert "admin/pg_lease_django/lease/change_form.html" in used, used
assert b"wheel-smoke" in response.content
response = client.get("/admin/pg_lease_django/lease/")
assert response.status_code == 200 and b"smoke" in response.content, response.status_code
print("admin ok")
"""

PYTEST_MODULE = """
import pytest
from django.test import TransactionTestCase

from pg_lease_django import Lease, hold


@pytest.mark.django_db(transaction=True)
def test_hold_then_flush(lease_key, assert_lease_held):
    with hold(lease_key, ttl=30) as lease:
        assert_lease_held(lease)


@pytest.mark.django_db(transaction=True)
def test_acquire_then_flush(lease_key):
    assert Lease.objects.acquire(lease_key, "me", 30) is not None


class Flushed(TransactionTestCase):
    def test_acquire(self):
        assert Lease.objects.acquire("smoke:unittest", "me", 30) is not None
"""


def main() -> None:
    import pg_lease_django

    installed = Path(pg_lease_django.__file__).resolve()
    assert installed.is_relative_to(VENV.resolve()), f"pg_lease_django imported from {installed}, not the virtualenv"
    print(f"pg_lease_django {pg_lease_django.__version__} from {installed.parent}")

    url = os.environ["DATABASE_URL"]
    name = f"wheel_smoke_{uuid.uuid4().hex[:8]}"
    settings = database(url, name)
    admin = psycopg.connect(
        host=settings["HOST"], port=settings["PORT"] or None, user=settings["USER"] or None,
        password=settings["PASSWORD"] or None, dbname="postgres", autocommit=True,
    )  # fmt: skip
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        smoke(settings)
    finally:
        for db in (name, f"test_{name}"):
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.close()
    print("wheel smoke test: all passed")


def smoke(settings: dict[str, str]) -> None:
    run(HERE, "-m", "django", "startproject", "smoke")
    root = HERE / "smoke"
    path = root / "smoke" / "settings.py"
    text = path.read_text()
    text, added = re.subn(
        r"^(INSTALLED_APPS = \[\n(?:    .*\n)*)\]\n", r'\1    "pg_lease_django",\n]\n', text, flags=re.M
    )
    text, replaced = re.subn(
        r"^DATABASES = \{\n.*?^\}\n", lambda _: f"DATABASES = {{'default': {settings!r}}}\n", text, flags=re.M | re.S
    )
    assert added == replaced == 1, f"startproject's settings.py changed shape:\n{text}"
    path.write_text(text)

    migrated = run(root, "manage.py", "migrate")
    assert re.search(r"Applying pg_lease_django\.0001_baseline\.\.\. OK", migrated), migrated
    print("migrate ok")
    checked = run(root, "manage.py", "check", "--database", "default")
    assert "System check identified no issues" in checked, checked
    print("check --database default ok")

    shell = "from pg_lease_django import Lease; print(Lease.objects.acquire('smoke', 'wheel-smoke', ttl=3600).epoch)"
    assert run(root, "manage.py", "shell", "-c", shell).split()[-1] == "1"
    listed = run(root, "manage.py", "leases", "list")
    assert "smoke" in listed and "wheel-smoke" in listed, listed
    shown = run(root, "manage.py", "leases", "show", "smoke")
    assert re.search(r"^state:\s+held$", shown, re.M), shown
    print("manage.py leases ok")

    run(root, "manage.py", "shell", "-c", f"VENV = {str(VENV.resolve())!r}\n{ADMIN_PAGE}")
    print("admin templates ok")

    (root / "test_smoke.py").write_text(PYTEST_MODULE)
    (root / "pytest.ini").write_text("[pytest]\nDJANGO_SETTINGS_MODULE = smoke.settings\n")
    tested = run(root, "-m", "pytest", "-p", "no:cacheprovider", "-v", "test_smoke.py")
    assert re.search(r"\b3 passed\b", tested), tested
    assert re.search(r"^plugins:.*\bpg[-_]lease[-_]django-", tested, re.M), tested  # loaded from its entry point
    print("pytest plugin ok (3 passed)")


if __name__ == "__main__":
    main()
