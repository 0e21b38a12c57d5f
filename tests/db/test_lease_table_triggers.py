"""The lease table's triggers stay off the common path, and every guarantee they give holds for
every writer (migration 0002).

- History is recorded for a key in the scope whoever writes, decided by the row's ``recorded``,
  which the database keeps: set on insert, re-set for every row when the scope changes, and
  refused when a writer sets it otherwise.
- A hand-off request is cleared by any change of epoch, whoever makes it.
- The re-check under the row lock runs without a pinned search_path: a writer's own search_path
  (a schema of lookalike functions and operators put before pg_catalog) changes nothing.
- A grant or release by the functions fires no PL/pgSQL row trigger but the re-check, and a live
  renewal none (``pg_stat_user_functions``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.test import override_settings

from pg_lease_django import Lease
from pg_lease_django.models import LeaseTenure
from pg_lease_django.provisioning.history import sync_scope
from tests.helpers import Background, held, lapsed, wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def recorded(key: str) -> Iterator[str]:
    """Record the history of ``key`` (and keys under it) for this test only."""
    with override_settings(PG_LEASE_HISTORY=[key]):
        sync_scope()
        yield key
    sync_scope()


def flag(conn: psycopg.Connection[Any], key: str) -> Any:
    row = conn.execute("SELECT recorded FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
    return None if row is None else row[0]


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def next_epoch(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT floor + 1 FROM pg_lease_django_epoch_floor").fetchone()
    assert row is not None
    return int(row[0])


def test_a_raw_insert_gets_the_flag_the_scope_says(recorded: str, raw_connect: Connect) -> None:
    conn = raw_connect()
    inside, outside = f"{recorded}/raw", f"elsewhere:{recorded}"
    for key, claimed in ((inside, False), (outside, True)):
        conn.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at, recorded) "
            "VALUES (%s, 'raw', %s, now(), now() + interval '1 minute', %s)",
            [key, next_epoch(conn), claimed],
        )
    assert (flag(conn, inside), flag(conn, outside)) == (True, False)
    assert list(LeaseTenure.objects.filter(key__in=[inside, outside]).values_list("key", "owner")) == [(inside, "raw")]


def test_changing_the_scope_reflags_every_row_in_the_same_transaction(key: str, raw_connect: Connect) -> None:
    conn = raw_connect()
    held(key, "w")
    assert flag(conn, key) is False
    with override_settings(PG_LEASE_HISTORY=[key]):
        sync_scope()
        assert flag(conn, key) is True
        epoch = Lease.objects.inspect(key).epoch
        Lease.objects.release(key, "w", epoch)
        grant = Lease.objects.acquire(key, "w2", ttl=30)
        assert grant is not None
        assert list(LeaseTenure.objects.filter(key=key).values_list("epoch", "owner")) == [(grant.epoch, "w2")]
    sync_scope()
    assert flag(conn, key) is False
    # A raw client changing the scope table (not the Python side) re-flags the rows too.
    with conn.transaction():
        conn.execute("INSERT INTO pg_lease_django_history_scope (prefix) VALUES (%s)", [key])
        assert flag(conn, key) is True
        conn.execute("DELETE FROM pg_lease_django_history_scope WHERE prefix = %s", [key])
        assert flag(conn, key) is False


def test_no_writer_sets_the_flag_against_the_scope(recorded: str, raw_connect: Connect) -> None:
    conn = raw_connect()
    held(recorded, "w")
    with pytest.raises(psycopg.errors.CheckViolation, match="recorded follows the history scope"):
        conn.execute("UPDATE pg_lease_django_lease SET recorded = false WHERE key = %s", [recorded])
    assert flag(conn, recorded) is True
    conn.execute("UPDATE pg_lease_django_lease SET recorded = true WHERE key = %s", [recorded])  # no change: fine


def test_a_hand_off_request_is_cleared_by_any_change_of_epoch(key: str, raw_connect: Connect) -> None:
    """A raw takeover (new owner, higher epoch: what the rewrite guard allows) clears the request."""
    conn = raw_connect()
    epoch = held(key, "w")
    Lease.objects.request_handoff(key)
    conn.execute(
        "UPDATE pg_lease_django_lease SET owner = 'raw', epoch = epoch + 1 WHERE key = %s AND epoch = %s",
        [key, epoch],
    )
    row = conn.execute("SELECT owner, handoff_requested_at FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
    assert row == ("raw", None)


def test_the_recheck_ignores_the_writers_search_path(key: str, raw_connect: Connect) -> None:
    """A lapsed lease cannot be extended by hand, even by a writer whose search_path puts a schema of
    lookalikes (a clock in the past, an equality that is always true) before pg_catalog."""
    conn = raw_connect()
    lapsed(key, "w")
    conn.execute("DROP SCHEMA IF EXISTS lookalike CASCADE")
    conn.execute("CREATE SCHEMA lookalike")
    try:
        conn.execute(
            "CREATE FUNCTION lookalike.clock_timestamp() RETURNS timestamptz LANGUAGE sql "
            "AS $$ SELECT timestamptz '2000-01-01' $$"
        )
        conn.execute(
            "CREATE FUNCTION lookalike.le(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS $$ SELECT false $$"
        )
        conn.execute(
            "CREATE OPERATOR lookalike.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = lookalike.le)"
        )
        conn.execute("SET search_path = lookalike, pg_catalog, public")
        done = conn.execute(
            "UPDATE public.pg_lease_django_lease SET expires_at = pg_catalog.clock_timestamp() + interval '1 hour' "
            "WHERE key = %s",
            [key],
        )
        assert done.rowcount == 0  # skipped under the row lock: it had lapsed
    finally:
        conn.execute("RESET search_path")
        conn.execute("DROP SCHEMA lookalike CASCADE")
    assert Lease.objects.inspect(key).status == "lapsed"


def _trigger_calls(conn: psycopg.Connection[Any], run: Callable[[], None]) -> dict[str, int]:
    """The PL/pgSQL functions ``run`` entered as triggers, with their call counts (pg_stat_user_functions)."""
    if conn.info.server_version < 150000:
        pytest.skip("PostgreSQL 14 sends function statistics to its collector later (at most every 500 ms)")
    conn.execute("SET track_functions = 'pl'")

    def calls() -> dict[str, int]:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = conn.execute(
            "SELECT funcname, calls FROM pg_stat_user_functions WHERE funcname LIKE 'pg\\_lease\\_%%'"
        ).fetchall()
        return dict(rows)

    before = calls()
    run()
    conn.execute("SELECT pg_stat_force_next_flush()")
    after = calls()
    fired = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    return {name: count for name, count in fired.items() if count and name not in _CALLED_BY_NAME}


def test_a_grant_and_a_release_call_no_trigger_function_but_the_update_guard(key: str, raw_connect: Connect) -> None:
    """What fires for a pair on a key nobody records: pg_lease_guard_update for the grant's stamp
    and the release's re-check, nothing else (counted by pg_stat_user_functions)."""
    conn = raw_connect()
    held(key, "w")
    Lease.objects.release(key, "w", Lease.objects.inspect(key).epoch)  # the row exists, free

    def pairs() -> None:
        for _ in range(3):
            [(granted, epoch)] = conn.execute(
                "SELECT granted, epoch FROM pg_lease_acquire(%s, 'w', interval '30 s')", [key]
            ).fetchall()
            assert granted
            assert conn.execute("SELECT outcome FROM pg_lease_release(%s, 'w', %s)", [key, epoch]).fetchone() == ("ok",)

    assert _trigger_calls(conn, pairs) == {"pg_lease_guard_update": 6}


