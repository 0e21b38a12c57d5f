"""pg_lease_django.testing and the pytest plugin: flushable test databases, and the lease helpers.

The end-to-end tests generate a small project (an app ``billing`` with a fenced ``Invoice`` and a
view that bills under a hold) and run its tests in a subprocess, through Django's runner and
through pytest-django, on a database name of their own. Its test modules ``billing/tests.py`` and
``billing/test_jobs.py`` are the samples of docs/testing.md, taken verbatim from the page.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.test.runner import DiscoverRunner

from devkit import dbserver
from devkit.testapp.models import Invoice
from pg_lease_django import EpochMovedOnError, Grant, Lease, LeaseState, NotOwnerError, current_lease, hold
from pg_lease_django.testing import (
    TAKEOVER_OWNER,
    LeaseTestRunner,
    allow_truncate_on_created,
    allow_truncate_on_test_databases,
    plan_test_databases,
    start_as_other_owner,
    unique_lease_key,
)
from tests.acceptance.test_docs import python_blocks
from tests.helpers import conninfo

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "testing.md"

# The refusals a flush meets without the setting: the lease table's, or a fenced table's.
REFUSED_TRUNCATE = ("lease rows are never deleted (TRUNCATE would reset every epoch)", "TRUNCATE of fenced table")


# ---- the generated project ----------------------------------------------------------------------

SETTINGS = """\
import os

SECRET_KEY = "generated-for-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["pg_lease_django", "billing"]
DATABASES = {"default": {**DATABASE, "NAME": os.environ["BILLING_DB_NAME"]}}
ROOT_URLCONF = "shopsite.urls"
STATIC_URL = "static/"
TEST_RUNNER = os.environ.get("BILLING_TEST_RUNNER", "django.test.runner.DiscoverRunner")
"""

URLS = """\
from django.urls import path

from billing import views

urlpatterns = [path("bill/<str:account>/<int:amount>/", views.bill)]
"""

MODELS = """\
from django.db import models

from pg_lease_django import FencedModel


class Invoice(FencedModel):
    account = models.CharField(max_length=200)
    status = models.CharField(max_length=20, default="draft")
    amount = models.IntegerField(default=0)

    lease_key_fields = ("account",)

    def get_lease_key(self):
        return self.account
"""

VIEWS = """\
from django.http import HttpResponse

from pg_lease_django import hold

from .models import Invoice


def bill(request, account, amount):
    with hold(account, ttl=10):
        Invoice(account=account, amount=amount).save()
    return HttpResponse(str(Invoice.objects.filter(account=account).count()))
"""

MANAGE = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = shopsite.settings
python_files = test_*.py
addopts = -p no:cacheprovider
"""

# Tests that use no fixture of the plugin, so that they also run with the plugin disabled.
TEST_FLUSH = """\
import uuid
from urllib.request import urlopen

import pytest

from billing.models import Invoice
from pg_lease_django import Lease


def write_one(amount):
    key = f"flush:{uuid.uuid4().hex}"
    grant = Lease.objects.acquire(key, "worker-1", ttl=30)
    Invoice(account=key, amount=amount).save(fence=grant)


@pytest.mark.django_db(transaction=True)
def test_flush_a_transactional_test_writes():
    write_one(1)


@pytest.mark.django_db(transaction=True)
def test_flush_b_the_next_one_starts_empty():
    write_one(2)
    assert list(Invoice.objects.values_list("amount", flat=True)) == [2]


def test_live_server_bills_under_its_lease(live_server):
    key = f"live:{uuid.uuid4().hex}"
    with urlopen(f"{live_server.url}/bill/{key}/7/") as response:
        assert response.read() == b"1"
    assert Lease.objects.inspect(key).status == "free"
"""


