"""Tenants apart off the default path (issue 52), on a real server with real roles.

The limits and locks of issue 42 held in READ COMMITTED; these are the paths around them: a limit
counted from an old snapshot (REPEATABLE READ sessions, an imported snapshot, a SERIALIZABLE
transaction older than another session's fill), a lock any role could compute and hold, a wait with
no bound, and a deploy queued behind a tenant's open transaction. Same seats as tests/db/test_tenants.py
(its `tenants` fixture): tenant group roles with login members, an operator, a role granted nothing.
"""

from __future__ import annotations

import functools
import re
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings

from pg_lease_django import Lease, LeaseTimeoutError
from pg_lease_django.sql import run, statements
from tests.db.test_tenants import ACQUIRE
from tests.helpers import Tenants, fails_with, needs_session, row_snapshot, wait_until, wait_until_blocked

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.xdist_group("cluster-roles")]

LIMIT = 5
WAIT_ACQUIRE = "SELECT granted, epoch FROM public.pg_lease_acquire(%s::text, %s::text, %s::interval, %s::interval)"


def limited(tenants: Tenants) -> Any:
    """PG_LEASE_ROLE_LIMITS: tenant B keeps LIMIT lease rows at most."""
    return override_settings(PG_LEASE_ROLE_LIMITS={tenants.role("b"): {"leases": LIMIT}})


def rows_of_b(tenants: Tenants) -> int:
    row = tenants.admin.execute(
        "SELECT count(*) FROM pg_lease_django_lease WHERE key LIKE %s", [tenants.prefix("b") + "%"]
    ).fetchone()
    assert row is not None
    return int(row[0])


def new_key(conn: psycopg.Connection[Any], tenants: Tenants, name: str) -> str | None:
    """Acquire a brand-new key of B's on ``conn``: None when granted, else the SQLSTATE."""
    try:
        conn.execute(ACQUIRE, [tenants.prefix("b") + name, "b1", "60 seconds"])
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


# ---- 1. a limit whatever the snapshot ---------------------------------------------------------------


