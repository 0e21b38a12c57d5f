"""The async API (aacquire, arenew, arelease, ainspect, aforce_release) on a real server.

Each scenario is a coroutine run with ``async_to_sync`` from the test's thread, as Django runs
async tests: outside a transaction the calls run on the lease pool's connections; inside the test's
``atomic()`` they run back in this thread, on the test's own Django connection. Several waiters
share one event loop. Synchronisation is by observing the
server (``pg_stat_activity``, the lease row), never by sleeping. A blocking waiter's own connection
is found by its ``application_name``, ``pg_lease_django wait <owner>``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, assert_type

import psycopg
import psycopg.sql
import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction
from django.test import AsyncClient, override_settings

from devkit.dbserver import free_port
from pg_lease_django import (
    AlreadyFreeError,
    EpochMismatchError,
    EpochMovedOnError,
    Grant,
    InvalidInputError,
    LapsedError,
    Lease,
    LeaseError,
    LeaseState,
    LeaseTimeoutError,
    NeverAcquiredError,
    NotOwnerError,
)
from pg_lease_django.managers import NOTIFY_CHANNEL
from tests.children import asgi_app
from tests.helpers import Background, blocked_by, needs_session, row_snapshot, url_of_test_database, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]
T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
#: A poll interval longer than any wait a test accepts: a prompt wake-up must come from a
#: notification, the holder's expiry or the deadline, not from polling.
NEVER = 120.0
#: The timeout of a waiter that should be woken (by a notification, an expiry, a poll): longer
#: than HANG, so a waiter that is not woken ends past the guard, at its deadline or its poll.
WAIT = 60.0
#: A hang guard, not a latency bound: far beyond any stall of a loaded shared machine, and far
#: below what a missed wake-up costs (WAIT, NEVER, a holder's TTL). Latencies are `make bench`'s.
HANG = 30.0
BEHIND_PGBOUNCER = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))
LISTEN_AND_POLL = [pytest.param(True, id="listen", marks=needs_session), pytest.param(False, id="poll")]


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """Await ``scenario()`` in an event loop, its sync_to_async calls running in this thread."""

    async def main() -> T:
        return await scenario()

    return async_to_sync(main)()


# --- observing the server ------------------------------------------------------------------------


def hold(conn: psycopg.Connection[Any], key: str, owner: str = "holder", ttl: str = "60 s") -> tuple[int, Any]:
    """Acquire ``key`` from a raw connection (another client); return ``(epoch, expires_at)``."""
    row = conn.execute(
        "SELECT granted, epoch, expires_at FROM pg_lease_acquire(%s, %s, %s)", [key, owner, ttl]
    ).fetchone()
    assert row is not None and row[0], f"{key} not granted to {owner}"
    return row[1], row[2]


def waiter_backend(observer: psycopg.Connection[Any], owner: str) -> tuple[Any, ...] | None:
    """``(pid, state, backend_xid, backend_xmin, query)`` of the blocking waiter ``owner``'s own connection."""
    rows = observer.execute(
        "SELECT pid, state, backend_xid::text, backend_xmin::text, query FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = %s",
        [f"pg_lease_django wait {owner}"],
    ).fetchall()
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def is_waiting(observer: psycopg.Connection[Any], owner: str) -> bool:
    """True once ``owner``'s waiter has been refused at least once and is between attempts."""
    backend = waiter_backend(observer, owner)
    return backend is not None and backend[1] != "active" and "pg_lease_acquire" in backend[4]


def locks_held(observer: psycopg.Connection[Any], pid: int) -> int:
    row = observer.execute("SELECT count(*) FROM pg_locks WHERE pid = %s", [pid]).fetchone()
    assert row is not None
    return int(row[0])


