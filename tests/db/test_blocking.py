"""Blocking acquire on a real server: bounded waits (SQLSTATE 57014), prompt wake-ups, cleanup.

Waiters run in threads, each on its own Django connection (closed when the thread ends), or in the
main thread when a signal must interrupt them. Synchronisation is by observing the server
(``pg_stat_activity``, ``pg_blocking_pids``, the lease row), never by sleeping.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.sql
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from pg_lease_django import Grant, InvalidInputError, Lease, LeaseTimeoutError
from pg_lease_django.managers import NOTIFY_CHANNEL
from tests.helpers import Background, needs_session, row_snapshot, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]

#: A poll interval longer than any wait a test accepts: a prompt wake-up must come from a
#: notification, the holder's expiry or the deadline, not from polling.
NEVER = 120.0
#: The timeout of a waiter that should be woken (by a notification, an expiry, a poll): longer
#: than HANG, so a waiter that is not woken ends past the guard, at its deadline or its poll.
WAIT = 60.0
#: A hang guard, not a latency bound: far beyond any stall of a loaded shared machine, and far
#: below what a missed wake-up costs (WAIT, NEVER, a holder's TTL). Latencies are `make bench`'s.
HANG = 30.0


class Interrupted(Exception):
    """Raised from a signal handler, as a task-cancellation or timeout library would."""


class Waiter(Background):
    """A blocking acquire in a thread on its own Django connection.

    Records the backend pid (once known), the statements it sent, and ``time.monotonic()`` when it
    started and when the acquire returned or raised.
    """

    def __init__(
        self,
        key: str,
        owner: str,
        *,
        ttl: float = 30,
        timeout: float | None = None,
        atomic: bool = False,
        isolation: str | None = None,
        release: bool = False,
    ) -> None:
        self.key, self.owner, self.ttl, self.timeout = key, owner, ttl, timeout
        self.atomic, self.isolation, self.release = atomic, isolation, release
        self.pid = 0
        self.pid_known = threading.Event()
        self.queries: list[str] = []
        self.started_at = self.ended_at = 0.0
        super().__init__(self._acquire)

    def _acquire(self) -> Grant | None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self.pid_known.set()
            capture = CaptureQueriesContext(connection)
            try:
                with capture:
                    self.started_at = time.monotonic()
                    try:
                        grant = self._blocking_acquire()
                    finally:
                        self.ended_at = time.monotonic()
            finally:
                self.queries = [query["sql"] for query in capture.captured_queries]
            if self.release and grant is not None:
                Lease.objects.release(self.key, self.owner, grant.epoch)
            return grant
        finally:
            self.pid_known.set()
            connection.close()

    def _blocking_acquire(self) -> Grant | None:
        if not self.atomic:
            return Lease.objects.acquire(self.key, self.owner, ttl=self.ttl, blocking=True, timeout=self.timeout)
        with transaction.atomic():
            if self.isolation:
                with connection.cursor() as cursor:
                    cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {self.isolation}")
            return Lease.objects.acquire(self.key, self.owner, ttl=self.ttl, blocking=True, timeout=self.timeout)

    def attempts(self) -> int:
        """How many acquire attempts the waiter sent."""
        return sum("pg_lease_acquire" in sql for sql in self.queries)


def attempts_in(capture: CaptureQueriesContext) -> int:
    """How many acquire attempts were sent on the captured connection."""
    return sum("pg_lease_acquire" in query["sql"] for query in capture.captured_queries)


def backend_state(observer: psycopg.Connection[Any], pid: int) -> tuple[Any, ...] | None:
    """``(state, backend_xid, backend_xmin, query)`` of backend ``pid``, or None when it is gone."""
    return observer.execute(
        "SELECT state, backend_xid::text, backend_xmin::text, query FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()


def is_waiting(observer: psycopg.Connection[Any], pid: int) -> bool:
    """True once backend ``pid`` has finished at least one acquire attempt and is between attempts."""
    state = backend_state(observer, pid)
    return state is not None and state[0] != "active" and "pg_lease_acquire" in state[3]


def is_blocked(observer: psycopg.Connection[Any], pid: int) -> bool:
    """True while backend ``pid`` waits for a lock another backend holds."""
    return observer.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", [pid]).fetchone() == (True,)


def wait_until_waiting(observer: psycopg.Connection[Any], waiter: Waiter) -> None:
    """Wait until ``waiter`` has been refused at least once and sleeps between attempts."""
    assert waiter.pid_known.wait(10), "waiter did not start"
    wait_until(lambda: not waiter.is_alive() or is_waiting(observer, waiter.pid), what=f"{waiter.owner} to wait")
    assert waiter.is_alive(), f"{waiter.owner} stopped waiting: {waiter.error!r} {waiter.result!r}"


def locks_held(observer: psycopg.Connection[Any], pid: int) -> int:
    """Number of lock entries (any mode, granted or not) of backend ``pid``."""
    row = observer.execute("SELECT count(*) FROM pg_locks WHERE pid = %s", [pid]).fetchone()
    assert row is not None
    return int(row[0])


def hold(conn: psycopg.Connection[Any], key: str, owner: str = "holder", ttl: str = "60 s") -> tuple[int, Any]:
    """Acquire ``key`` from a raw connection; return ``(epoch, expires_at)``."""
    row = conn.execute(
        "SELECT granted, epoch, expires_at FROM pg_lease_acquire(%s, %s, %s)", [key, owner, ttl]
    ).fetchone()
    assert row is not None and row[0], f"{key} not granted to {owner}"
    return row[1], row[2]


def assert_django_connection_clean(observer: psycopg.Connection[Any]) -> None:
    """The main thread's Django connection: usable, idle, no transaction, no lock, no LISTEN."""
    assert not connection.in_atomic_block
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    state = backend_state(observer, pid)
    assert state is not None
    assert state[:3] == ("idle", None, None), state
    assert locks_held(observer, pid) == 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_listening_channels()")
        assert cursor.fetchall() == []


