"""Each async call at the cost of its work (issue 55), on a real server.

- A blocking ``aacquire`` of a free key costs what a non-blocking one does: its first try goes the
  non-blocking call's way, and only a refusal opens the waiter's own connection.
- An error on the waiter's own connection is mapped by the package: the caller's Django connection
  (another thread's) is not marked as having had an error.
- Outside a transaction the async calls run on the package's pool in threads of its own: one call
  waiting on a row lock holds up no other.

Connections are counted where they are opened (psycopg's ``connect``, which every connection of
the package goes through) and observed on the server (``pg_stat_activity``); synchronisation is
by observing the server, never by sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import OperationalError, connection

from pg_lease_django import Lease
from tests.helpers import blocked_by, needs_session, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]
T = TypeVar("T")

#: A hang guard, not a latency bound: what a call held up behind another would wait is the
#: other's row lock, which the tests keep until the end.
HANG = 30.0


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await scenario()

    return async_to_sync(main)()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The connections opened meanwhile, sync and async, by ``application_name`` (counted, then opened as usual)."""
    names: list[str] = []
    sync_connect, async_connect = psycopg.Connection.connect.__func__, psycopg.AsyncConnection.connect.__func__  # type: ignore[attr-defined]

    def counted_sync(cls: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(str(kwargs.get("application_name")))
        return sync_connect(cls, *args, **kwargs)

    async def counted_async(cls: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(str(kwargs.get("application_name")))
        return await async_connect(cls, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(counted_sync))
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", classmethod(counted_async))
    return names


def test_a_blocking_aacquire_of_a_free_key_opens_no_connection_of_its_own(key: str, opened: list[str]) -> None:
    async def scenario() -> None:
        assert await Lease.objects.aacquire(f"{key}/warm", "w", ttl=30) is not None  # connections the calls keep
        del opened[:]
        grant = await Lease.objects.aacquire(key, "w", ttl=30, blocking=True, timeout=5)
        assert grant.owner == "w"
        assert opened == [], "a free key: no connection opened for the call"

    run(scenario)


def test_a_refused_first_try_opens_the_waiters_connection(key: str, opened: list[str]) -> None:
    """The counter of the test above sees a waiter's own connection when there is one."""
    from pg_lease_django import LeaseTimeoutError

    async def scenario() -> None:
        assert await Lease.objects.aacquire(key, "holder", ttl=30) is not None
        del opened[:]
        with pytest.raises(LeaseTimeoutError):
            await Lease.objects.aacquire(key, "w", ttl=30, blocking=True, timeout=0.2)
        assert opened == ["pg_lease_django wait w"]

    run(scenario)


@needs_session  # cancels the waiter's own server session
def test_an_error_on_the_waiters_connection_leaves_the_callers_connection_untouched(
    key: str, raw_connect: Connect
) -> None:
    """The waiter's attempt waits on a row lock (the lease lapsed while another session holds its row)
    and is cancelled on the server by another session: QueryCanceled on the waiter's connection, raised
    as Django's OperationalError, psycopg's as its cause; the caller's connection is not marked."""
    holder, observer = raw_connect(), raw_connect()
    holder.execute("SELECT pg_lease_acquire(%s, 'holder', '2 s')", [key])
    blocker = raw_connect(autocommit=False)
    blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    Lease.objects.inspect(f"{key}/other")  # the caller's connection is open
    assert not connection.errors_occurred

    def waiter_pid() -> int | None:
        row = observer.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'pg_lease_django wait waiter' "
            "AND %s = ANY (pg_blocking_pids(pid))",
            [blocker.info.backend_pid],
        ).fetchone()
        return None if row is None else int(row[0])

    async def scenario() -> None:
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=HANG))
        await asyncio.to_thread(wait_until, lambda: waiter_pid() is not None, HANG, "the waiter to block on the row")
        observer.execute("SELECT pg_cancel_backend(%s)", [waiter_pid()])
        with pytest.raises(OperationalError) as raised:
            await waiter
        assert isinstance(raised.value.__cause__, psycopg.errors.QueryCanceled)

    try:
        run(scenario)
    finally:
        blocker.commit()
    assert not connection.errors_occurred, "the caller's connection was marked by the waiter's error"
    assert Lease.objects.inspect(key).owner == "holder"


def test_calls_of_free_keys_finish_beside_one_waiting_on_a_row_lock(key: str, raw_connect: Connect) -> None:
    """Eight aacquires of free keys (and the other calls) finish while another aacquire waits on a
    row lock that is kept until they have: no call waits behind an unrelated one."""
    observer = raw_connect()
    raw_connect().execute("SELECT pg_lease_acquire(%s, 'old', '1 ms')", [key])  # lapsed at once
    locker = raw_connect(autocommit=False)
    locker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])

    async def scenario() -> None:
        blocked = asyncio.create_task(Lease.objects.aacquire(key, "blocked", ttl=30))
        try:
            await asyncio.to_thread(wait_until, lambda: blocked_by(observer, locker) == 1, HANG, "the call to block")
            grants = await asyncio.wait_for(
                asyncio.gather(*(Lease.objects.aacquire(f"{key}/{i}", f"w{i}", ttl=30) for i in range(8))), HANG
            )
            assert all(grant is not None for grant in grants)
            first = grants[0]
            assert first is not None
            await asyncio.wait_for(Lease.objects.arenew(first.key, "w0", first.epoch, ttl=30), HANG)
            assert (await asyncio.wait_for(Lease.objects.ainspect(first.key), HANG)).owner == "w0"
            await asyncio.wait_for(Lease.objects.arelease(first.key, "w0", first.epoch), HANG)
            assert not blocked.done()
            assert blocked_by(observer, locker) == 1, "the row lock was kept while they ran"
        finally:
            locker.commit()  # before the test fails too: a call held up behind the blocked one then ends
        grant = await asyncio.wait_for(blocked, HANG)
        assert grant is not None and grant.owner == "blocked"

    run(scenario)