async def until(predicate: Callable[[], bool], what: str, task: asyncio.Task[Any] | None = None) -> None:
    """Poll ``predicate`` without blocking the event loop; fail after 10 s or if ``task`` ends first."""
    deadline = time.monotonic() + 10.0
    while not predicate():
        if task is not None and task.done():
            pytest.fail(f"gave up waiting for {what}: the task ended with {task.exception() or task.result()!r}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def gone(observer: psycopg.Connection[Any], owner: str) -> None:
    """Wait until ``owner``'s waiter connection has left the server (its LISTEN with it)."""
    if not BEHIND_PGBOUNCER:  # behind the pooler the server sessions outlive the client's
        await until(lambda: waiter_backend(observer, owner) is None, f"{owner}'s connection to close")


def assert_django_connection_clean(observer: psycopg.Connection[Any]) -> None:
    """This thread's Django connection (the caller's): usable, idle, no transaction, lock or LISTEN."""
    assert not connection.in_atomic_block
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
        cursor.execute("SELECT pg_listening_channels()")
        assert cursor.fetchall() == []
    state = observer.execute(
        "SELECT state, backend_xid::text, backend_xmin::text FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    assert state == ("idle", None, None), state
    assert locks_held(observer, pid) == 0


# --- the same rules as the sync methods ----------------------------------------------------------


def failure(error: BaseException) -> tuple[Any, ...]:
    assert isinstance(error, LeaseError)
    return type(error), str(error), error.code, error.key, error.owner, error.epoch


def assert_same_failure(sync: Callable[[], object], asynchronous: Callable[[], Awaitable[object]]) -> LeaseError:
    """Both calls raise, and the same error: class, message, code, key, owner and epoch."""
    with pytest.raises(LeaseError) as expected:
        sync()
    with pytest.raises(LeaseError) as got:
        run(asynchronous)
    assert failure(got.value) == failure(expected.value)
    return got.value


def test_each_operation_succeeds_as_its_sync_twin(key: str) -> None:
    async def scenario() -> None:
        grant = await Lease.objects.aacquire(key, "w1", ttl=30)
        assert isinstance(grant, Grant)
        assert (grant.key, grant.owner, grant.epoch) == (key, "w1", 1)
        assert grant.expires_at - grant.server_time == timedelta(seconds=30)
        assert await Lease.objects.aacquire(key, "w2", ttl=timedelta(seconds=30)) is None
        state = await Lease.objects.ainspect(key)
        assert state == LeaseState(key, "held", "w1", 1, grant.expires_at, state.server_time)
        renewed = await Lease.objects.arenew(key, "w1", grant.epoch, ttl=60.5)
        assert renewed > grant.expires_at
        assert (await Lease.objects.ainspect(key)).expires_at == renewed
        await Lease.objects.arelease(key, "w1", grant.epoch)
        state = await Lease.objects.ainspect(key)
        assert (state.status, state.owner, state.epoch, state.expires_at) == ("free", None, 2, None)
        again = await Lease.objects.aacquire(key, "w2", ttl=30)
        assert again is not None and again.epoch == 3
        assert await Lease.objects.aforce_release(key, epoch=again.epoch) == 4
        self_takeover = await Lease.objects.aacquire(key, "w3", ttl=30)
        assert self_takeover is not None
        assert await Lease.objects.aforce_release(key) == self_takeover.epoch + 1

    run(scenario)
    sync_view = Lease.objects.inspect(key)
    async_view = run(lambda: Lease.objects.ainspect(key))
    assert async_view == replace(sync_view, server_time=async_view.server_time)
    assert (sync_view.status, sync_view.epoch) == ("free", 6)


def test_overloads_type_the_result_as_the_sync_ones_do(key: str) -> None:
    async def scenario() -> None:
        maybe = await Lease.objects.aacquire(key, "w1", ttl=30)
        assert_type(maybe, Grant | None)
        surely = await Lease.objects.aacquire(key, "w1", ttl=30, blocking=True, timeout=5)
        assert_type(surely, Grant)
        either = await Lease.objects.aacquire(key, "w1", ttl=30, blocking=bool(surely))
        assert_type(either, Grant | None)
        assert_type(await Lease.objects.aforce_release(key), int)

    run(scenario)


def test_renew_and_release_failures_are_the_sync_ones_in_spec_order(key: str, raw_connect: Connect) -> None:
    """Spec 7 precedence (not_owner, lapsed, epoch_mismatch); a failure writes nothing, as in sync."""
    observer = raw_connect()

    def both(owner: str, epoch: int) -> type[LeaseError]:
        before = row_snapshot(observer, key)
        kinds: set[type[LeaseError]] = set()
        for sync, asynchronous in [
            (
                lambda: Lease.objects.renew(key, owner, epoch, ttl=30),
                lambda: Lease.objects.arenew(key, owner, epoch, ttl=30),
            ),
            (lambda: Lease.objects.release(key, owner, epoch), lambda: Lease.objects.arelease(key, owner, epoch)),
        ]:
            kinds.add(type(assert_same_failure(sync, asynchronous)))
        assert row_snapshot(observer, key) == before, "a failed call must not write or lock the row"
        (kind,) = kinds
        return kind

    assert both("w1", 1) is NotOwnerError  # unknown key
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    assert both("w2", grant.epoch) is NotOwnerError  # held by another
    assert both("w1", grant.epoch + 1) is EpochMismatchError  # live, wrong epoch
    Lease.objects.release(key, "w1", grant.epoch)
    assert both("w1", grant.epoch + 1) is NotOwnerError  # free key
    lapsing = Lease.objects.acquire(key, "w1", ttl=0.001)
    assert lapsing is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="the lease to lapse")
    assert both("w1", lapsing.epoch) is LapsedError
    assert both("w1", lapsing.epoch + 7) is LapsedError  # lapse wins over epoch
    assert both("w2", lapsing.epoch) is NotOwnerError  # holder check first


def test_force_release_failures_are_the_sync_ones(key: str) -> None:
    error = assert_same_failure(lambda: Lease.objects.force_release(key), lambda: Lease.objects.aforce_release(key))
    assert isinstance(error, NeverAcquiredError) and "never acquired" in str(error)
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    error = assert_same_failure(
        lambda: Lease.objects.force_release(key, epoch=grant.epoch + 1),
        lambda: Lease.objects.aforce_release(key, epoch=grant.epoch + 1),
    )
    assert isinstance(error, EpochMovedOnError) and (error.owner, error.holder) == (None, "w1")
    assert run(lambda: Lease.objects.aforce_release(key, epoch=grant.epoch)) == grant.epoch + 1
    error = assert_same_failure(lambda: Lease.objects.force_release(key), lambda: Lease.objects.aforce_release(key))
    assert isinstance(error, AlreadyFreeError) and "already free" in str(error)


BAD_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("acquire", ("", "w", 30), {}),
    ("acquire", ("KEY", "w\x00", 30), {}),
    ("acquire", ("KEY", "w", 0), {}),
    ("acquire", ("KEY", "w", "30"), {}),
    ("acquire", ("KEY", "w", 30), {"timeout": 1}),
    ("acquire", ("KEY", "w", 30), {"blocking": False, "timeout": timedelta(seconds=1)}),
    ("acquire", ("KEY", "w", 30), {"blocking": "yes"}),
    ("acquire", ("KEY", "w", 30), {"blocking": True, "timeout": -0.001}),
    ("acquire", ("KEY", "w", 30), {"blocking": True, "timeout": float("nan")}),
    ("acquire", ("KEY", "w", 30), {"blocking": True, "timeout": timedelta(days=366)}),
    ("renew", ("KEY", "w", 0, 30), {}),
    ("renew", ("KEY", "w", True, 30), {}),
    ("renew", ("KEY", "w", 1, -1), {}),
    ("release", ("KEY", "", 1), {}),
    ("release", ("KEY", "w", 2**63), {}),
    ("inspect", (b"KEY",), {}),
    ("inspect", ("k" * 256,), {}),
    ("force_release", ("KEY",), {"epoch": 0}),
    ("force_release", (None,), {}),
]