def test_four_repeatable_read_sessions_of_one_tenant_stay_within_its_limit(tenants: Tenants) -> None:
    """Finding 1: four REPEATABLE READ sessions that took their snapshot first ended with 173 rows
    under a limit of 50. Each counted in its snapshot, after the others committed."""
    sessions = [tenants.connect("b_login") for _ in range(4)]
    snapshots = threading.Barrier(len(sessions))
    refusals: list[str | None] = []

    def fill(index: int, conn: psycopg.Connection[Any]) -> None:
        conn.autocommit = False
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")  # the snapshot
        snapshots.wait()
        refusals.extend(new_key(conn, tenants, f"rr{index}-{i}") for i in range(LIMIT))
        conn.rollback() if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR else conn.commit()

    with limited(tenants):
        call_command("leases", "grant", stdout=StringIO())
        threads = [threading.Thread(target=fill, args=(i, conn)) for i, conn in enumerate(sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert rows_of_b(tenants) <= LIMIT
        assert "0A000" in refusals  # told why: not READ COMMITTED
        # READ COMMITTED still fills the limit, and no further.
        b = tenants.connect("b_login")
        assert [new_key(b, tenants, f"rc{i}") for i in range(LIMIT + 1)][-1] == "53400"
        assert rows_of_b(tenants) == LIMIT


def test_an_imported_snapshot_makes_no_key_past_the_limit(tenants: Tenants) -> None:
    """Finding 1: a second connection imported an idle transaction's snapshot in 400 transactions
    and made 19,600 brand-new keys under a limit of 50."""
    exporter, importer = tenants.connect("b_login"), tenants.connect("b_login")
    with limited(tenants):
        call_command("leases", "grant", stdout=StringIO())
        exporter.autocommit = False
        exporter.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = exporter.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        refusals = []
        for i in range(3 * LIMIT):
            importer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            importer.execute(f"SET TRANSACTION SNAPSHOT '{row[0]}'")
            refusals.append(new_key(importer, tenants, f"imported{i}"))
            importer.execute("COMMIT")  # a rollback after a refusal
        exporter.rollback()
    assert rows_of_b(tenants) <= LIMIT
    assert set(refusals) == {"0A000"}


def test_a_serializable_snapshot_older_than_a_fill_adds_nothing(tenants: Tenants) -> None:
    """Finding 1: a SERIALIZABLE transaction whose snapshot predated another session filling the
    limit added 10 more keys (30 of 20)."""
    old, filler = tenants.connect("b_login"), tenants.connect("b_login")
    with limited(tenants):
        call_command("leases", "grant", stdout=StringIO())
        old.autocommit = False
        old.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        old.execute("SELECT 1")  # the snapshot, before the fill
        assert [new_key(filler, tenants, f"fill{i}") for i in range(LIMIT)] == [None] * LIMIT
        with fails_with("0A000"):
            old.execute(ACQUIRE, [tenants.prefix("b") + "late", "b1", "60 seconds"])
        old.rollback()
    assert rows_of_b(tenants) == LIMIT


# ---- 2. no lock a role was not granted, every wait within the caller's deadline --------------------


def computable_advisory_locks(conn: psycopg.Connection[Any], texts: list[str]) -> list[int]:
    """Every advisory lock number a role can compute from the lease functions' source (pg_proc is
    readable by every role): each seeded hash the source takes, of each of ``texts`` and of each
    string literal of the source followed by each of ``texts``."""
    sources = [s for (s,) in conn.execute("SELECT prosrc FROM pg_proc WHERE proname LIKE 'pg_lease%%'").fetchall()]
    seeds = {int(seed) for src in sources for seed in re.findall(r"hashtextextended\(.*?(\d+)::bigint\)", src)}
    literals = {lit for src in sources for lit in re.findall(r"'([^'%]{3,80})'", src)}
    candidates = texts + [lit + text for lit in literals for text in texts]
    numbers = conn.execute(
        "SELECT DISTINCT hashtextextended(t, s) FROM unnest(%s::text[]) t, unnest(%s::bigint[]) s",
        [candidates, sorted(seeds)],
    ).fetchall()
    assert seeds and numbers
    return [n for (n,) in numbers]


def test_a_role_granted_nothing_holds_no_lock_that_delays_a_tenant_past_its_deadline(tenants: Tenants) -> None:
    """Finding 2: a role granted nothing took the limit's advisory lock (its number computed from
    the function's source): B's brand-new keys waited until it let go, and a blocking acquire with
    timeout=3 was granted after 15-20 s. Now the limit locks a row of the limits table that only the
    lease functions can lock: every lock the role can compute is held, and B is answered meanwhile."""
    nobody, b = tenants.connect("nobody"), tenants.connect("b_login")
    sql_key, django_key = tenants.prefix("b") + "sql", tenants.prefix("b") + "django"
    roles = [tenants.role("b"), tenants.role("b_login")]
    with limited(tenants):
        call_command("leases", "grant", stdout=StringIO())
        held = computable_advisory_locks(nobody, [sql_key, django_key, *roles])
        nobody.execute("SELECT count(pg_advisory_lock(n)) FROM unnest(%s::bigint[]) n", [held])

        def tenant() -> list[Any]:
            return [
                b.execute(WAIT_ACQUIRE, [sql_key, "b1", "60 seconds", "2 seconds"]).fetchone(),
                Lease.objects.acquire(django_key, "d1", ttl=60, blocking=True, timeout=2.0),
            ]

        answers, in_time = answered_before(tenant, lambda: nobody.execute("SELECT pg_advisory_unlock_all()"))
    assert answers[0] == (True, 1), answers
    assert getattr(answers[1], "key", None) == django_key, answers
    assert in_time  # while the role held every lock it could compute


def test_a_blocking_acquire_waiting_on_a_sibling_is_answered_by_its_deadline(tenants: Tenants) -> None:
    """Every wait inside a lease function is bounded by the caller's deadline: a sibling session of
    B that made a brand-new key and keeps its transaction open holds B's limit row; B's blocking
    acquires of other brand-new keys time out at their deadline (SQL and Python), not at its commit."""
    sibling, b = tenants.connect("b_login"), tenants.connect("b_login")
    with limited(tenants):
        call_command("leases", "grant", stdout=StringIO())
        sibling.autocommit = False
        assert new_key(sibling, tenants, "open") is None

        def waiter() -> list[str]:
            with fails_with("57014"):
                b.execute(WAIT_ACQUIRE, [tenants.prefix("b") + "w1", "b1", "60 seconds", "1 second"])
            # Every path: LISTENing directly, polling behind a pooler (each attempt bounded by what is
            # left of the deadline, pg_lease_acquire_within).
            with pytest.raises(LeaseTimeoutError, match="busy"):
                Lease.objects.acquire(tenants.prefix("b") + "w2", "b2", ttl=60, blocking=True, timeout=1.0)
            return ["sql timed out", "python timed out"]

        answers, in_time = answered_before(waiter, sibling.commit, tenants=tenants, blocked=b.info.backend_pid)
    assert answers == ["sql timed out", "python timed out"]
    assert in_time  # while the sibling's transaction was open


#: How a blocking acquire waits: LISTENing on a session of its own (acquire_or_register), polling
#: (PG_LEASE_LISTEN = False, as behind a transaction pooler), polling inside the caller's atomic();
#: and the same three for the async wait (whose first try is the caller's, the rest its own).
WAYS = [
    pytest.param("listen", marks=needs_session),
    "poll",
    "atomic",
    pytest.param("async_listen", marks=needs_session),
    "async_poll",
    "async_atomic",
]
#: The blocking acquire's timeout: it must be answered while the lock is still held (HOLD).
TIMEOUT = 1.0
#: How long the lock is held at most while the waiter is not answered (then let go).
HOLD = 20.0


def blocking_acquire(way: str, key: str, owner: str) -> Any:
    """A blocking acquire of ``key`` (timeout TIMEOUT) waiting the way ``way`` names (`WAYS`).

    Inside atomic() a refusal must leave the caller's transaction usable: it is used once more."""
    acquire = functools.partial(Lease.objects.acquire, key, owner, ttl=60, blocking=True, timeout=TIMEOUT)
    if way.startswith("async"):
        acquire = functools.partial(
            async_to_sync(Lease.objects.aacquire), key, owner, ttl=60, blocking=True, timeout=TIMEOUT
        )
    with override_settings(PG_LEASE_LISTEN=way.endswith("listen")):
        if not way.endswith("atomic"):
            return acquire()
        with transaction.atomic():
            try:
                return acquire()
            finally:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")  # not aborted by a lock wait cut short


def server_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def hold_lease_row(tenants: Tenants, blocker: psycopg.Connection[Any]) -> str:
    """A free lease row whose row lock ``blocker`` holds (a transaction left open): its key."""
    key = tenants.prefix("a") + "row"
    granted = tenants.admin.execute(ACQUIRE, [key, "holder", "60 seconds"]).fetchone()
    assert granted is not None
    tenants.admin.execute(
        "SELECT outcome FROM public.pg_lease_release(%s::text, 'holder'::text, %s::bigint)", [key, granted[1]]
    )
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    return key


def hold_limit_row(tenants: Tenants, blocker: psycopg.Connection[Any]) -> str:
    """B's role limit row, locked by ``blocker`` (the owner's session: row-level security lets no
    other role lock it); a brand-new key of B's, whose acquire counts under that lock."""
    call_command("leases", "grant", stdout=StringIO())
    locked = blocker.execute(
        "SELECT 1 FROM pg_lease_django_role_limit WHERE role = %s FOR NO KEY UPDATE", [tenants.role("b")]
    ).fetchone()
    assert locked == (1,)
    return tenants.prefix("b") + "new"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("lock", ["lease_row", "limit_row"])
def test_a_waiters_attempts_are_bounded_by_its_deadline_whatever_lock_they_meet(
    tenants: Tenants, lock: str, way: str
) -> None:
    """A blocking acquire that polls (a transaction pooler, PG_LEASE_LISTEN = False, atomic()) or the
    async wait's first try bounded each attempt by the caller's lock_timeout only: behind a lock held
    open it was answered when the lock was let go, 15-20 s past timeout=3 on CI's pooled leg. Each
    attempt now waits for a lock at most what is left of the deadline: the waiter times out at its
    deadline (the server's clock), while the lock is still held, and nothing is granted to it after."""
    blocker = psycopg.connect(tenants.admin.info.dsn, autocommit=False)
    tenants.opened.append(blocker)
    clock = psycopg.connect(tenants.admin.info.dsn, autocommit=True)
    tenants.opened.append(clock)
    with limited(tenants):
        key = hold_lease_row(tenants, blocker) if lock == "lease_row" else hold_limit_row(tenants, blocker)
        before = row_snapshot(tenants.admin, key)

        def waiter() -> tuple[Any, timedelta]:
            started = server_now(clock)
            try:
                # An owner of its own: behind a pooler, the async wait's connection leaves its name
                # (application_name) on the server session, where test_async looks for its waiters.
                outcome: Any = blocking_acquire(way, key, "deadline-bound waiter")
            except LeaseTimeoutError as exc:
                outcome = exc
            return outcome, server_now(clock) - started

        left: list[Any] = []

        def let_go() -> None:
            # Once answered, while the lock is still held: no statement of the waiter's is left
            # waiting on it, and no transaction but the blocker's is open.
            left.extend(
                tenants.admin.execute(
                    "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), "
                    "count(*) FILTER (WHERE state LIKE 'idle in%%') "
                    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> %s",
                    [blocker.info.backend_pid],
                ).fetchall()
            )
            blocker.commit()

        (outcome, elapsed), in_time = answered_before(waiter, let_go, hold_for=HOLD)
    assert isinstance(outcome, LeaseTimeoutError), outcome
    assert "busy" in str(outcome), str(outcome)
    assert in_time
    # Answered by the deadline: while the lock was still held (in_time, HOLD s), not after it went; no
    # upper bound on the elapsed time, which a stalled machine could break.
    assert elapsed >= timedelta(seconds=TIMEOUT), elapsed
    assert left == [(0, 0)]
    assert row_snapshot(tenants.admin, key) == before  # nothing granted to the waiter, then or after


def answered_before(
    call: Callable[[], Any],
    let_go: Callable[[], object],
    *,
    tenants: Tenants | None = None,
    blocked: int = 0,
    hold_for: float = 60.0,
) -> tuple[Any, bool]:
    """Run ``call`` on a thread while what would hold it up is held, then ``let_go``: what it returned
    (or raised), and whether it was answered before the let-go. With ``tenants``, first wait until
    backend ``blocked`` does wait for a lock (the hold is real). The thread gets ``hold_for`` seconds
    before the let-go: not a bound asserted, how long the hold lasts at most."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    if tenants is not None:
        wait_until_blocked(tenants.admin, blocked)
    thread.join(timeout=hold_for)
    in_time = not thread.is_alive()
    let_go()
    thread.join()
    return outcome[0], in_time


# ---- 3. deploys and tenants never queue behind each other -----------------------------------------


def recorded_flag(tenants: Tenants, key: str) -> Any:
    row = tenants.admin.execute("SELECT recorded FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
    return None if row is None else row[0]


def test_a_tenants_open_transaction_after_a_new_key_holds_up_no_deploy(tenants: Tenants) -> None:
    """Finding 3: a brand-new key took SHARE on the history-scope table; a tenant that made one and
    kept its transaction open made the owner's `migrate` (whose sync rewrote that table with nothing
    to change) wait, and every tenant's brand-new keys queued behind the migrate. Now the sync writes
    nothing when nothing changed, and a scope change waits for brand-new keys in flight without
    queueing the others (lock_timeout only turns a wait into a failure here: no bound asserted)."""
    history = [tenants.prefix("b")]
    b, a = tenants.connect("b_login"), tenants.connect("a_login")
    a.execute("SET lock_timeout = '5s'")
    with override_settings(PG_LEASE_HISTORY=history):
        call_command("migrate", "pg_lease_django", verbosity=0)
        with b.transaction():
            assert new_key(b, tenants, "open") is None
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '5s'")
            try:
                call_command("migrate", "pg_lease_django", verbosity=0)  # nothing to apply, nothing to sync
            finally:
                with connection.cursor() as cursor:
                    cursor.execute("RESET lock_timeout")
            # A scope change waits for B's brand-new key; A's brand-new keys do not wait behind it.
            changer = psycopg.connect(tenants.admin.info.dsn, autocommit=True)
            tenants.opened.append(changer)
            outcome: list[Any] = []
            thread = threading.Thread(
                target=lambda: outcome.append(
                    changer.execute(
                        "INSERT INTO pg_lease_django_history_scope (prefix) VALUES (%s)", [tenants.prefix("a")]
                    ).rowcount
                )
            )
            thread.start()
            wait_until_blocked(tenants.admin, changer.info.backend_pid)
            assert a.execute(ACQUIRE, [tenants.prefix("a") + "new", "a1", "60 seconds"]).fetchone() == (True, 1)
            assert thread.is_alive()  # still waiting for B's brand-new key
        thread.join()
        assert outcome == [1]
        # A's key, made while the change was in flight, is flagged by the scope that committed.
        assert recorded_flag(tenants, tenants.prefix("a") + "new") is True
        assert recorded_flag(tenants, tenants.prefix("b") + "open") is True
        tenants.admin.execute("DELETE FROM pg_lease_django_history_scope WHERE prefix = %s", [tenants.prefix("a")])


# ---- 4. settling finds only the caller's own attempt ----------------------------------------------


def test_a_decoy_of_another_role_listed_first_does_not_stop_the_settling(tenants: Tenants) -> None:
    """Finding 4: a decoy statement of another role carrying the attempt's text, listed first, made a
    settling role that may see other sessions' queries (pg_read_all_stats) try to cancel the decoy,
    fail, and stop looking: the real attempt then granted. Even a decoy that copied the attempt's
    marker is passed by now (a role this session may not signal), and the attempt is cancelled."""
    tenants.admin.execute(
        psycopg.sql.SQL("GRANT pg_read_all_stats TO {}").format(psycopg.sql.Identifier(tenants.role("b_login")))
    )
    key = tenants.prefix("b") + "settled"
    b, settler, decoy = tenants.connect("b_login"), tenants.connect("b_login"), tenants.connect("nobody")
    granted = b.execute(ACQUIRE, [key, "b1", "60 seconds"]).fetchone()
    assert granted is not None
    b.execute("SELECT outcome FROM public.pg_lease_release(%s::text, 'b1'::text, %s::bigint)", [key, granted[1]])
    marker = f"pg_lease_django attempt {uuid.uuid4().hex}"
    decoy_thread = threading.Thread(
        target=_quietly(decoy, f"SELECT pg_sleep(60) /* {marker} pg_lease_acquire('{key}'::text, 'b2'::text */"),
        daemon=True,
    )
    decoy_thread.start()
    wait_until(lambda: _active(tenants, decoy.info.backend_pid), what="the decoy to run")
    marked = f"/* {marker} */ " + statements.ACQUIRE.compose("public").as_string(b)
    outcome: list[Any] = []
    with tenants.admin.transaction():
        tenants.admin.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
        sent_params = {"key": key, "owner": "b2", "ttl": "60 seconds"}
        attempt = threading.Thread(target=_quietly(b, marked, sent_params, outcome))
        attempt.start()
        wait_until_blocked(tenants.admin, b.info.backend_pid)
        still = run.on_psycopg(settler, statements.CANCEL_ATTEMPT, attempt_marker=marker, pid=2**31 - 1, closed=None)
        assert sorted(still) == [False, True]  # the decoy: passed by; the attempt: cancelled
        attempt.join()
    assert outcome == ["57014"]
    assert _active(tenants, decoy.info.backend_pid)
    tenants.admin.execute("SELECT pg_cancel_backend(%s)", [decoy.info.backend_pid])
    decoy_thread.join()
    state = tenants.admin.execute(INSPECT_STATUS, [key]).fetchone()
    assert state == ("free",)


INSPECT_STATUS = "SELECT status FROM public.pg_lease_inspect(%s::text)"


def _active(tenants: Tenants, pid: int) -> bool:
    return tenants.admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == ("active",)


def _quietly(conn: psycopg.Connection[Any], query: str, params: Any = None, outcome: list[Any] | None = None) -> Any:
    def run_it() -> None:
        try:
            conn.execute(query, params)
        except psycopg.Error as exc:
            if outcome is not None:
                outcome.append(exc.sqlstate)

    return run_it


# ---- 5. one order of judgement: input, then scope, then state -------------------------------------


def test_every_function_judges_input_before_the_scope(tenants: Tenants) -> None:
    """Finding 5: two functions checked the scope before owner, epoch and TTL (42501 where 22023 is
    due). B calls each with A's key and one bad input at a time: invalid_input, whoever's key."""
    b = tenants.connect("b_login")
    a_key = tenants.prefix("a") + "x"
    calls: dict[str, tuple[str, list[Any]]] = {
        "acquire": ("SELECT * FROM public.pg_lease_acquire(%s::text, %s::text, %s::interval)", ["o", "60 s"]),
        "acquire_or_register": (
            "SELECT * FROM public.pg_lease_acquire_or_register(%s::text, %s::text, %s::interval, '1 s'::interval)",
            ["o", "60 s"],
        ),
        "acquire_within": (
            "SELECT * FROM public.pg_lease_acquire_within(%s::text, %s::text, %s::interval, '1 s'::interval)",
            ["o", "60 s"],
        ),
        "heartbeat": ("SELECT * FROM public.pg_lease_heartbeat(%s::text, %s::text, %s::bigint, '60 s')", ["o", 1]),
        "release": ("SELECT * FROM public.pg_lease_release(%s::text, %s::text, %s::bigint)", ["o", 1]),
        "fence": ("SELECT public.pg_lease_fence(%s::text, %s::text, %s::bigint)", ["o", 1]),
        "check_fence": ("SELECT public.pg_lease_check_fence(%s::text, %s::text, %s::bigint)", ["o", 1]),
    }
    judged: dict[tuple[str, str], str | None] = {}
    call: tuple[str, list[Any]]
    for name, call in calls.items():
        statement, good = call
        for i, bad in (
            (0, ""),
            (1, "0 s" if isinstance(good[1], str) else 0),
            (1, "-1 s" if isinstance(good[1], str) else -1),
        ):
            params = [a_key, *good]
            params[1 + i] = bad
            with pytest.raises(psycopg.Error) as info:
                b.execute(statement, params)
            judged[name, repr(bad)] = info.value.sqlstate
        with pytest.raises(psycopg.Error) as info:  # good input: the scope says no
            b.execute(statement, [a_key, *good])
        judged[name, "scope"] = info.value.sqlstate
    assert {k: v for k, v in judged.items() if k[1] != "scope" and v != "22023"} == {}
    assert {k: v for k, v in judged.items() if k[1] == "scope" and v != "42501"} == {}


def test_a_malformed_fence_setting_of_any_size_or_depth_is_unfenced(tenants: Tenants) -> None:
    """Finding 5: a deeply nested pg_lease.fences gave a raw 54001; a presented epoch of 0 met the
    input check (22023) where -1 was refused as unfenced (PL004). Any malformed setting is PL004."""
    b = tenants.connect("b_login")
    key = tenants.prefix("b") + "fenced"
    assert b.execute(ACQUIRE, [key, "b1", "60 seconds"]).fetchone() == (True, 1)
    with b.transaction():
        row = b.execute(
            "INSERT INTO testapp_invoice (account, status, amount, lease_key, lease_epoch) "
            "VALUES (%s, 'draft', 0, %s, (SELECT public.pg_lease_check_fence(%s::text, 'b1'::text, 1::bigint))) "
            "RETURNING id",
            [key, key, key],
        ).fetchone()
    assert row is not None
    deep = "[" * 200_000 + "]" * 200_000
    for malformed in (
        deep,
        f'{{"{key}": {deep}}}',
        f'{{"{key}": ["b1", 0]}}',
        f'{{"{key}": ["b1", -1]}}',
        f'{{"{key}": ["", 1]}}',
        f'{{"{key}": ["b1", "1e3"]}}',
    ):
        with pytest.raises(psycopg.Error) as info, b.transaction():
            b.execute("SELECT set_config('pg_lease.fences', %s, true)", [malformed])
            b.execute("UPDATE testapp_invoice SET amount = 1, lease_epoch = 1 WHERE id = %s", [row[0]])
        assert info.value.sqlstate == "PL004", (malformed[:60], info.value.sqlstate)