#: Both ways of waiting. LISTEN needs a server session of its own: behind a transaction-pooling
#: PgBouncer (where docs/settings.md says to turn it off) a LISTEN left by a connection closed
#: mid-statement stays on the pooled server connection that the next client gets.
LISTEN_OR_POLL = [pytest.param(True, id="listen", marks=needs_session), pytest.param(False, id="poll")]

# --- arguments ---------------------------------------------------------------------------------


def test_timeout_without_blocking_is_invalid_input(key: str) -> None:
    with pytest.raises(InvalidInputError, match="blocking=True"):
        Lease.objects.acquire(key, "w", ttl=30, timeout=1)  # type: ignore[call-overload]
    with pytest.raises(InvalidInputError, match="blocking=True"):
        Lease.objects.acquire(key, "w", ttl=30, blocking=False, timeout=timedelta(seconds=1))
    assert Lease.objects.inspect(key).epoch == 0, "nothing was sent"


@pytest.mark.parametrize("timeout", [-0.001, timedelta(seconds=-1), float("nan"), True, "1"])
def test_bad_timeout_is_invalid_input(key: str, timeout: Any) -> None:
    with pytest.raises(InvalidInputError, match="timeout"):
        Lease.objects.acquire(key, "w", ttl=30, blocking=True, timeout=timeout)


def test_blocking_acquire_of_a_free_key_returns_at_once(key: str) -> None:
    started = time.monotonic()
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER), CaptureQueriesContext(connection) as capture:
        grant = Lease.objects.acquire(key, "w", ttl=30, blocking=True, timeout=WAIT)
    assert grant is not None and (grant.owner, grant.epoch) == ("w", 1)
    assert attempts_in(capture) == 1, "granted by its first attempt"
    assert time.monotonic() - started < HANG, "no pause before the first attempt (it would last WAIT)"


# --- timeout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("listen", LISTEN_OR_POLL)
@pytest.mark.parametrize("timeout", [0.4, timedelta(milliseconds=250), 0], ids=["float", "timedelta", "zero"])
def test_timeout_raises_57014_within_bound_and_leaves_nothing_behind(
    key: str, raw_connect: Connect, listen: bool, timeout: float | timedelta
) -> None:
    holder, observer = raw_connect(), raw_connect()
    hold(holder, key)
    before = row_snapshot(observer, key)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    # A poll interval far beyond the timeout: the wait must be cut at the deadline, not at a poll.
    with (
        override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER),
        CaptureQueriesContext(connection) as capture,
    ):
        started = time.monotonic()
        with pytest.raises(LeaseTimeoutError) as info:
            Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=timeout)
        elapsed = time.monotonic() - started
    # It waited its timeout at least, and was cut at its deadline, not at the next poll (NEVER):
    # one attempt, a pause until the deadline, one last attempt (none after a zero timeout).
    assert seconds <= elapsed < HANG, elapsed
    assert attempts_in(capture) == (2 if seconds else 1), capture.captured_queries
    error = info.value
    assert (error.sqlstate, error.code, error.key, error.owner) == ("57014", "timeout", key, "waiter")
    assert "holder" in str(error)
    assert f"after waiting {seconds:g} s" in str(error), str(error)  # seconds, as a person reads them
    assert_django_connection_clean(observer)
    assert row_snapshot(observer, key) == before
    assert Lease.objects.inspect(key).owner == "holder"


