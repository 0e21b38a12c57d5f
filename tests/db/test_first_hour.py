"""The first hour's rough edges (issue 28, items 1-3 and 5), in-process; tests/acceptance/test_newcomer.py walks
them in a new ``startproject`` as a newcomer would.

1. An unmigrated database: ``manage.py leases`` says so in one line; plain ``check`` warns (W007).
2. A non-PostgreSQL database where no check runs (``manage.py shell``): E001's words, not the
   other backend's syntax error.
3. A refused flush (no ``TEST_RUNNER``): ``manage.py flush`` names the refusal and the cure.
5. A changed ``PG_LEASE_HISTORY``: plain ``check`` warns (W005), ``migrate`` says what it changed.
7. Small inconsistencies: ``leases inspect`` (as ``inspect()``); ``--ttl 30s`` (as ``--free-for 30d``);
   an out-of-range TTL says the range; "(never acquired, or pruned)"; an unfenced write names
   ``FencedModelAdmin``; a nested hold of the same key says so, at once, also when blocking; a hold
   that ends inside the test's own transaction says why its release waited.
"""

from __future__ import annotations

import asyncio
import json
import logging
from io import StringIO

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings

from devkit.testapp.models import Invoice
from pg_lease_django import InvalidInputError, Lease, NotAcquirableError, UnfencedWriteError, hold
from pg_lease_django.checks import check_lease_database_without_database_option
from pg_lease_django.provisioning import history
from pg_lease_django.sql.errors import truncate_refusal
from tests.helpers import conninfo, own_findings

# Plain `check` runs check W008 over the cluster's roles: beside the tests that make a role a bypass.
pytestmark = pytest.mark.xdist_group("cluster-roles")

# ---- 1 and 5: plain `check` runs the lease database's checks -----------------------------------------


@pytest.mark.django_db
def test_plain_check_finds_nothing_on_a_migrated_database_and_leaves_check_database_to_the_others() -> None:
    assert own_findings(check_lease_database_without_database_option(), "", str) == []
    with override_settings(PG_LEASE_HISTORY=["first-hour:"]):
        # With databases (check --database, migrate, the test runner), W002-W006 run themselves.
        assert own_findings(check_lease_database_without_database_option(databases=["default"]), "", str) == []


@pytest.mark.django_db
def test_plain_check_warns_when_the_history_setting_changed_since_migrate() -> None:
    with override_settings(PG_LEASE_HISTORY=["first-hour:"]):
        [warning] = own_findings(check_lease_database_without_database_option(), "", str)
    assert warning.id == "pg_lease_django.W005"
    assert "first-hour:" in warning.msg
    assert warning.hint is not None and "manage.py migrate" in warning.hint


@pytest.mark.django_db
def test_migrate_says_what_it_changed_in_the_history_scope_and_then_nothing() -> None:
    before = history.recorded_prefixes()
    try:
        with override_settings(PG_LEASE_HISTORY=["first-hour:", "other:"]):
            out = StringIO()
            history.sync_after_migrate("default", verbosity=1, stdout=out)
            assert "now records the lease history of keys starting with ['first-hour:', 'other:']" in out.getvalue()
            again = StringIO()
            history.sync_after_migrate("default", verbosity=1, stdout=again)
            assert again.getvalue() == ""  # nothing changed: nothing said
            quiet = StringIO()
            with override_settings(PG_LEASE_HISTORY=["first-hour:"]):
                history.sync_after_migrate("default", verbosity=0, stdout=quiet)
            assert quiet.getvalue() == ""
            assert history.recorded_prefixes() == ("first-hour:",)
    finally:
        history.sync_scope()
    assert history.recorded_prefixes() == before


# ---- 2: a non-PostgreSQL database outside the checks --------------------------------------------


def test_a_lease_call_on_sqlite_names_the_system_check_not_a_syntax_error() -> None:
    manager = Lease.objects.db_manager("sqlite")
    with pytest.raises(
        ImproperlyConfigured, match=r"database 'sqlite' is sqlite \(system check pg_lease_django\.E001\)"
    ):
        manager.acquire("first-hour:sqlite", "me", 30)
    with pytest.raises(ImproperlyConfigured, match=r"pg_lease_django\.E001"):
        manager.inspect("first-hour:sqlite")
    with pytest.raises(ImproperlyConfigured, match=r"pg_lease_django\.E001"):
        asyncio.run(manager.aacquire("first-hour:sqlite", "me", 30, blocking=True, timeout=1))
    with (
        pytest.raises(ImproperlyConfigured, match=r"pg_lease_django\.E001"),
        hold("first-hour:sqlite", ttl=30, using="sqlite"),
    ):
        pass


