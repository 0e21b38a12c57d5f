"""A renewal or a release is judged on the clock read once it holds the row lock (``pg_lease_guard_update``).

Renew and release are one ``UPDATE … WHERE … AND expires_at > clock_timestamp()``. PostgreSQL
evaluates that WHERE before it locks the row; when the row changed meanwhile, READ COMMITTED judges
it again on the new version (under the lock, on a new clock read). When the row was only *locked*
meanwhile (a ``SELECT … FOR UPDATE``, a force release that found nothing to do, psql), nothing is
judged again: the lease can lapse while the call waits. These tests force that interleaving: the
call has read the row and waits on a lock-only locker; the lease lapses; the locker commits. The
call must refuse (``lapsed``) and change nothing, as the two-statement functions of 0009 did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pg_lease_django import Lease
from pg_lease_django.exceptions import LapsedError
from tests.helpers import Background, held, needs_session, row_snapshot, wait_until, wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]

CALLS = {
    "renew": "SELECT outcome FROM pg_lease_renew(%s, %s, %s, '30 seconds')",
    "heartbeat": "SELECT outcome FROM pg_lease_heartbeat(%s, %s, %s, '30 seconds')",
    "release": "SELECT outcome FROM pg_lease_release(%s, %s, %s)",
}


def _lapsed_at_server(conn: psycopg.Connection[Any], key: str) -> bool:
    row = conn.execute("SELECT expires_at <= clock_timestamp() FROM pg_lease_django_lease WHERE key = %s", [key])
    return bool(row.fetchone()[0])  # type: ignore[index]


def _call_behind_a_lock(
    raw_connect: Connect, key: str, epoch: int, call: str, lock: str, lapse: bool
) -> tuple[str, tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """Lock the row with ``lock`` in another transaction, start ``call`` so that it waits on it, let
    the lease lapse (or not), commit the locker; the call's outcome and the row before and after."""
    locker, caller, observer = raw_connect(autocommit=False), raw_connect(), raw_connect()
    caller_pid = caller.info.backend_pid
    locker.execute(lock, [key])
    before = row_snapshot(observer, key)
    waiting = Background(lambda: caller.execute(CALLS[call], [key, "w1", epoch]).fetchone()[0])  # type: ignore[index]
    waiting.start()
    wait_until_blocked(observer, caller_pid)
    if lapse:
        wait_until(lambda: _lapsed_at_server(observer, key), what=f"{key} to lapse while the call waits")
    else:
        assert not _lapsed_at_server(observer, key)
    locker.commit()
    outcome = waiting.outcome()
    return outcome, before, row_snapshot(observer, key)


# Lockers that lock the row without changing it (no re-check by PostgreSQL), and one that changes it.
LOCK_ONLY = [
    "SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE",
    "SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR NO KEY UPDATE",
]
CHANGES_IT = "SELECT outcome FROM pg_lease_request_handoff(%s, NULL)"