@pytest.mark.parametrize(("method", "args", "kwargs"), BAD_CALLS)
def test_invalid_input_is_refused_as_in_sync_before_anything_is_sent(
    key: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], django_assert_num_queries: Any
) -> None:
    args = tuple(key if arg == "KEY" else arg for arg in args)
    with django_assert_num_queries(0):
        error = assert_same_failure(
            lambda: getattr(Lease.objects, method)(*args, **kwargs),
            lambda: getattr(Lease.objects, f"a{method}")(*args, **kwargs),
        )
    assert isinstance(error, InvalidInputError)
    assert Lease.objects.inspect(key).epoch == 0


def test_each_call_is_one_statement_on_the_callers_connection_inside_a_transaction(
    key: str, django_assert_num_queries: Any
) -> None:
    """Inside atomic() (async_to_sync from a sync caller) the statement is the transaction's: one on the
    caller's connection, in its thread (sync_to_async)."""
    with transaction.atomic(), django_assert_num_queries(1) as captured:
        grant = run(lambda: Lease.objects.aacquire(key, "w1", ttl=30))
    assert grant is not None and "pg_lease_acquire" in captured[0]["sql"]
    with transaction.atomic():
        with django_assert_num_queries(1):
            assert run(lambda: Lease.objects.aacquire(key, "w2", ttl=30)) is None
        with django_assert_num_queries(1):
            run(lambda: Lease.objects.arenew(key, "w1", grant.epoch, ttl=30))
        with django_assert_num_queries(1):
            run(lambda: Lease.objects.ainspect(key))
        with django_assert_num_queries(1):
            run(lambda: Lease.objects.arelease(key, "w1", grant.epoch))
        with django_assert_num_queries(1), pytest.raises(AlreadyFreeError):
            run(lambda: Lease.objects.aforce_release(key))
        with django_assert_num_queries(1):  # granted at its first try, in the transaction
            assert run(lambda: Lease.objects.aacquire(key, "w1", ttl=30, blocking=True, timeout=5)).owner == "w1"