# ---- 3: a refused flush ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_flush_refused_by_the_lease_table_names_the_runner_and_the_plugin(key: str) -> None:
    assert Lease.objects.acquire(key, "me", ttl=30) is not None
    # As on a database the runner did not set up; SET LOCAL, in a transaction of the test's own, so
    # that behind a transaction-pooling PgBouncer it stays on this server session and ends with it.
    with transaction.atomic(), pytest.raises(CommandError) as refused:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL pg_lease.allow_truncate = off")
        call_command("flush", interactive=False, verbosity=0)  # its own atomic() is a savepoint here
    message = str(refused.value)
    assert "couldn't be flushed: pg_lease_django refused the TRUNCATE" in message, message
    assert 'TEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner"' in message, message
    assert "pytest-django" in message and "pg_lease_django plugin" in message, message
    assert "Possible reasons" not in message, message
    assert Lease.objects.inspect(key).epoch == 1  # nothing was deleted


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("table", "sqlstate"), [("pg_lease_django_lease", "23001"), ("testapp_invoice", "PL004")])
def test_the_databases_own_truncate_refusal_names_the_runner_and_the_plugin(table: str, sqlstate: str) -> None:
    """The hint psql and every other client see (it named pg_lease_check_fence, wrong for a flush)."""
    conn = psycopg.connect(conninfo(), autocommit=True)
    try:
        with pytest.raises(psycopg.Error) as refused, conn.transaction():
            conn.execute("SET LOCAL pg_lease.allow_truncate = off")
            conn.execute(f"TRUNCATE {table} CASCADE")
    finally:
        conn.close()
    diag = refused.value.diag
    assert diag.sqlstate == sqlstate and "TRUNCATE" in (diag.message_primary or "")
    hint = diag.message_hint or ""
    assert "TEST_RUNNER = 'pg_lease_django.testing.LeaseTestRunner'" in hint, hint
    assert "pytest-django (the pg_lease_django pytest plugin)" in hint, hint
    assert "test databases only" in hint and "pg_lease_check_fence" not in hint, hint


def test_truncate_refusal_ignores_other_errors() -> None:
    assert truncate_refusal(None) is None
    assert truncate_refusal(RuntimeError("TRUNCATE")) is None
    outer = CommandError("outer")
    outer.__cause__ = ValueError("TRUNCATE")
    assert truncate_refusal(outer) is None


# ---- 7: small inconsistencies ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_leases_inspect_is_leases_show(key: str) -> None:
    assert Lease.objects.acquire(key, "me", ttl=30) is not None
    shown, inspected = StringIO(), StringIO()
    call_command("leases", "show", key, "--json", stdout=shown)
    call_command("leases", "inspect", key, "--json", stdout=inspected)
    volatile = ("server_time", "expires_in_seconds")
    same = [{k: v for k, v in json.loads(out.getvalue()).items() if k not in volatile} for out in (shown, inspected)]
    assert same[0] == same[1] and same[1]["owner"] == "me", same


@pytest.mark.django_db(transaction=True)
def test_leases_run_takes_durations_with_units_as_prune_does(key: str) -> None:
    call_command("leases", "run", key, "--ttl", "1m", "--wait", "2s", "--grace", "0.5m", "--", "true")
    assert Lease.objects.inspect(key).epoch == 2  # granted, then released
    with pytest.raises(CommandError, match=r"--ttl must be between 0\.001 and 31536000 seconds, got '366d'"):
        call_command("leases", "run", key, "--ttl", "366d", "--", "true")
    with pytest.raises(CommandError, match=r"--ttl must be a number of seconds or a duration such as 30s"):
        call_command("leases", "run", key, "--ttl", "30 sec", "--", "true")


def test_a_ttl_out_of_range_says_the_range_not_finite() -> None:
    for ttl in (10**12, -(10**13), float("inf")):
        with pytest.raises(InvalidInputError, match=r"^ttl must be between 0\.001 s and 365 days, got "):
            Lease.objects.acquire("first-hour:ttl", "me", ttl)
    with pytest.raises(InvalidInputError, match=r"^ttl must be a number of seconds, got nan"):
        Lease.objects.acquire("first-hour:ttl", "me", float("nan"))


@pytest.mark.django_db(transaction=True)
def test_leases_show_of_a_missing_key_says_it_may_have_been_pruned(key: str) -> None:
    with pytest.raises(CommandError, match=r"\(never acquired, or pruned\)$"):
        call_command("leases", "show", key)


def test_an_unfenced_write_names_the_fenced_admin() -> None:
    with pytest.raises(UnfencedWriteError, match=r"in the admin, register the model with .*FencedModelAdmin"):
        Invoice(account="first-hour", amount=1).save()


@pytest.mark.django_db(transaction=True)
def test_a_nested_hold_of_the_same_key_says_so_at_once(key: str) -> None:
    with hold(key, ttl=30) as outer:
        for blocking in (False, True):
            nested_hold = hold(key, ttl=30, blocking=True, timeout=600) if blocking else hold(key, ttl=30)
            with pytest.raises(NotAcquirableError, match="already held by an enclosing hold") as nested, nested_hold:
                pass
            assert (nested.value.holder, nested.value.current_epoch) == (outer.owner, outer.epoch)
        assert not outer.lost
        with hold(f"{key}:other", ttl=30):  # another key nests as before
            pass
    with hold(key, ttl=30):  # after the outer one: a hold as any
        pass


# Transactional, with the TestCase's situation made explicit (atomic() around the hold): the lease
# row it leaves is flushed with the rest, so no later test (prune's) finds it.
@pytest.mark.django_db(transaction=True)
def test_a_hold_ended_inside_the_tests_transaction_says_why_its_release_waited(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pg_lease_django"), transaction.atomic(), hold(key, ttl=3):
        Invoice(account=key, amount=1).save()  # its fence locks the lease row until atomic() commits
    [warning] = [record.getMessage() for record in caplog.records if "releasing lease" in record.getMessage()]
    assert "the hold ended inside a transaction on database 'default'" in warning, warning
    assert "TransactionTestCase" in warning, warning