# --- wake-ups ----------------------------------------------------------------------------------


@needs_session  # relies on LISTEN, which transaction pooling breaks
def test_wakes_on_release_long_before_the_poll_interval(key: str, raw_connect: Connect) -> None:
    observer = raw_connect()
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        grant = Lease.objects.acquire(key, "holder", ttl=60)
        assert grant is not None
        waiter = Waiter(key, "waiter", timeout=WAIT)
        waiter.start()
        wait_until_waiting(observer, waiter)
        released_at = time.monotonic()
        Lease.objects.release(key, "holder", grant.epoch)
        got = waiter.outcome(HANG)
    assert (got.owner, got.epoch) == ("waiter", grant.epoch + 2)
    # Not woken, it would wake at its deadline (WAIT), the next poll (NEVER) or the holder's expiry (60 s).
    assert waiter.ended_at - released_at < HANG, "woken by the notification, not by a poll"
    assert waiter.attempts() == 2, "refused once, then granted by the attempt the notification woke"
    assert waiter.queries[0].startswith("LISTEN") and waiter.queries[-1].startswith("UNLISTEN")


@needs_session  # relies on LISTEN, which transaction pooling breaks
def test_release_and_force_release_notify_on_the_channel_waiters_listen_on(key: str, raw_connect: Connect) -> None:
    # The channel is spelled in the migrations' SQL and, once, in Python: they must agree. A release
    # notifies only when a waiter registered (tests/db/test_notify.py): register one before each.
    listener, waiter = raw_connect(), raw_connect()
    listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(NOTIFY_CHANNEL)))

    def register() -> None:
        row = waiter.execute(
            "SELECT granted FROM pg_lease_acquire_or_register(%s, 'waiter', '60 s', '1 minute')", [key]
        ).fetchone()
        assert row == (False,)

    grant = Lease.objects.acquire(key, "holder", ttl=60)
    assert grant is not None
    register()
    Lease.objects.release(key, "holder", grant.epoch)
    assert Lease.objects.acquire(key, "holder", ttl=60) is not None
    register()
    Lease.objects.force_release(key)
    heard = [(notify.channel, notify.payload) for notify in listener.notifies(timeout=5, stop_after=2)]
    assert heard == [(NOTIFY_CHANNEL, key), (NOTIFY_CHANNEL, key)]


@pytest.mark.parametrize("listen", LISTEN_OR_POLL)
def test_wakes_at_the_holders_expiry_not_at_the_poll_interval(key: str, raw_connect: Connect, listen: bool) -> None:
    observer = raw_connect()
    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER):
        holder = Lease.objects.acquire(key, "holder", ttl=1)
        assert holder is not None
        waiter = Waiter(key, "waiter", timeout=WAIT)
        waiter.start()
        wait_until_waiting(observer, waiter)
        got = waiter.outcome(HANG)
    # Server clock: granted at the expiry, not before; not at its deadline (WAIT) or a poll (NEVER).
    lag = (got.server_time - holder.expires_at).total_seconds()
    assert 0 <= lag < HANG, lag
    assert got.epoch == holder.epoch + 1
    assert waiter.attempts() <= 4, "slept until the expiry instead of spinning"


def test_polling_mode_sends_no_listen_and_wakes_within_the_poll_interval(key: str, raw_connect: Connect) -> None:
    observer = raw_connect()
    interval = 1.0
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=interval):
        grant = Lease.objects.acquire(key, "holder", ttl=3600)
        assert grant is not None
        waiter = Waiter(key, "waiter", timeout=WAIT)
        waiter.start()
        wait_until_waiting(observer, waiter)
        released_at = time.monotonic()
        Lease.objects.release(key, "holder", grant.epoch)
        got = waiter.outcome(HANG)
    assert got.owner == "waiter"
    # Found by a poll: not at its deadline (WAIT) or the holder's expiry (1 h)...
    assert waiter.ended_at - released_at < HANG
    # ...and polls no faster than the interval (a stall only makes fewer attempts, never more).
    assert waiter.attempts() <= (waiter.ended_at - waiter.started_at) / interval + 2, waiter.attempts()
    assert not any("LISTEN" in sql for sql in waiter.queries)