def test_outside_a_transaction_no_call_uses_the_callers_connection(key: str, django_assert_num_queries: Any) -> None:
    """Outside a transaction each call runs on a connection of the lease pool, in a thread of the package's own."""
    with django_assert_num_queries(0):
        grant = run(lambda: Lease.objects.aacquire(key, "w1", ttl=30))
        assert grant is not None
        assert run(lambda: Lease.objects.aacquire(key, "w2", ttl=30)) is None
        run(lambda: Lease.objects.arenew(key, "w1", grant.epoch, ttl=30))
        assert run(lambda: Lease.objects.ainspect(key)).owner == "w1"
        run(lambda: Lease.objects.arelease(key, "w1", grant.epoch))
        with pytest.raises(AlreadyFreeError):
            run(lambda: Lease.objects.aforce_release(key))
        assert run(lambda: Lease.objects.aacquire(key, "w1", ttl=30, blocking=True, timeout=5)).owner == "w1"


def test_a_blocking_call_does_not_open_the_callers_connection(key: str) -> None:
    Lease.objects.inspect(key)  # the schema lookup, once per process, is done
    connection.close()
    grant = run(lambda: Lease.objects.aacquire(key, "w1", ttl=30, blocking=True, timeout=5))
    assert grant.owner == "w1"
    assert connection.connection is None


def test_inside_atomic_a_grant_rolls_back_with_the_callers_transaction(key: str) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        assert run(lambda: Lease.objects.aacquire(key, "w1", ttl=30)) is not None
        assert run(lambda: Lease.objects.aacquire(key, "w1", ttl=30, blocking=True, timeout=5)).epoch == 2
        raise Boom
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", 0)


def test_a_blocking_grant_obtained_by_polling_inside_atomic_rolls_back_with_it(key: str, raw_connect: Connect) -> None:
    """In a transaction the waiter polls with attempts on the caller's connection, as acquire() does."""
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]

    def release_when_waiting() -> None:
        def waiting() -> bool:
            row = observer.execute("SELECT state, query FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            return row is not None and row[0] == "idle in transaction" and "pg_lease_acquire" in row[1]

        wait_until(waiting, what="the waiter to poll inside its transaction")
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])

    releaser = Background(release_when_waiting)
    releaser.start()
    with (
        override_settings(PG_LEASE_POLL_INTERVAL=0.05),
        pytest.raises(RuntimeError, match="abort"),
        transaction.atomic(),
    ):
        got = run(lambda: Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=10))
        assert (got.owner, got.epoch) == ("waiter", epoch + 2)
        raise RuntimeError("abort")
    releaser.outcome()
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)
    assert waiter_backend(observer, "waiter") is None, "no connection of its own inside a transaction"
    assert_django_connection_clean(observer)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_db_manager_routes_every_call_and_the_waiters_own_connection(key: str) -> None:
    other = Lease.objects.db_manager("other")

    async def scenario() -> None:
        grant = await other.aacquire(key, "w1", ttl=30, blocking=True, timeout=5)
        assert (await other.ainspect(key)).owner == "w1"
        assert (await Lease.objects.ainspect(key)).status == "free"
        await other.arenew(key, "w1", grant.epoch, ttl=30)
        await other.arelease(key, "w1", grant.epoch)
        assert (await other.ainspect(key)).epoch == grant.epoch + 1

    run(scenario)
    assert Lease.objects.inspect(key).epoch == 0


