"""The shared machinery of ``hold()``: pooled lease connections and one scheduler per process.

On a real server: many holds share a bounded set of connections and threads; a renewal that hangs
on a row lock does not delay another hold's renewal; a connection whose renewal timed out is
closed, not lent again; a forked child never uses its parent's connections; a renewal is one
statement on a direct connection and a SET LOCAL transaction behind a pooler. Nothing sleeps in
place of synchronisation: tests poll for a state (a renewal, a blocked backend, a closed one).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, OperationalError
from django.test import override_settings

from pg_lease_django import HeldLease, Lease, hold
from pg_lease_django.holds import lease_connection, lease_pool, scheduler
from tests.helpers import needs_session, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


def lease_pids(conn: psycopg.Connection[Any]) -> set[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
        [lease_connection.APPLICATION_NAME],
    ).fetchall()
    return {int(pid) for (pid,) in rows}


def blocked_by(conn: psycopg.Connection[Any], blocker: psycopg.Connection[Any]) -> set[int]:
    """Backends waiting for a lock ``blocker`` holds."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))", [blocker.info.backend_pid]
    ).fetchall()
    return {int(pid) for (pid,) in rows}


def lock_row(blocker: psycopg.Connection[Any], key: str) -> None:
    """Hold the lease row of ``key`` locked (FOR UPDATE) in ``blocker``'s open transaction."""
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])


def renewed_after(lease: HeldLease, count: int) -> Callable[[], bool]:
    """True once ``lease``'s expiry moved ``count`` times from now on (polled)."""
    seen = [lease.expires_at]

    def check() -> bool:
        if lease.expires_at != seen[-1]:
            seen.append(lease.expires_at)
        return len(seen) > count

    return check