def test_notifications_for_other_keys_neither_grant_nor_stretch_the_timeout(key: str, raw_connect: Connect) -> None:
    holder, observer, noisy, listener = raw_connect(), raw_connect(), raw_connect(), raw_connect()
    listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(NOTIFY_CHANNEL)))
    hold(holder, key)
    other = f"{key}/other"
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        waiter = Waiter(key, "waiter", timeout=1.0)
        waiter.start()
        wait_until_waiting(observer, waiter)
        # Noise for as long as the waiter waits (HANG at most): a wait stretched by each
        # notification would last until the noise stops, past the guard. A release notifies only
        # when someone registered for its key: someone does, each time.
        noise, noise_until = 0, time.monotonic() + HANG
        while waiter.is_alive() and time.monotonic() < noise_until:
            epoch, _ = hold(holder, other, ttl="60 s")
            registered = noisy.execute(
                "SELECT granted FROM pg_lease_acquire_or_register(%s, 'noisy', '60 s', '1 minute')", [other]
            ).fetchone()
            assert registered == (False,)
            holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [other, epoch])
            noise += 1
        with pytest.raises(LeaseTimeoutError):
            waiter.outcome()
    assert noise > 10
    heard = [n.payload for n in listener.notifies(timeout=HANG, stop_after=noise)]
    assert heard == [other] * noise, "every release of the other key notified the channel the waiter listens on"
    assert 1.0 <= waiter.ended_at - waiter.started_at < HANG
    assert waiter.attempts() <= 2, "another key's release must not cause a retry"


# --- many waiters ------------------------------------------------------------------------------


