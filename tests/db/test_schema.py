"""The table's shape decides correctness (logged, never deleted) and speed (HOT renewals)."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from pg_lease_django import Lease
from pg_lease_django.checks import check_database_is_postgresql

pytestmark = pytest.mark.django_db


def fetch(sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return list(cursor.fetchall())


def test_table_is_logged_with_fillfactor_for_hot_updates() -> None:
    [(persistence, options)] = fetch(
        "SELECT relpersistence, reloptions FROM pg_class WHERE oid = 'pg_lease_django_lease'::regclass"
    )
    assert persistence == "p", "an UNLOGGED table is truncated after a crash, resetting epochs"
    fillfactor = int(next(o for o in options if o.startswith("fillfactor=")).split("=")[1])
    assert 50 <= fillfactor <= 70


def test_only_the_key_is_indexed() -> None:
    """An index on owner, epoch or expires_at would make every renewal a non-HOT update."""
    indexed = fetch(
        """SELECT DISTINCT a.attname FROM pg_index i
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
           WHERE i.indrelid = 'pg_lease_django_lease'::regclass"""
    )
    assert indexed == [("key",)]
    [(primary_key,)] = fetch(
        """SELECT pg_get_indexdef(indexrelid) FROM pg_index
           WHERE indrelid = 'pg_lease_django_lease'::regclass AND indisprimary"""
    )
    assert "(key)" in primary_key


def test_named_constraints_exist() -> None:
    names = {
        row[0] for row in fetch("SELECT conname FROM pg_constraint WHERE conrelid = 'pg_lease_django_lease'::regclass")
    }
    assert {"pg_lease_key_length", "pg_lease_owner_length", "pg_lease_epoch_non_negative"} <= names


def test_lease_rows_cannot_be_deleted(key: str) -> None:
    from django.db import IntegrityError, transaction

    Lease.objects.acquire(key, "w1", ttl=30)
    with pytest.raises(IntegrityError, match="deleted only when it is not held"), transaction.atomic():
        Lease.objects.filter(key=key).delete()
    assert Lease.objects.inspect(key).epoch == 1


def test_renewals_are_hot_updates(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    [(ctid_before,)] = fetch("SELECT ctid::text FROM pg_lease_django_lease WHERE key = %s", [key])
    for _ in range(20):
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
    # A HOT chain stays on the same heap page: the page number of ctid must not change.
    [(ctid_after,)] = fetch("SELECT ctid::text FROM pg_lease_django_lease WHERE key = %s", [key])
    assert ctid_before.strip("()").split(",")[0] == ctid_after.strip("()").split(",")[0]


def test_functions_pin_their_search_path_and_the_operations_run_as_owner() -> None:
    rows = fetch(
        """SELECT proname, prosecdef, proconfig FROM pg_proc
           WHERE starts_with(proname, 'pg_lease_') AND pronamespace = current_schema()::regnamespace"""
    )
    operations = {
        "pg_lease_acquire",
        "pg_lease_acquire_or_register",
        "pg_lease_acquire_within",
        "pg_lease_renew",
        "pg_lease_heartbeat",
        "pg_lease_release",
        "pg_lease_inspect",
        "pg_lease_fence",
        "pg_lease_check_fence",
        "pg_lease_fence_outcome",
        "pg_lease_force_release",
        "pg_lease_prune",
        "pg_lease_advance_epochs",
        "pg_lease_guard_key",  # the triggers' lease-row check: locking it needs the owner's rights
        "pg_lease_guard_one_key",  # the same check's common case, one locked read
        "pg_lease_request_handoff",
        "pg_lease_record_transition",  # the history trigger: whoever changes a lease row, its tenure is recorded
        "pg_lease_record_tenure",  # writes the tenure table for the lease table's triggers
        "pg_lease_guard_update",  # the lease table's update rules: the history and the scope, whoever writes
        "pg_lease_rescope",  # re-flags every lease row when the scope changes, whoever changes it
        "pg_lease_in_history_scope",  # reads the scope table for the lease table's triggers, whoever writes
        "pg_lease_opt_out_token",  # reads the owner's secret (an operator's, as pg_lease_allow_unfenced)
        "pg_lease_opt_out_valid",  # checks a token against the secret
        "pg_lease_opt_out_hash",  # the token itself, from the owner's secret
        "pg_lease_compile_key_scope",  # replaces pg_lease_check_key_scope, the owner's function
        "pg_lease_key_scope_changed",  # the scope table's trigger: recompiles whoever changes it
        "pg_lease_session_scope",  # reads the scope table for the session
        "pg_lease_check_key_scopes",  # an opted-out write's keys, checked with the owner's rights
        "pg_lease_replication_apply",  # is the session's login the owner's (current_user inside)?
        "pg_lease_metrics",  # counts of the lease, waiter and tenure tables for a monitoring role
    }
    assert {r[0] for r in rows} >= operations
    # Hot helpers without a SET clause (it blocks inlining, or costs a switch per call): they name
    # only exact-typed built-ins and are called from functions that pin their own search_path.
    inlinable = {
        "pg_lease_status",
        "pg_lease_verdict",
        "pg_lease_remember_fence",
        "pg_lease_waiter_lock",
        "pg_lease_wake_waiters",  # every release; revoked from PUBLIC
        "pg_lease_guard_update",  # every acquire and release; names every built-in and operator with its schema
        "pg_lease_key_allowed",  # every operation, inlined; revoked from PUBLIC, names every built-in with its schema
        "pg_lease_presented_fences",  # every fenced write; names every built-in with its schema
        "pg_lease_metrics_label",  # every row of a scrape, inlined; pure, as pg_lease_status
    }
    for name, security_definer, config in rows:
        # Workers need no privilege on the lease table: the operations run as its owner. The rest
        # (input checks, triggers) run as the caller, so the triggers see the writer's own role.
        assert security_definer == (name in operations), name
        if name not in inlinable:
            assert any(c.startswith("search_path=pg_catalog,") for c in config or []), name
    # Without a pinned search_path, only the lease functions (its owner's) may call it.
    for helper in ("pg_lease_wake_waiters(text)", "pg_lease_key_allowed(text)"):
        [(public_may_call,)] = fetch(
            "SELECT has_function_privilege('public', format('%%I.%%s', current_schema(), %s), 'EXECUTE')", [helper]
        )
        assert not public_may_call, helper


def test_migrations_are_in_sync_with_models() -> None:
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)  # exits non-zero on drift


def test_system_check_refuses_a_non_postgresql_lease_database() -> None:
    class RouteLeasesToSqlite:
        def db_for_write(self, model: Any, **hints: Any) -> str | None:
            return "sqlite" if model._meta.app_label == "pg_lease_django" else None

    assert check_database_is_postgresql() == []
    with override_settings(DATABASE_ROUTERS=[RouteLeasesToSqlite()]):
        [error] = check_database_is_postgresql()
    assert error.id == "pg_lease_django.E001"
    assert error.hint


@pytest.mark.django_db(transaction=True)
def test_truncate_is_refused_unless_the_test_only_setting_allows_it(key: str, raw_connect: Any) -> None:
    import psycopg

    assert Lease.objects.acquire(key, "w1", ttl=30) is not None
    conn = raw_connect()
    conn.execute("SET pg_lease.allow_truncate = off")  # as on any database that did not opt in
    with pytest.raises(psycopg.errors.RestrictViolation, match="never deleted"):
        conn.execute("TRUNCATE pg_lease_django_lease")
    assert Lease.objects.inspect(key).epoch == 1


@pytest.mark.django_db(transaction=True)
def test_check_reports_a_migrated_database_whose_lease_table_is_out_of_reach(raw_connect: Any) -> None:
    from pg_lease_django.checks import check_lease_table_is_reachable

    assert check_lease_table_is_reachable(databases=["default"]) == []
    assert check_lease_table_is_reachable() == []  # database checks only run when asked for a database
    conn = raw_connect()
    conn.execute("CREATE SCHEMA no_leases_here")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET search_path = no_leases_here")
            # No migration record on this path either: Django's own notice covers that, not W002.
            assert check_lease_table_is_reachable(databases=["default"]) == []
            # Recorded as migrated, but no lease table on the path: W002.
            cursor.execute("CREATE TABLE no_leases_here.django_migrations AS SELECT * FROM public.django_migrations")
            [warning] = check_lease_table_is_reachable(databases=["default"])
            cursor.execute("RESET search_path")
    finally:
        conn.execute("DROP SCHEMA no_leases_here CASCADE")
    assert warning.id == "pg_lease_django.W002" and "search_path" in warning.msg and warning.hint


def test_check_reports_a_database_with_only_some_lease_migrations() -> None:
    """A database that applied only part of the development chain the baseline replaces cannot
    migrate: W004 names the missing migrations and how to finish them."""
    from pg_lease_django.checks import check_lease_migrations_are_complete

    assert check_lease_migrations_are_complete(databases=["default"]) == []
    assert check_lease_migrations_are_complete() == []  # database checks only run when asked for a database
    with connection.cursor() as cursor:  # rolled back with the test's transaction
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'pg_lease_django' AND name IN (%s, %s)",
            ["0006_notify_waiters", "0008_cheap_refusal"],
        )
    [warning] = check_lease_migrations_are_complete(databases=["default"])
    assert warning.id == "pg_lease_django.W004"
    assert "0006_notify_waiters, 0008_cheap_refusal are missing" in warning.msg
    assert "0010_one_statement" in (warning.hint or "")
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = 'pg_lease_django'")
    assert check_lease_migrations_are_complete(databases=["default"]) == []  # none applied: Django's own notice