# --- blocking: grants, timeouts, wake-ups ----------------------------------------------------------


def test_blocking_aacquire_of_a_free_key_returns_at_once_with_the_sync_types(key: str, raw_connect: Connect) -> None:
    observer = raw_connect()

    async def scenario() -> Grant:
        started = time.monotonic()
        grant = await Lease.objects.aacquire(key, "w", ttl=timedelta(seconds=30), blocking=True, timeout=WAIT)
        assert time.monotonic() - started < HANG, "no pause before the first attempt (it would last WAIT)"
        await gone(observer, "w")
        return grant

    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
        grant = run(scenario)
    assert (grant.key, grant.owner, grant.epoch) == (key, "w", 1)
    assert grant.expires_at - grant.server_time == timedelta(seconds=30)
    state = Lease.objects.inspect(key)
    assert (state.owner, state.expires_at) == ("w", grant.expires_at)
    assert grant.expires_at.tzinfo == state.expires_at.tzinfo, "loaded as Django loads timestamptz"  # type: ignore[union-attr]


@pytest.mark.parametrize("listen", LISTEN_AND_POLL)
@pytest.mark.parametrize("timeout", [0.4, timedelta(milliseconds=250), 0], ids=["float", "timedelta", "zero"])
def test_timeout_raises_57014_within_bound_and_leaves_nothing_behind(
    key: str, raw_connect: Connect, listen: bool, timeout: float | timedelta
) -> None:
    holder, observer = raw_connect(), raw_connect()
    hold(holder, key)
    before = row_snapshot(observer, key)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout

    async def scenario() -> tuple[float, LeaseTimeoutError]:
        started = time.monotonic()
        with pytest.raises(LeaseTimeoutError) as info:
            await Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=timeout)
        elapsed = time.monotonic() - started
        await gone(observer, "waiter")
        return elapsed, info.value

    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER):
        elapsed, error = run(scenario)
    # It waited its timeout at least, and was cut at its deadline, not at the next poll (NEVER).
    assert seconds <= elapsed < HANG, elapsed
    assert (error.sqlstate, error.code, error.key, error.owner) == ("57014", "timeout", key, "waiter")
    assert "holder" in str(error)
    with pytest.raises(LeaseTimeoutError) as sync_info:
        Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=timeout)
    assert str(sync_info.value) == str(error)
    assert row_snapshot(observer, key) == before
    assert_django_connection_clean(observer)


@needs_session  # LISTEN: transaction pooling breaks it
def test_wakes_on_a_release_from_another_connection_long_before_the_poll_interval(
    key: str, raw_connect: Connect
) -> None:
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)

    async def scenario() -> tuple[Grant, float]:
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=WAIT))
        await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
        released_at = time.monotonic()
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])
        grant = await waiter
        return grant, time.monotonic() - released_at

    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=NEVER):
        grant, lag = run(scenario)
    assert (grant.owner, grant.epoch) == ("waiter", epoch + 2)
    # Not woken, it would wake at its deadline (WAIT), the next poll (NEVER) or the holder's expiry (60 s).
    assert lag < HANG, "woken by the notification, not by a poll"


@needs_session  # observes the waiter's own server session
def test_polling_mode_wakes_within_the_poll_interval(key: str, raw_connect: Connect) -> None:
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key, ttl="1 hour")

    async def scenario() -> tuple[Grant, float]:
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=WAIT))
        await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
        released_at = time.monotonic()
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])
        grant = await waiter
        return grant, time.monotonic() - released_at

    # Found by a poll (1 s): not at its deadline (WAIT) or the holder's expiry (1 h).
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=1.0):
        grant, lag = run(scenario)
    assert grant.owner == "waiter"
    assert lag < HANG