@needs_session  # relies on LISTEN, which transaction pooling breaks
def test_one_release_has_exactly_one_winner_and_the_others_keep_waiting(key: str, raw_connect: Connect) -> None:
    observer = raw_connect()
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        grant = Lease.objects.acquire(key, "holder", ttl=60)
        assert grant is not None
        waiters = [Waiter(key, f"waiter-{i}", timeout=2.0) for i in range(5)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            wait_until_waiting(observer, waiter)
        Lease.objects.release(key, "holder", grant.epoch)
        for waiter in waiters:
            waiter.join(30)
    winners = [w for w in waiters if w.error is None]
    assert len(winners) == 1, [(w.owner, w.error) for w in waiters]
    (winner,) = winners
    assert winner.result.epoch == grant.epoch + 2
    for loser in waiters:
        if loser is not winner:
            assert isinstance(loser.error, LeaseTimeoutError)
            assert loser.ended_at - loser.started_at >= 2.0, "a loser gave up before its timeout"
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == (winner.owner, winner.result.epoch)


@needs_session  # relies on LISTEN, which transaction pooling breaks
def test_a_chain_of_handoffs_serves_every_waiter_through_notifications(key: str, raw_connect: Connect) -> None:
    """Each waiter releases as soon as it is granted; with polling off in effect, every turn needs a notification."""
    observer = raw_connect()
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        grant = Lease.objects.acquire(key, "holder", ttl=60)
        assert grant is not None
        waiters = [Waiter(key, f"waiter-{i}", timeout=WAIT, release=True) for i in range(6)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            wait_until_waiting(observer, waiter)
        released_at = time.monotonic()
        Lease.objects.release(key, "holder", grant.epoch)
        grants: list[Grant] = [waiter.outcome(HANG) for waiter in waiters]
    # A turn without its notification would wait for the waiter's deadline (WAIT) or a poll (NEVER).
    assert max(w.ended_at for w in waiters) - released_at < HANG
    epochs = sorted(g.epoch for g in grants)
    assert epochs == list(range(grant.epoch + 2, grant.epoch + 2 + 2 * len(waiters), 2)), epochs
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", grant.epoch + 1 + 2 * len(waiters))


# --- transactions ------------------------------------------------------------------------------


def test_waiting_outside_atomic_holds_no_transaction_snapshot_lock_or_row_lock(key: str, raw_connect: Connect) -> None:
    observer = raw_connect()
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        grant = Lease.objects.acquire(key, "holder", ttl=60)
        assert grant is not None
        before = row_snapshot(observer, key)
        waiter = Waiter(key, "waiter", timeout=20)
        waiter.start()
        wait_until_waiting(observer, waiter)
        state = backend_state(observer, waiter.pid)
        assert state is not None and state[:3] == ("idle", None, None), state
        assert locks_held(observer, waiter.pid) == 0
        assert row_snapshot(observer, key) == before
        # The holder's renewal is not held up by the waiter.
        Lease.objects.renew(key, "holder", grant.epoch, ttl=60)
        Lease.objects.release(key, "holder", grant.epoch)
        assert waiter.outcome().owner == "waiter"


def test_refused_attempts_take_no_row_lock_and_write_nothing(key: str, raw_connect: Connect) -> None:
    holder, observer = raw_connect(), raw_connect()
    hold(holder, key)
    before = row_snapshot(observer, key)
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=0.005):
        waiters = [Waiter(key, f"waiter-{i}", timeout=0.5) for i in range(3)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            with pytest.raises(LeaseTimeoutError):
                waiter.outcome()
    # Each waiter tries at least twice (at once, and at its deadline), and usually dozens of times
    # (5 ms polls); how many depends on the machine's speed, so only the first is asserted.
    assert all(w.attempts() >= 2 for w in waiters), [w.attempts() for w in waiters]
    assert row_snapshot(observer, key) == before, "a refused attempt locked or rewrote the row"


def test_waiter_inside_atomic_polls_at_read_committed_and_commits_with_the_transaction(
    key: str, raw_connect: Connect
) -> None:
    observer = raw_connect()
    with override_settings(PG_LEASE_POLL_INTERVAL=0.05):
        grant = Lease.objects.acquire(key, "holder", ttl=60)
        assert grant is not None
        waiter = Waiter(key, "waiter", timeout=10, atomic=True)
        waiter.start()
        wait_until_waiting(observer, waiter)
        state = backend_state(observer, waiter.pid)
        assert state is not None and state[0] == "idle in transaction", "the caller's transaction stays open"
        Lease.objects.release(key, "holder", grant.epoch)
        got = waiter.outcome()
    assert got.owner == "waiter"
    assert not any("LISTEN" in sql for sql in waiter.queries), "LISTEN inside a transaction only starts at commit"
    assert Lease.objects.inspect(key).owner == "waiter"


def test_a_grant_obtained_by_waiting_inside_atomic_rolls_back_with_it(key: str, raw_connect: Connect) -> None:
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    pid = connection_pid()
    releaser = Background(lambda: release_when_waiting(observer, pid, holder, key, epoch))
    releaser.start()
    with (
        override_settings(PG_LEASE_POLL_INTERVAL=0.05),
        pytest.raises(RuntimeError, match="abort"),
        transaction.atomic(),
    ):
        got = Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=10)
        assert got is not None and got.owner == "waiter"
        raise RuntimeError("abort")
    releaser.outcome()
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)
    assert_django_connection_clean(observer)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_isolation_waiter_does_not_see_a_release_after_its_snapshot(
    key: str, raw_connect: Connect, isolation: str
) -> None:
    """Spec 8: the key is free, but the waiter reads its snapshot, where it is held, until it times out."""
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    with override_settings(PG_LEASE_POLL_INTERVAL=0.05):
        waiter = Waiter(key, "waiter", timeout=1.0, atomic=True, isolation=isolation)
        waiter.start()
        wait_until_waiting(observer, waiter)
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])
        with pytest.raises(LeaseTimeoutError):
            waiter.outcome()
    assert waiter.attempts() > 3
    assert Lease.objects.inspect(key).status == "free"


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_isolation_waiter_gets_a_serialization_failure_when_its_stale_view_lapses(
    key: str, raw_connect: Connect, isolation: str
) -> None:
    """Spec 8: once the snapshot's grant has expired the waiter tries to take the row, and fails with 40001."""
    holder, observer = raw_connect(), raw_connect()
    epoch, expires_at = hold(holder, key, ttl="1 s")
    with override_settings(PG_LEASE_POLL_INTERVAL=0.05):
        waiter = Waiter(key, "waiter", timeout=10, atomic=True, isolation=isolation)
        waiter.start()
        wait_until_waiting(observer, waiter)
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])
        assert observer.execute("SELECT clock_timestamp() < %s", [expires_at]).fetchone() == (True,)
        with pytest.raises(OperationalError) as info:
            waiter.outcome()
    assert getattr(info.value.__cause__, "sqlstate", None) == "40001"
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)