@pytest.fixture
def fresh_machinery(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start from no idle lease connection; make idle threads exit fast."""
    monkeypatch.setattr(scheduler, "IDLE_EXIT", 0.3)
    lease_pool.close_connections()
    yield
    lease_pool.close_connections()


@needs_session  # counts backends in pg_stat_activity, which the pooler hides
@override_settings(PG_LEASE_HOLD_CONNECTIONS=3)
def test_many_holds_share_a_bounded_set_of_connections_and_threads(
    key: str, raw_connect: Connect, fresh_machinery: None
) -> None:
    admin = raw_connect()
    wait_until(lambda: scheduler.scheduler_threads() == 0, what="an idle scheduler from earlier tests to exit")
    threads_before = threading.active_count()
    peak = {"connections": 0, "threads": 0}
    with ExitStack() as stack:
        leases = [stack.enter_context(hold(f"{key}:{i}", ttl=2, renew_every=0.05)) for i in range(40)]
        checks = [renewed_after(lease, 3) for lease in leases]

        def all_renewed() -> bool:
            peak["connections"] = max(peak["connections"], len(lease_pids(admin)))
            peak["threads"] = max(peak["threads"], threading.active_count() - threads_before)
            return all([check() for check in checks])

        wait_until(all_renewed, what="three renewals of every hold")
        assert not any(lease.lost for lease in leases)
        # One scheduler and at most 3 workers; at most 3 idle connections, plus one per renewal in
        # flight (one per worker) and the one this thread last entered a hold with.
        assert 1 <= scheduler.scheduler_threads() <= 4
        assert peak["threads"] <= 4
        assert peak["connections"] <= 3 + 3 + 1
        assert lease_pool.open_connections() <= 7
    assert all(Lease.objects.inspect(f"{key}:{i}").status == "free" for i in range(40))
    wait_until(lambda: scheduler.scheduler_threads() == 0, what="the scheduler and its workers to exit when idle")
    wait_until(lambda: lease_pids(admin) == set(), what="the idle connections to close with the scheduler")


def test_a_hanging_renewal_does_not_delay_another_holds_renewal(
    key: str, raw_connect: Connect, fresh_machinery: None
) -> None:
    admin, blocker = raw_connect(), raw_connect(autocommit=False)
    with hold(f"{key}:slow", ttl=3, renew_every=0.1) as slow, hold(f"{key}:fast", ttl=3, renew_every=0.1) as fast:
        lock_row(blocker, slow.key)
        # The slow hold's renewal is now in flight, waiting on the row lock (up to its 0.1 s timeout,
        # then retried: at every instant one of its renewals may be hanging).
        wait_until(lambda: blocked_by(admin, blocker) != set(), what="the slow hold's renewal to block")
        stuck_at = slow.expires_at
        wait_until(renewed_after(fast, 5), what="five renewals of the other hold")
        assert slow.expires_at == stuck_at  # still blocked all that time
        assert blocked_by(admin, blocker) or not slow.lost
        blocker.rollback()
        wait_until(renewed_after(slow, 1), what="the slow hold to renew once the lock is gone")
        assert not slow.lost and not fast.lost


@needs_session  # follows one backend pid, which the pooler hides
def test_a_connection_whose_renewal_timed_out_is_closed_not_lent_again(
    key: str, raw_connect: Connect, fresh_machinery: None
) -> None:
    admin, blocker = raw_connect(), raw_connect(autocommit=False)
    with hold(key, ttl=3, renew_every=0.2) as lease:
        lock_row(blocker, key)
        wait_until(lambda: blocked_by(admin, blocker) != set(), what="a renewal to block on the row lock")
        (stuck,) = blocked_by(admin, blocker)
        assert stuck in lease_pids(admin)
        # Its statement_timeout (0.2 s) cancels it: the client closes that session for good.
        wait_until(lambda: stuck not in lease_pids(admin), what="the timed-out connection to be closed")
        blocker.rollback()
        wait_until(renewed_after(lease, 2), what="renewals on other connections")
        assert stuck not in lease_pids(admin)
        assert not lease.lost
    pool = lease_pool.pool_for(DEFAULT_DB_ALIAS, io_timeout=0.2)
    assert stuck not in {conn.backend_pid() for conn in pool._idle}


@needs_session  # compares backend pids, which the pooler hides
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_uses_its_parents_lease_connections(
    key: str, raw_connect: Connect, fresh_machinery: None
) -> None:
    admin = raw_connect()
    with hold(f"{key}:parent", ttl=3, renew_every=0.1) as parent_lease:
        wait_until(renewed_after(parent_lease, 1), what="a renewal in the parent")
        parent_pool = lease_pool.pool_for(DEFAULT_DB_ALIAS, io_timeout=0.1)
        wait_until(lambda: parent_pool.idle_count() > 0, what="an idle pooled connection in the parent")
        parent_pids = {conn.backend_pid() for conn in parent_pool._idle}
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (the child process)
            code = 1
            try:
                os.close(read)
                pool = lease_pool.pool_for(DEFAULT_DB_ALIAS, io_timeout=0.1)
                with hold(f"{key}:child", ttl=3, renew_every=0.1) as lease:
                    renewed = renewed_after(lease, 1)
                    while not renewed():
                        lease.wait_lost(0.01)
                    pids = [conn.backend_pid() for conn in pool._idle]
                report = {"new_pool": pool is not parent_pool, "pids": pids, "lost": lease.lost}
                os.write(write, json.dumps(report).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            report = json.loads(pipe.read() or "{}")
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, report
        assert report["new_pool"] and not report["lost"]
        assert report["pids"] and not set(report["pids"]) & parent_pids
        # The parent's sessions survived the child (its exit closed nothing of theirs).
        assert parent_pids <= lease_pids(admin)
        wait_until(renewed_after(parent_lease, 2), what="renewals in the parent after the child exited")
        assert not parent_lease.lost
    assert Lease.objects.inspect(f"{key}:child").status == "free"


@needs_session  # session state of one connection, which the pooler does not keep
def test_a_renewal_is_one_statement_and_the_session_timeout_bounds_it(
    key: str, raw_connect: Connect, fresh_machinery: None
) -> None:
    conn = lease_connection.LeaseConnection(DEFAULT_DB_ALIAS, io_timeout=1)
    try:
        grant = conn.acquire(key, "one-statement", timedelta(seconds=5), blocking=False, wait=None)
        conn.wrapper.force_debug_cursor = True
        conn.renew(key, grant.owner, grant.epoch, timedelta(seconds=5), timeout=0.3)  # sets the timeout
        conn.wrapper.queries_log.clear()
        conn.renew(key, grant.owner, grant.epoch, timedelta(seconds=5), timeout=0.3)
        statements = [q["sql"] for q in conn.wrapper.queries_log]
        assert len(statements) == 1 and "pg_lease_heartbeat" in statements[0], statements
        # The server bounds it: a renewal blocked on the row lock is cancelled after 0.3 s.
        blocker = raw_connect(autocommit=False)
        lock_row(blocker, key)
        with pytest.raises(OperationalError, match="statement timeout"):
            conn.renew(key, grant.owner, grant.epoch, timedelta(seconds=5), timeout=0.3)
        assert conn.wrapper.connection is None  # closed: never lent again
        blocker.rollback()
        # An acquire on a connection that renewed runs under the session's default timeout again.
        conn.renew(key, grant.owner, grant.epoch, timedelta(seconds=5), timeout=0.3)
        conn.acquire(key, "one-statement", timedelta(seconds=5), blocking=False, wait=None)
        with conn.wrapper.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone()[0] == "0"
    finally:
        conn.close()


@override_settings(PG_LEASE_LISTEN=False)
def test_behind_a_pooler_the_timeout_is_set_local_per_renewal(key: str, fresh_machinery: None) -> None:
    conn = lease_connection.LeaseConnection(DEFAULT_DB_ALIAS, io_timeout=1)
    try:
        assert conn.per_transaction
        grant = conn.acquire(key, "set-local", timedelta(seconds=5), blocking=False, wait=None)
        conn.wrapper.force_debug_cursor = True
        conn.renew(key, grant.owner, grant.epoch, timedelta(seconds=5), timeout=0.3)
        statements = [q["sql"] for q in conn.wrapper.queries_log]
        assert any("set_config('statement_timeout'" in q and "true)" in q for q in statements), statements
        assert conn.timeout_ms is None and conn.clean()  # no session state left behind
    finally:
        conn.close()


def test_hold_connections_setting_is_checked(key: str) -> None:
    for bad in (0, -1, 1.5, True, "3"):
        with override_settings(PG_LEASE_HOLD_CONNECTIONS=bad), pytest.raises(ImproperlyConfigured), hold(key, ttl=2):
            pass


def test_an_interrupt_meant_for_a_returned_call_never_touches_the_next_borrower(key: str, raw_connect: Connect) -> None:
    """A renewal has returned and its connection went back to the pool; another hold borrows it for a
    long statement; the first call's late interrupt (a watchdog, the end of a trust window) does nothing."""
    observer = raw_connect()
    # A hold kept open meanwhile: in tests, idle lease connections are closed once no hold is active.
    with override_settings(PG_LEASE_HOLD_CONNECTIONS=1), hold(f"{key}-keep", ttl=60):
        pool = lease_pool.pool_for(DEFAULT_DB_ALIAS, io_timeout=5.0)
        grant, _ = pool.acquire(key, "A", timedelta(seconds=30), blocking=False, wait=None)
        first = lease_connection.InFlight()
        pool.renew(key, "A", grant.epoch, timedelta(seconds=30), timeout=5, call=first)
        assert first.done.is_set()
        first.done.clear()  # as if its thread had not got that far yet: only the lending count protects now
        outcome: dict[str, str] = {}
        lent: list[lease_connection.LeaseConnection] = []

        def next_borrower() -> None:
            with pool.connection(5000) as conn, conn.wrapper.cursor() as cursor:
                lent.append(conn)
                try:
                    cursor.execute("SELECT pg_sleep(1.5)")
                    outcome["next"] = "completed"
                except Exception as exc:
                    outcome["next"] = f"{type(exc).__name__}: {exc}"

        borrower = threading.Thread(target=next_borrower)
        borrower.start()

        def sleeping() -> bool:
            row = observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
                "AND query = 'SELECT pg_sleep(1.5)'"  # not by pid: behind PgBouncer the client sees another
            ).fetchone()
            return bool(row and row[0])

        wait_until(sleeping, what="the next borrower's statement to run")
        assert lent == [first._conn]  # the same connection, lent again
        first.interrupt(grace=0.2)
        borrower.join(10)
        assert outcome == {"next": "completed"}
        pool.release(key, "A", grant.epoch, timeout=5)


def test_a_slow_on_handoff_delays_no_renewal(key: str) -> None:
    """on_handoff runs on a thread of its own: a callback slower than the trust window, with a single
    renewal worker, does not cost the hold its lease."""
    finished = threading.Event()

    def slow(lease: HeldLease) -> None:
        finished.wait(10)  # until the test has seen the hold survive a whole trust window

    with override_settings(PG_LEASE_HOLD_CONNECTIONS=1), hold(key, ttl=1.5, on_handoff=slow) as lease:
        Lease.objects.request_handoff(key)
        assert lease.wait_stop(timeout=5) and lease.handoff_requested
        expiry = lease.expires_at
        wait_until(lambda: lease.expires_at > expiry + timedelta(seconds=1.5), what="renewals past a whole ttl")
        finished.set()
        lease.check()
