"""Races: many real connections at once, and forced interleavings where the race is narrow."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from django.db import connection

from pg_lease_django import Grant, LapsedError, Lease
from tests.helpers import Background, conninfo, wait_until, wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 8


def race_acquire(key: str, ttl: float) -> list[Grant | None]:
    """CLIENTS threads, each on its own connection, acquire ``key`` at the same instant."""
    barrier = threading.Barrier(CLIENTS)
    results: list[Grant | None] = [None] * CLIENTS

    def client(i: int) -> None:
        try:
            Lease.objects.inspect("warm-up")  # connect before the barrier
            barrier.wait()
            results[i] = Lease.objects.acquire(key, f"client-{i}", ttl=ttl)
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_concurrent_first_acquire_of_a_new_key_has_one_winner(key: str) -> None:
    results = race_acquire(key, ttl=30)
    winners = [g for g in results if g is not None]
    assert len(winners) == 1
    assert winners[0].epoch == 1
    assert Lease.objects.inspect(key).owner == winners[0].owner


def test_takeover_races_over_many_rounds_keep_one_winner_and_rising_epochs(key: str) -> None:
    """Each round: a lease lapses, then 8 clients race to take it over. Full history checked."""
    history: list[Grant] = []
    for round_no in range(15):
        lapsing = Lease.objects.acquire(key, "previous", ttl=0.001)
        assert lapsing is not None
        wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
        results = race_acquire(key, ttl=30)
        winners = [g for g in results if g is not None]
        assert len(winners) == 1, f"round {round_no}: {winners}"
        assert winners[0].epoch == lapsing.epoch + 1, "no other grant may slip in between"
        assert winners[0].server_time >= lapsing.expires_at, "a takeover before the lapse"
        history.extend([lapsing, winners[0]])
        Lease.objects.release(key, winners[0].owner, winners[0].epoch)
    epochs = [g.epoch for g in history]
    assert epochs == sorted(set(epochs)), epochs
    grant_times = [g.server_time for g in history]
    assert grant_times == sorted(grant_times)


def test_renew_in_flight_beats_a_takeover_that_must_wait_for_it(key: str, raw_connect: Any) -> None:
    """The committed row looks lapsed, but an uncommitted renewal holds it: the taker waits, then loses."""
    grant = Lease.objects.acquire(key, "holder", ttl=1)
    assert grant is not None
    renewer = raw_connect(autocommit=False)
    assert renewer.execute(
        "SELECT outcome FROM pg_lease_renew(%s, 'holder', %s, '30 s')", [key, grant.epoch]
    ).fetchone() == ("ok",)
    observer = raw_connect()
    wait_until(
        lambda: observer.execute("SELECT clock_timestamp() > %s", [grant.expires_at]).fetchone() == (True,),
        what="the original expiry to pass",
    )
    taker = raw_connect()
    taker_pid = taker.info.backend_pid
    attempt = Background(
        lambda: taker.execute("SELECT granted, owner FROM pg_lease_acquire(%s, 'taker', '30 s')", [key]).fetchone()
    )
    attempt.start()
    wait_until_blocked(observer, taker_pid)
    renewer.commit()
    assert attempt.outcome() == (False, "holder")
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "holder", grant.epoch)


def test_takeover_in_flight_makes_the_late_renewal_fail_as_lapsed(key: str, raw_connect: Any) -> None:
    grant = Lease.objects.acquire(key, "holder", ttl=0.2)
    assert grant is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
    taker = raw_connect(autocommit=False)
    assert taker.execute("SELECT granted, epoch FROM pg_lease_acquire(%s, 'taker', '30 s')", [key]).fetchone() == (
        True,
        grant.epoch + 1,
    )
    with pytest.raises(LapsedError):
        Lease.objects.renew(key, "holder", grant.epoch, ttl=30)
    taker.commit()
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("taker", grant.epoch + 1)


def race_behind_uncommitted_acquire(key: str, raw_connect: Any) -> tuple[Any, Background]:
    """'first' acquires ``key`` in an open transaction; 'second' tries too and is seen blocked on it.

    Returns the first connection (to commit or roll back) and the second's attempt, whose outcome
    is ``(granted, owner, epoch)``.
    """
    first = raw_connect(autocommit=False)
    first.execute("SELECT granted FROM pg_lease_acquire(%s, 'first', '30 s')", [key])
    second = raw_connect()
    attempt = Background(
        lambda: second.execute(
            "SELECT granted, owner, epoch FROM pg_lease_acquire(%s, 'second', '30 s')", [key]
        ).fetchone()
    )
    attempt.start()
    wait_until_blocked(raw_connect(), second.info.backend_pid)
    return first, attempt


def lapsed(key: str) -> Grant:
    grant = Lease.objects.acquire(key, "holder", ttl=0.2)
    assert grant is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
    return grant


def test_two_takers_serialise_on_the_row_lock_and_the_second_sees_the_first(key: str, raw_connect: Any) -> None:
    grant = lapsed(key)
    first, attempt = race_behind_uncommitted_acquire(key, raw_connect)
    first.commit()
    assert attempt.outcome() == (False, "first", grant.epoch + 1)


def test_two_takers_when_the_first_rolls_back_the_second_wins(key: str, raw_connect: Any) -> None:
    grant = lapsed(key)
    first, attempt = race_behind_uncommitted_acquire(key, raw_connect)
    first.rollback()
    assert attempt.outcome() == (True, "second", grant.epoch + 1)


def test_concurrent_inserts_of_a_new_key_wait_for_each_other(key: str, raw_connect: Any) -> None:
    first, attempt = race_behind_uncommitted_acquire(key, raw_connect)
    first.commit()
    assert attempt.outcome() == (False, "first", 1)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_isolation_surfaces_a_serialization_failure_never_a_double_grant(
    key: str, raw_connect: Any, isolation: str
) -> None:
    """Spec 8: a caller whose snapshot predates a takeover gets 40001, not a second grant."""
    grant = Lease.objects.acquire(key, "holder", ttl=0.2)
    assert grant is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
    late = raw_connect(autocommit=False)
    late.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
    late.execute("SELECT 1 FROM pg_lease_django_lease LIMIT 1")  # take the snapshot now
    assert Lease.objects.acquire(key, "taker", ttl=30) is not None
    with pytest.raises(psycopg.errors.SerializationFailure):
        late.execute("SELECT granted FROM pg_lease_acquire(%s, 'late', '30 s')", [key])
    late.rollback()
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("taker", grant.epoch + 1)


def test_snapshot_isolation_through_django_raises_operational_error(key: str) -> None:
    from django.db import OperationalError, transaction

    grant = Lease.objects.acquire(key, "holder", ttl=0.2)
    assert grant is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
    other = psycopg.connect(conninfo(), autocommit=True)
    try:
        with pytest.raises(OperationalError) as info, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cursor.execute("SELECT 1")
            other.execute("SELECT pg_lease_acquire(%s, 'taker', '30 s')", [key])
            Lease.objects.acquire(key, "late", ttl=30)
        assert isinstance(info.value.__cause__, psycopg.errors.SerializationFailure)
    finally:
        other.close()
    assert Lease.objects.inspect(key).owner == "taker"