# --- cancellation ------------------------------------------------------------------------------


def connection_pid() -> int:
    """Backend pid of the main thread's Django connection (connecting if needed)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def release_when_waiting(
    observer: psycopg.Connection[Any], pid: int, holder: psycopg.Connection[Any], key: str, epoch: int
) -> None:
    """Release ``key`` from ``holder`` once backend ``pid`` waits for it."""
    wait_until(lambda: is_waiting(observer, pid), what="the waiter to wait")
    holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])


@contextmanager
def interrupt_main_thread(when: Callable[[], bool], exception: type[BaseException]) -> Iterator[None]:
    """Raise ``exception`` in the main thread from a signal handler as soon as ``when()`` holds."""

    def handler(signum: int, frame: Any) -> None:
        raise exception("interrupted while waiting")

    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def interrupt() -> None:
        wait_until(when, what="the moment to interrupt")
        signal.pthread_kill(main, signal.SIGUSR1)

    interrupter = Background(interrupt)
    interrupter.start()
    try:
        yield
    finally:
        interrupter.outcome()
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("listen", LISTEN_OR_POLL)
@pytest.mark.parametrize("exception", [KeyboardInterrupt, Interrupted])
def test_interrupt_between_attempts_leaves_no_listen_lock_or_transaction(
    key: str, raw_connect: Connect, listen: bool, exception: type[BaseException]
) -> None:
    holder, observer, watcher = raw_connect(), raw_connect(), raw_connect()
    hold(holder, key)
    pid = connection_pid()
    with (
        override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER),
        pytest.raises(exception),
        interrupt_main_thread(lambda: is_waiting(watcher, pid), exception),
    ):
        Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=20)
    assert_django_connection_clean(observer)
    assert Lease.objects.inspect(key).owner == "holder"


@pytest.mark.parametrize("exception", [KeyboardInterrupt, Interrupted])
def test_interrupt_during_an_attempt_blocked_on_the_row_cancels_it(
    key: str, raw_connect: Connect, exception: type[BaseException]
) -> None:
    """The attempt waits on a row lock; interrupted there it must neither linger nor grant later."""
    holder, observer, watcher = raw_connect(), raw_connect(), raw_connect()
    epoch, _ = hold(holder, key, ttl="50 ms")
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="the lease to lapse")
    blocker = raw_connect(autocommit=False)
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    pid = connection_pid()
    with (
        override_settings(PG_LEASE_POLL_INTERVAL=NEVER),
        pytest.raises(exception),
        interrupt_main_thread(lambda: is_blocked(watcher, pid), exception),
    ):
        Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=20)
    # The interrupted statement is gone from the server: nothing waits on the blocker's lock.
    wait_until(
        lambda: (backend_state(observer, pid) or ("gone",))[0] != "active",  # one read: it may vanish between two
        what="the interrupted attempt to end",
    )
    blocker.commit()
    assert_django_connection_clean(observer)
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("lapsed", "holder", epoch), "the cancelled attempt granted"


# --- the SQL-level blocking function -------------------------------------------------------------


def test_sql_blocking_acquire_grants_a_free_key_and_times_out_with_57014(key: str, raw_connect: Connect) -> None:
    holder, waiter = raw_connect(), raw_connect()
    row = holder.execute(
        "SELECT granted, owner, epoch FROM pg_lease_acquire(%s, 'holder', '60 s', '1 s')", [key]
    ).fetchone()
    assert row == (True, "holder", 1)
    started = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled) as info:  # not granted at the holder's expiry (60 s)
        waiter.execute("SELECT * FROM pg_lease_acquire(%s, 'waiter', '60 s', '300 ms')", [key])
    elapsed = time.monotonic() - started
    assert info.value.sqlstate == "57014"
    assert "holder" in str(info.value)
    assert 0.3 <= elapsed < HANG, elapsed
    assert waiter.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(psycopg.errors.QueryCanceled):
        waiter.execute("SELECT * FROM pg_lease_acquire(%s, 'waiter', '60 s', '0')", [key])
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        waiter.execute("SELECT * FROM pg_lease_acquire(%s, 'waiter', '60 s', '-1 s')", [key])


WITHIN = (
    "SELECT a.granted, a.owner, a.epoch, a.expires_at = a.server_time, clock_timestamp() - statement_timestamp() "
    "FROM pg_lease_acquire_within(%s, 'waiter', '60 s', %s::interval) a"
)


def test_a_polling_attempt_waits_for_a_lock_within_its_bound_and_changes_nothing(
    key: str, raw_connect: Connect
) -> None:
    """pg_lease_acquire_within, a polling waiter's attempt: a lock held open (here the lease row a
    takeover needs) is waited for ``within`` at most, or the session's lock_timeout when shorter
    (the server's clock: no less), then the attempt is refused, naming nobody (the key is free),
    with nothing changed, no row lock kept, the caller's transaction usable and its lock_timeout
    as it was."""
    holder, blocker, waiter, observer = raw_connect(), raw_connect(autocommit=False), raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    holder.execute("SELECT pg_lease_release(%s, 'holder', %s)", [key, epoch])
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    before = row_snapshot(observer, key)
    with waiter.transaction():
        refused = waiter.execute(WITHIN, [key, "200 ms"]).fetchone()
        waiter.execute("SET LOCAL lock_timeout = '150ms'")
        refused_sooner = waiter.execute(WITHIN, [key, "60 s"]).fetchone()  # not 55P03: a refusal
        assert waiter.execute("SHOW lock_timeout").fetchone() == ("150ms",)
        kept = observer.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT (locktype IN ('virtualxid', 'transactionid') "
            "OR mode = 'AccessShareLock')",
            [waiter.info.backend_pid],
        ).fetchone()
    assert refused is not None and refused_sooner is not None
    assert refused[:4] == refused_sooner[:4] == (False, None, epoch + 1, True)
    assert refused[4] >= timedelta(milliseconds=200) and refused_sooner[4] >= timedelta(milliseconds=150)
    assert kept == (0,)
    assert waiter.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert row_snapshot(observer, key) == before
    blocker.commit()
    for bad in ("-1 s", "1 mon", "366 days"):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            waiter.execute(WITHIN, [key, bad])
    # No bound of its own (no deadline): the plain acquire.
    assert waiter.execute(WITHIN, [key, None]).fetchone()[:3] == (True, "waiter", epoch + 2)  # type: ignore[index]


@pytest.mark.parametrize("wait", ["10 s", None], ids=["bounded", "unbounded"])
def test_sql_blocking_acquire_wakes_on_release_and_at_lapse(key: str, raw_connect: Connect, wait: str | None) -> None:
    holder, waiter, observer = raw_connect(), raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    sql = "SELECT granted, owner, epoch, server_time FROM pg_lease_acquire(%s, 'waiter', '1 s', %s::interval)"
    attempt = Background(lambda: waiter.execute(sql, [key, wait]).fetchone())
    attempt.start()
    wait_until(
        lambda: (
            observer.execute(
                "SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = %s", [waiter.info.backend_pid]
            ).fetchone()
            == (True,)
        ),
        what="the SQL waiter to sleep",
    )
    released = holder.execute(
        "SELECT outcome, server_time FROM pg_lease_release(%s, 'holder', %s)", [key, epoch]
    ).fetchone()
    assert released is not None and released[0] == "ok"
    granted, owner, got_epoch, granted_at = attempt.outcome()
    assert (granted, owner, got_epoch) == (True, "waiter", epoch + 2)
    # Server clock: after the release, and not at the holder's expiry (60 s) or the bound (10 s,
    # which would raise). It polls every 100 ms: how soon it wakes is a latency, for `make bench`.
    assert 0 <= (granted_at - released[1]).total_seconds() < HANG
    # Now "waiter" holds it for 1 s; a second SQL waiter is granted at its expiry.
    row = holder.execute(
        "SELECT granted, owner, server_time FROM pg_lease_acquire(%s, 'holder', '60 s', %s::interval)", [key, wait]
    ).fetchone()
    assert row is not None and row[:2] == (True, "holder")
    expires_at = observer.execute("SELECT %s::timestamptz + interval '1 s'", [granted_at]).fetchone()[0]  # type: ignore[index]
    assert 0 <= (row[2] - expires_at).total_seconds() < HANG


@pytest.mark.parametrize("interval", [0, -1, float("inf"), "0.5", True])
def test_a_poll_interval_that_is_not_a_positive_number_is_refused(key: str, interval: Any) -> None:
    Lease.objects.acquire(key, "holder", ttl=60)
    with override_settings(PG_LEASE_POLL_INTERVAL=interval), pytest.raises(ImproperlyConfigured):
        Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=1)