def docs_file(name: str) -> str:
    """The python block of docs/testing.md that starts with the comment ``# <name>``."""
    found = [block.source for block in python_blocks(PAGE) if block.source.startswith(f"# {name}\n")]
    assert len(found) == 1, f"docs/testing.md should have one block starting with '# {name}'"
    return found[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with an app ``billing`` whose test modules are the samples of docs/testing.md."""
    root = tmp_path_factory.mktemp("project")
    database = {key: value for key, value in dbserver.database_settings().items() if key != "NAME"}
    files = {
        "manage.py": MANAGE,
        "pytest.ini": PYTEST_INI,
        "shopsite/__init__.py": "",
        "shopsite/settings.py": f"DATABASE = {database!r}\n{SETTINGS}",
        "shopsite/urls.py": URLS,
        "billing/__init__.py": "",
        "billing/migrations/__init__.py": "",
        "billing/models.py": MODELS,
        "billing/views.py": VIEWS,
        "billing/tests.py": docs_file("billing/tests.py"),
        "billing/test_jobs.py": docs_file("billing/test_jobs.py"),
        "billing/test_flush.py": TEST_FLUSH,
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    done = run(root, "postgres", [sys.executable, "manage.py", "makemigrations", "billing"])
    assert done.returncode == 0, done.stdout
    return root


def server_conninfo() -> str:
    return dbserver.conninfo(dbserver.database_settings(), dbname="postgres")


@pytest.fixture
def db_name() -> Iterator[str]:
    """A database name no other run uses, created empty (the project's "real" database); afterwards
    it and every test database made from it are dropped."""
    base = dbserver.database_settings()["NAME"][:30]
    name = f"{base}_gen_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    with psycopg.connect(server_conninfo(), autocommit=True) as conn:
        for database in [f"test_{name}_2", f"test_{name}_1", f"test_{name}", name]:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def run(root: Path, db_name: str, command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the project, its stderr folded into stdout."""
    environ = {**os.environ, "DJANGO_SETTINGS_MODULE": "shopsite.settings", "BILLING_DB_NAME": db_name, **env}
    environ.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        command, cwd=root, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )


def database_settings_of(name: str) -> list[str]:
    """The settings ``ALTER DATABASE name SET`` stored (for every role)."""
    with psycopg.connect(server_conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase "
            "WHERE d.datname = %s AND s.setrole = 0",
            [name],
        ).fetchone()
    return list(row[0]) if row else []


def manage_test(root: Path, db_name: str, *args: str, runner: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"BILLING_TEST_RUNNER": runner} if runner else {}
    return run(root, db_name, [sys.executable, "manage.py", "test", "billing.tests", "--noinput", *args], **env)


def assert_flush_refused(output: str) -> None:
    assert "couldn't be flushed" in output, output
    assert any(cause in output for cause in REFUSED_TRUNCATE), output


# ---- Django's test runner -----------------------------------------------------------------------


@pytest.mark.slow
def test_django_runner_cannot_flush_without_lease_runner_and_can_with_it_on_the_kept_database(
    project: Path, db_name: str
) -> None:
    without = manage_test(project, db_name, "--keepdb")
    assert without.returncode != 0
    assert_flush_refused(without.stdout)
    assert database_settings_of(f"test_{db_name}") == []

    # The same kept database (--keepdb), now with the runner: set, and every test case passes.
    with_runner = manage_test(project, db_name, "--keepdb", runner="pg_lease_django.testing.LeaseTestRunner")
    assert with_runner.returncode == 0, with_runner.stdout
    assert "Ran 4 tests" in with_runner.stdout
    assert database_settings_of(f"test_{db_name}") == ["pg_lease.allow_truncate=on"]
    assert database_settings_of(db_name) == []  # never the project's own database


@pytest.mark.slow
def test_django_runner_sets_every_clone_of_a_parallel_run(project: Path, db_name: str) -> None:
    done = manage_test(
        project, db_name, "--parallel", "2", "--keepdb", runner="pg_lease_django.testing.LeaseTestRunner"
    )
    assert done.returncode == 0, done.stdout
    assert "Ran 4 tests" in done.stdout
    for clone in (f"test_{db_name}_1", f"test_{db_name}_2"):
        assert database_settings_of(clone) == ["pg_lease.allow_truncate=on"]
    assert database_settings_of(db_name) == []


# ---- pytest-django ------------------------------------------------------------------------------


@pytest.mark.slow
def test_pytest_django_cannot_flush_without_the_plugin_and_can_with_it_on_the_reused_database(
    project: Path, db_name: str
) -> None:
    pytest_command = [sys.executable, "-m", "pytest", "-v", "--reuse-db"]
    without = run(project, db_name, [*pytest_command, "-p", "no:pg_lease_django", "billing/test_flush.py"])
    assert without.returncode != 0
    assert_flush_refused(without.stdout)

    # The database kept by --reuse-db, now with the plugin (loaded from its entry point).
    done = run(project, db_name, pytest_command)
    assert done.returncode == 0, done.stdout
    for test in [
        "test_flush.py::test_flush_a_transactional_test_writes",
        "test_flush.py::test_flush_b_the_next_one_starts_empty",
        "test_flush.py::test_live_server_bills_under_its_lease",
        "test_jobs.py::test_bill_runs_under_its_lease",
        "test_jobs.py::test_bill_stops_when_its_lease_is_lost",
        "test_jobs.py::test_bill_is_skipped_while_another_worker_holds_the_lease",
    ]:
        assert f"{test} PASSED" in done.stdout, done.stdout
    assert database_settings_of(f"test_{db_name}") == ["pg_lease.allow_truncate=on"]
    assert database_settings_of(db_name) == []


PLAIN_TESTS = """\
def test_plain():
    pass


def test_a_key_needs_no_database(lease_key):
    assert lease_key.startswith("test_a_key_needs_no_database:")
"""


def test_the_plugin_leaves_projects_without_django_settings_alone(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n", encoding="utf-8")
    (tmp_path / "test_plain.py").write_text(PLAIN_TESTS, encoding="utf-8")
    environ = dict(os.environ)
    for name in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS"):
        environ.pop(name, None)
    command = [sys.executable, "-m", "pytest", "-q"]
    done = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


# ---- which databases are set --------------------------------------------------------------------


def test_lease_runner_is_djangos_runner() -> None:
    assert issubclass(LeaseTestRunner, DiscoverRunner)


def test_only_databases_django_created_for_the_tests_qualify() -> None:
    default = connections["default"]
    test_name = default.settings_dict["NAME"]
    skipped = [
        (default, test_name, True),  # the name did not change: not a test database made from NAME
        (default, "real", False),  # a mirror, or an alias sharing a database set up by another one
        (connections["sqlite"], "real", True),  # not PostgreSQL
    ]
    assert allow_truncate_on_test_databases(skipped) == []


@pytest.mark.django_db(transaction=True)
def test_a_test_database_is_set_for_sessions_opened_afterwards() -> None:
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE {connection.ops.quote_name(name)} RESET pg_lease.allow_truncate")
    try:
        with psycopg.connect(conninfo()) as conn:
            assert conn.execute("SELECT current_setting('pg_lease.allow_truncate', true)").fetchone() in [
                (None,),
                ("",),
            ]
        assert allow_truncate_on_test_databases([(connection, "the_real_name", True)]) == [name]
        assert connection.connection is None  # closed: Django reconnects with the setting
        with connection.cursor() as cursor:
            cursor.execute("SHOW pg_lease.allow_truncate")
            assert cursor.fetchone() == ("on",)
    finally:
        with connection.cursor() as cursor:  # whatever happened, leave the suite's database flushable
            cursor.execute(f"ALTER DATABASE {connection.ops.quote_name(name)} SET pg_lease.allow_truncate = on")
        connection.close()


def test_the_plugin_sets_only_aliases_moved_to_their_test_name() -> None:
    planned = plan_test_databases()
    assert set(planned) == {"default", "other"}  # PostgreSQL aliases only
    current = connections["default"].settings_dict["NAME"]
    assert allow_truncate_on_created({"default": ("real", "test_real")}) == []  # pointed elsewhere
    assert allow_truncate_on_created({"default": (current, current)}) == []  # never moved


# ---- the helpers ----------------------------------------------------------------------------------


def test_lease_key_is_the_tests_name_and_unique(lease_key: str, request: pytest.FixtureRequest) -> None:
    assert lease_key.startswith(f"{request.node.name}:")
    assert unique_lease_key(request.node.name) != lease_key


def test_unique_lease_key_cuts_a_long_prefix_on_a_character_boundary() -> None:
    key = unique_lease_key("é" * 300)
    assert len(key.encode()) <= 100 + 13
    assert key.startswith("é" * 50 + ":")


def test_assertions_on_held_free_and_lapsed_leases(
    lease_key: str,
    assert_lease_held: Callable[..., LeaseState],
    assert_lease_free: Callable[..., LeaseState],
) -> None:
    assert assert_lease_free(lease_key).status == "free"
    with pytest.raises(AssertionError, match="is not held: status free"):
        assert_lease_held(lease_key)

    grant = Lease.objects.acquire(lease_key, "worker-1", ttl=0.3)
    assert grant is not None
    assert assert_lease_held(grant).owner == "worker-1"  # a Grant: its owner and epoch
    with pytest.raises(AssertionError, match="held by 'worker-1', not 'worker-2'"):
        assert_lease_held(lease_key, owner="worker-2")
    with pytest.raises(AssertionError, match=f"at epoch {grant.epoch}, not {grant.epoch + 1}"):
        assert_lease_held(lease_key, epoch=grant.epoch + 1)
    with pytest.raises(AssertionError, match="is held: status held, owner 'worker-1'"):
        assert_lease_free(lease_key)

    time.sleep(0.4)
    assert assert_lease_free(grant).status == "lapsed"
    with pytest.raises(AssertionError, match="is not held: status lapsed"):
        assert_lease_held(lease_key)


def test_take_over_a_hold_waits_until_it_noticed(lease_key: str, take_over_lease: Callable[..., Grant]) -> None:
    with hold(lease_key, ttl=1) as lease:
        Invoice(account=lease_key).save()
        grant = take_over_lease(lease, owner="worker-2")
        assert lease.lost
        with pytest.raises(NotOwnerError):
            lease.check()
    assert (grant.owner, grant.epoch) == ("worker-2", lease.epoch + 2)  # freed (+1), then acquired (+1)
    assert Lease.objects.inspect(lease_key).owner == "worker-2"


def test_a_takeover_refuses_the_old_holders_writes_before_it_noticed(
    lease_key: str, take_over_lease: Callable[..., Grant]
) -> None:
    with hold(lease_key, ttl=30) as lease:  # next renewal in 10 s
        take_over_lease(lease, wait=None)
        assert not lease.lost
        with pytest.raises(NotOwnerError):
            Invoice(account=lease_key).save()  # fenced by the hold: refused by the database at once
    assert Lease.objects.inspect(lease_key).owner == TAKEOVER_OWNER


def test_take_over_by_key_whether_free_or_held(lease_key: str, take_over_lease: Callable[..., Grant]) -> None:
    first = take_over_lease(lease_key, owner="worker-1", ttl=30)  # free: just acquired
    second = take_over_lease(lease_key, owner="worker-2")
    assert (first.owner, second.owner, second.epoch) == ("worker-1", "worker-2", first.epoch + 2)


def test_take_over_refuses_a_grant_that_moved_on(
    lease_key: str, take_over_lease: Callable[..., Grant], assert_lease_held: Callable[..., LeaseState]
) -> None:
    old = Lease.objects.acquire(lease_key, "worker-1", ttl=30)
    assert old is not None
    take_over_lease(lease_key, owner="worker-2")
    with pytest.raises(AssertionError, match="held by 'worker-2', not 'worker-1'"):
        assert_lease_held(old)
    with pytest.raises(EpochMovedOnError):
        take_over_lease(old)
    assert Lease.objects.inspect(lease_key).owner == "worker-2"  # nothing changed


def test_run_as_other_owner_runs_elsewhere_without_the_tests_hold(
    lease_key: str, run_as_other_owner: Callable[..., Any]
) -> None:
    with hold(lease_key, ttl=10) as lease:
        thread, held, grant = run_as_other_owner(
            lambda: (threading.get_ident(), current_lease(), Lease.objects.acquire(lease_key, "worker-2", ttl=10))
        )
        assert thread != threading.get_ident()
        assert (held, grant) == (None, None)  # no hold there; the lease is taken
    assert run_as_other_owner(lambda: Lease.objects.acquire(lease_key, "worker-2", ttl=10)).owner == "worker-2"
    assert lease.epoch < Lease.objects.inspect(lease_key).epoch

    def fail() -> None:
        raise NotOwnerError("from the other owner", key=lease_key)

    with pytest.raises(NotOwnerError, match="from the other owner"):
        run_as_other_owner(fail)


def test_start_as_other_owner_and_wait_later() -> None:
    go = threading.Event()
    other = start_as_other_owner(lambda: go.wait(10))
    with pytest.raises(AssertionError, match=r"did not finish within 0\.05 s"):
        other.result(timeout=0.05)
    go.set()
    assert other.result() is True