@needs_session  # observes the waiter's own server session
def test_polling_mode_does_not_hear_a_release(key: str, raw_connect: Connect) -> None:
    """PG_LEASE_LISTEN = False: no LISTEN, so a release is found only by the next attempt (here, at the deadline)."""
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)

    async def scenario() -> tuple[Grant, float]:
        started = time.monotonic()
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=1.0))
        await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
        holder.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, epoch])
        grant = await waiter
        return grant, time.monotonic() - started

    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=NEVER):
        grant, elapsed = run(scenario)
    assert grant.owner == "waiter", "the last attempt at the deadline finds the key free"
    assert 1.0 <= elapsed < HANG, elapsed  # not before the deadline (it heard nothing), not at a poll (NEVER)


@pytest.mark.parametrize("listen", LISTEN_AND_POLL)
def test_wakes_at_the_holders_expiry_not_at_the_poll_interval(key: str, raw_connect: Connect, listen: bool) -> None:
    holder = raw_connect()
    epoch, expires_at = hold(holder, key, ttl="1 s")
    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER):
        grant = run(lambda: Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=WAIT))
    # Server clock: granted at the expiry, not before; not at its deadline (WAIT) or a poll (NEVER).
    lag = (grant.server_time - expires_at).total_seconds()
    assert 0 <= lag < HANG, lag
    assert grant.epoch == epoch + 1


@needs_session  # LISTEN: transaction pooling breaks it
def test_notifications_for_other_keys_neither_grant_nor_stretch_the_timeout(key: str, raw_connect: Connect) -> None:
    holder, noisy, registrant, observer, listener = (raw_connect() for _ in range(5))
    listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(NOTIFY_CHANNEL)))
    hold(holder, key)
    other = f"{key}/other"

    async def scenario() -> tuple[int, float]:
        started = time.monotonic()
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=1.0))
        await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
        # Noise for as long as the waiter waits (HANG at most): a wait stretched by each
        # notification would last until the noise stops, past the guard. A release notifies only
        # when someone registered for its key: someone does, each time.
        noise, noise_until = 0, time.monotonic() + HANG
        while not waiter.done() and time.monotonic() < noise_until:
            epoch, _ = hold(noisy, other, ttl="60 s")
            registered = registrant.execute(
                "SELECT granted FROM pg_lease_acquire_or_register(%s, 'noisy', '60 s', '1 minute')", [other]
            ).fetchone()
            assert registered == (False,)
            noisy.execute("SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [other, epoch])
            noise += 1
            await asyncio.sleep(0.005)  # let the waiter read (and skip) the notification
        with pytest.raises(LeaseTimeoutError):
            await waiter
        return noise, time.monotonic() - started

    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=NEVER):
        noise, elapsed = run(scenario)
    # Notifications kept coming while it waited (a round is far shorter than its 1 s timeout): a wait
    # that each one stretched would have lasted until the noise stopped. How many rounds fit in the
    # second depends on the machine's load, so only "more than one" is asserted.
    assert noise >= 2, noise
    heard = [n.payload for n in listener.notifies(timeout=HANG, stop_after=noise)]
    assert heard == [other] * noise, "every release of the other key notified the channel the waiter listens on"
    assert 1.0 <= elapsed < HANG, elapsed
    assert Lease.objects.inspect(key).owner == "holder"


@needs_session  # observes the waiter's own server session
@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll"])
def test_a_waiter_holds_no_transaction_snapshot_lock_or_row_lock(key: str, raw_connect: Connect, listen: bool) -> None:
    observer = raw_connect()

    async def scenario() -> None:
        grant = await Lease.objects.aacquire(key, "holder", ttl=60)
        assert grant is not None
        before = row_snapshot(observer, key)
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=20))
        await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
        backend = waiter_backend(observer, "waiter")
        assert backend is not None and backend[1:4] == ("idle", None, None), backend
        assert locks_held(observer, backend[0]) == 0
        assert row_snapshot(observer, key) == before
        await Lease.objects.arenew(key, "holder", grant.epoch, ttl=60)  # not held up by the waiter
        await Lease.objects.arelease(key, "holder", grant.epoch)
        assert (await waiter).owner == "waiter"
        await gone(observer, "waiter")

    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=0.2):
        run(scenario)