def test_a_live_renewal_calls_no_trigger_function(key: str, raw_connect: Connect) -> None:
    """A renewal sets only expires_at: pg_lease_guard_update's column list passes it by, and
    pg_lease_judge_renewal's WHEN holds only for a lease already past its expiry (migration 0006)."""
    conn = raw_connect()
    epoch = held(key, "w")

    def renewals() -> None:
        for _ in range(3):
            [(outcome,)] = conn.execute(
                "SELECT outcome FROM pg_lease_heartbeat(%s, 'w', %s, interval '30 s')", [key, epoch]
            ).fetchall()
            assert outcome == "ok"

    assert _trigger_calls(conn, renewals) == {}


# Functions the pair calls by name (not as triggers).
_CALLED_BY_NAME = {
    "pg_lease_acquire",
    "pg_lease_release",
    "pg_lease_heartbeat",
    "pg_lease_wake_waiters",
    "pg_lease_check_key_scope",
}


def test_a_new_key_inserted_while_the_scope_changes_gets_the_scope_that_commits(key: str, raw_connect: Connect) -> None:
    """Both orders of a scope change and a first grant, each in its own open transaction: whichever
    commits second waits for the other, so the new row's flag is the committed scope's."""
    watcher = raw_connect()
    try:
        for scope_first in (True, False):
            new_key = f"{key}/{'scope-first' if scope_first else 'grant-first'}"
            scope, granter = raw_connect(autocommit=False), raw_connect(autocommit=False)
            pids = {name: backend_pid(conn) for name, conn in (("scope", scope), ("granter", granter))}

            def change_scope(scope: psycopg.Connection[Any] = scope, new_key: str = new_key) -> None:
                scope.execute("INSERT INTO pg_lease_django_history_scope (prefix) VALUES (%s)", [new_key])

            def grant(granter: psycopg.Connection[Any] = granter, new_key: str = new_key) -> Any:
                return granter.execute(
                    "SELECT granted FROM pg_lease_acquire(%s, 'w', interval '30 s')", [new_key]
                ).fetchone()

            first, second, second_pid = (
                (change_scope, grant, pids["granter"]) if scope_first else (grant, change_scope, pids["scope"])
            )
            first()
            waiting = Background(second)
            waiting.start()
            wait_until_blocked(watcher, second_pid)  # the later one waits for the earlier to commit
            (scope if scope_first else granter).commit()
            waiting.outcome()
            (granter if scope_first else scope).commit()
            assert flag(watcher, new_key) is True, "scope first" if scope_first else "grant first"
    finally:
        watcher.execute("DELETE FROM pg_lease_django_history_scope WHERE prefix LIKE %s", [f"{key}/%"])