@pytest.mark.parametrize("lock", LOCK_ONLY, ids=["for-update", "for-no-key-update"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_that_waited_past_the_expiry_on_a_lock_only_locker_is_refused(
    raw_connect: Connect, key: str, call: str, lock: str
) -> None:
    epoch = held(key, "w1", ttl=0.5)
    outcome, before, after = _call_behind_a_lock(raw_connect, key, epoch, call, lock, lapse=True)
    assert outcome == "lapsed"
    assert after is not None and before is not None
    assert after[0] == before[0], "a refused call changed the row"
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("lapsed", "w1", epoch)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_that_waited_past_the_expiry_on_a_change_is_refused(raw_connect: Connect, key: str, call: str) -> None:
    epoch = held(key, "w1", ttl=0.5)
    outcome, _before, _after = _call_behind_a_lock(raw_connect, key, epoch, call, CHANGES_IT, lapse=True)
    assert outcome == "lapsed"
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("lapsed", "w1", epoch)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_that_waited_within_the_lease_goes_through(raw_connect: Connect, key: str, call: str) -> None:
    """The control: the same interleaving without the lapse succeeds, so the tests above can fail."""
    epoch = held(key, "w1", ttl=30)
    outcome, _before, _after = _call_behind_a_lock(raw_connect, key, epoch, call, LOCK_ONLY[0], lapse=False)
    assert outcome == "ok"
    state = Lease.objects.inspect(key)
    if call == "release":
        assert (state.status, state.epoch) == ("free", epoch + 1)
    else:
        assert (state.status, state.epoch) == ("held", epoch)


@needs_session  # finds the renewing backend by its pid, which PgBouncer does not show
def test_the_manager_names_the_lapse_of_a_renewal_that_waited(raw_connect: Connect, key: str) -> None:
    epoch = held(key, "w1", ttl=0.5)
    locker, observer = raw_connect(autocommit=False), raw_connect()
    locker.execute(LOCK_ONLY[0], [key])

    def renew() -> Any:
        from django.db import connection

        pid = connection.cursor().connection.info.backend_pid
        pids.append(pid)
        try:
            return Lease.objects.renew(key, "w1", epoch, ttl=30)
        finally:
            connection.close()

    pids: list[int] = []
    waiting = Background(renew)
    waiting.start()
    wait_until(lambda: bool(pids), what="the renewing thread's backend")
    wait_until_blocked(observer, pids[0])
    wait_until(lambda: _lapsed_at_server(observer, key), what=f"{key} to lapse while the renewal waits")
    locker.commit()
    with pytest.raises(LapsedError):
        waiting.outcome()


def test_a_plain_update_cannot_extend_a_lapsed_lease(raw_connect: Connect, key: str) -> None:
    """Whoever sends it: extending a lapsed lease would bring back an epoch fences already refused."""
    epoch = held(key, "w1", ttl=0.001)
    conn = raw_connect()
    wait_until(lambda: _lapsed_at_server(conn, key), what=f"{key} to lapse")
    before = row_snapshot(conn, key)
    updated = conn.execute(
        "UPDATE pg_lease_django_lease SET expires_at = clock_timestamp() + interval '1 hour' WHERE key = %s", [key]
    ).rowcount
    assert updated == 0
    after = row_snapshot(conn, key)
    assert after is not None and before is not None and after[0] == before[0]
    assert Lease.objects.inspect(key).status == "lapsed"
    # A held lease can still be extended by hand (an operator's emergency extension): same epoch.
    epoch = held(key, "w2", ttl=30)
    assert (
        conn.execute(
            "UPDATE pg_lease_django_lease SET expires_at = expires_at + interval '1 hour' WHERE key = %s", [key]
        ).rowcount
        == 1
    )
    assert Lease.objects.inspect(key).epoch == epoch


GRANT = (
    "SELECT granted, epoch, expires_at, server_time, expires_at - server_time "
    "FROM pg_lease_acquire(%s, %s, '0.3 seconds')"
)


def _granted_at(conn: psycopg.Connection[Any], key: str) -> Any:
    return conn.execute("SELECT acquired_at FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()[0]  # type: ignore[index]


@pytest.mark.parametrize("before", ["new", "released", "lapsed", "held-by-me"])
def test_a_grant_is_one_clock_read(raw_connect: Connect, key: str, before: str) -> None:
    """expiry = server_now + TTL, and the server time returned is the grant time the row keeps: the
    stress checker takes a grant whose times differ for another grant of the same epoch."""
    conn = raw_connect()
    if before == "released":
        Lease.objects.release(key, "w1", held(key, "w1"))
    elif before == "lapsed":
        held(key, "w1", ttl=0.001)
        wait_until(lambda: _lapsed_at_server(conn, key), what=f"{key} to lapse")
    elif before == "held-by-me":
        held(key, "w2")
    # Two clock reads a microsecond apart can agree: a hundred grants (the last ones re-grants to w2).
    for _ in range(100):
        granted, _epoch, _expires_at, server_time, ttl = conn.execute(GRANT, [key, "w2"]).fetchone()  # type: ignore[misc]
        assert granted
        assert (server_time, ttl.total_seconds()) == (_granted_at(conn, key), 0.3)


def test_an_acquire_that_waited_on_a_lock_only_locker_is_stamped_after_the_wait(raw_connect: Connect, key: str) -> None:
    """The lapsed holder's fenced transaction (FOR KEY SHARE) still runs: the new grant starts when it
    has ended, not when the acquire first read the row (0008 read the clock after its SELECT … FOR
    UPDATE; the one UPDATE's SET is computed before it waits, so the trigger stamps the grant)."""
    held(key, "w1", ttl=0.001)
    fenced, caller, observer = raw_connect(autocommit=False), raw_connect(), raw_connect()
    fenced.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR KEY SHARE", [key])
    wait_until(lambda: _lapsed_at_server(observer, key), what=f"{key} to lapse")
    waiting = Background(lambda: caller.execute(GRANT, [key, "w2"]).fetchone())
    waiting.start()
    wait_until_blocked(observer, caller.info.backend_pid)
    ended_at = fenced.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    fenced.commit()
    granted, _epoch, _expires_at, server_time, ttl = waiting.outcome()
    assert granted
    assert server_time > ended_at, "the grant is stamped with a clock read before it waited"
    assert (server_time, ttl.total_seconds()) == (_granted_at(observer, key), 0.3)