# --- many waiters, one event loop, no thread each ------------------------------------------------


@needs_session  # observes the waiters' own server sessions
@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll"])
def test_twenty_waiters_in_one_loop_hold_no_thread_and_win_one_at_a_time(
    key: str, raw_connect: Connect, listen: bool
) -> None:
    observer = raw_connect()
    waiters = 20
    holding = {"now": 0, "most": 0}

    async def turn(owner: str) -> Grant:
        grant = await Lease.objects.aacquire(key, owner, ttl=30, blocking=True, timeout=60)
        holding["now"] += 1
        holding["most"] = max(holding["most"], holding["now"])
        assert (await Lease.objects.ainspect(key)).owner == owner, "the server agrees this waiter holds it"
        holding["now"] -= 1
        await Lease.objects.arelease(key, owner, grant.epoch)
        return grant

    async def scenario() -> tuple[Grant, list[Grant], int, int]:
        first = await Lease.objects.aacquire(key, "holder", ttl=60)
        assert first is not None
        threads_before = threading.active_count()
        tasks = [asyncio.create_task(turn(f"waiter-{i}")) for i in range(waiters)]
        await until(
            lambda: all(is_waiting(observer, f"waiter-{i}") for i in range(waiters)),
            f"{waiters} waiters to wait",
        )
        threads_waiting = threading.active_count()
        assert not any(task.done() for task in tasks)
        await Lease.objects.arelease(key, "holder", first.epoch)
        grants = await asyncio.gather(*tasks)
        return first, grants, threads_before, threads_waiting

    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER if listen else 0.05):
        first, grants, threads_before, threads_waiting = run(scenario)
    # A thread per waiter would add 20; the waits add none (a few at most, for name resolution).
    assert threads_waiting - threads_before <= 3, (threads_before, threads_waiting)
    assert holding["most"] == 1
    epochs = sorted(grant.epoch for grant in grants)
    assert epochs == list(range(first.epoch + 2, first.epoch + 2 + 2 * waiters, 2)), epochs
    assert {grant.owner for grant in grants} == {f"waiter-{i}" for i in range(waiters)}
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", first.epoch + 1 + 2 * waiters)


# --- cancellation --------------------------------------------------------------------------------


@needs_session  # observes the waiter's own server session
@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll"])
@pytest.mark.parametrize("how", ["cancel", "asyncio.timeout"])
def test_cancelling_a_waiter_leaves_no_listen_backend_lock_or_transaction(
    key: str, raw_connect: Connect, listen: bool, how: str
) -> None:
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key)
    before = row_snapshot(observer, key)

    async def wait_bounded() -> Grant:
        async with asyncio.timeout(0.5):
            return await Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=20)

    async def scenario() -> None:
        if how == "cancel":
            waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=20))
            await until(lambda: is_waiting(observer, "waiter"), "the waiter to wait", waiter)
            assert waiter_backend(observer, "waiter") is not None
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        else:
            with pytest.raises(TimeoutError):
                await wait_bounded()
        await gone(observer, "waiter")  # the session, and with it its LISTEN, has ended

    with override_settings(PG_LEASE_LISTEN=listen, PG_LEASE_POLL_INTERVAL=NEVER):
        run(scenario)
    assert row_snapshot(observer, key) == before
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("holder", epoch)
    assert_django_connection_clean(observer)


@needs_session  # observes the waiter's own server session
def test_cancelling_an_attempt_blocked_on_the_row_cancels_the_statement(key: str, raw_connect: Connect) -> None:
    """The attempt waits on a row lock; cancelled there it must neither linger nor grant later."""
    holder, observer = raw_connect(), raw_connect()
    epoch, _ = hold(holder, key, ttl="50 ms")
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="the lease to lapse")
    blocker = raw_connect(autocommit=False)
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])

    async def scenario() -> None:
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=20))
        # Its first try, made as a non-blocking call's is (on the lease pool), waits on the row.
        await until(lambda: blocked_by(observer, blocker) == 1, "the attempt to block on the row", waiter)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await gone(observer, "waiter")

    run(scenario)
    # Nothing waits on the blocker's row lock any more, so nothing can take the lease when it ends.
    assert blocked_by(observer, blocker) == 0
    blocker.commit()
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("lapsed", "holder", epoch), "the cancelled attempt granted"
    assert_django_connection_clean(observer)


# --- an async view behind an ASGI server ----------------------------------------------------------


def get_json(url: str, timeout: float = 60.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def check_handoffs(answers: list[dict[str, Any]], owners: list[str], released_epoch: int) -> None:
    """Every request was served; each held the lease alone, one after the other (epochs step by 2)."""
    assert sorted(answer["owner"] for answer in answers) == sorted(owners)
    for answer in answers:
        assert (answer["seen_owner"], answer["seen_epoch"]) == (answer["owner"], answer["epoch"])
    epochs = sorted(answer["epoch"] for answer in answers)
    assert epochs == list(range(released_epoch + 1, released_epoch + 1 + 2 * len(owners), 2)), epochs


def test_an_async_view_waits_for_the_lease_in_process(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Django's AsyncClient and the view of tests/children/asgi_app.py, its URLconf set by override_settings."""
    owners = [f"client-{i}" for i in range(4)]
    monkeypatch.setattr(asgi_app, "gauge", asgi_app.Gauge())

    async def scenario() -> tuple[int, list[dict[str, Any]]]:
        client = AsyncClient()
        first = await Lease.objects.aacquire(key, "holder", ttl=60)
        assert first is not None
        requests = [
            asyncio.create_task(client.get("/hold", {"key": key, "owner": owner, "hold": "0.02"})) for owner in owners
        ]
        await until(lambda: asgi_app.gauge.waiting == len(owners), "every request to wait")
        await Lease.objects.arelease(key, "holder", first.epoch)
        responses = await asyncio.gather(*requests)
        assert [response.status_code for response in responses] == [200] * len(owners)
        return first.epoch + 1, [json.loads(response.content) for response in responses]

    with override_settings(ROOT_URLCONF="tests.children.asgi_app", PG_LEASE_POLL_INTERVAL=0.05):
        released_epoch, answers = run(scenario)
    check_handoffs(answers, owners, released_epoch)
    assert (asgi_app.gauge.max_holding, asgi_app.gauge.max_waiting) == (1, len(owners))


@pytest.fixture
def asgi_server(tmp_path: Path) -> Iterator[str]:
    """tests/children/asgi_app.py served by uvicorn in a child process on the test database; yields its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": url_of_test_database(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "uvicorn", "tests.children.asgi_app:make_application", "--factory"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--lifespan", "off", "--no-access-log"]
    log = tmp_path / "uvicorn.log"
    with log.open("w") as output:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if server.poll() is not None:
                pytest.fail(f"uvicorn exited with {server.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("uvicorn did not start within 30 s")
                time.sleep(0.05)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


def test_an_async_view_behind_uvicorn_serves_concurrent_requests_one_holder_at_a_time(
    key: str, asgi_server: str
) -> None:
    owners = [f"client-{i}" for i in range(8)]
    first = Lease.objects.acquire(key, "holder", ttl=60)
    assert first is not None
    requests = [
        Background(
            functools.partial(
                get_json, f"{asgi_server}/hold?" + urllib.parse.urlencode({"key": key, "owner": owner, "hold": "0.05"})
            )
        )
        for owner in owners
    ]
    for request in requests:
        request.start()
    wait_until(lambda: get_json(f"{asgi_server}/stats")["waiting"] == len(owners), what="every request to wait")
    Lease.objects.release(key, "holder", first.epoch)
    answers = [request.outcome(timeout=60) for request in requests]
    check_handoffs(answers, owners, first.epoch + 1)
    stats = get_json(f"{asgi_server}/stats")
    assert (stats["max_holding"], stats["max_waiting"], stats["waiting"], stats["holding"]) == (1, len(owners), 0, 0)
    assert Lease.objects.inspect(key).status == "free"
