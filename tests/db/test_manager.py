"""The four operations through Lease.objects, on a real server."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from pg_lease_django import (
    EpochMismatchError,
    Grant,
    InvalidInputError,
    LapsedError,
    Lease,
    LeaseLostError,
    LeaseState,
    NotOwnerError,
)
from tests.helpers import row_snapshot, wait_until

pytestmark = pytest.mark.django_db


def wait_lapsed(key: str) -> None:
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")


def test_first_grant_is_epoch_1_with_server_expiry(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert isinstance(grant, Grant)
    assert (grant.key, grant.owner, grant.epoch) == (key, "w1", 1)
    assert grant.expires_at - grant.server_time == timedelta(seconds=30)


def test_ttl_accepts_timedelta_and_float(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=timedelta(milliseconds=2500))
    assert grant is not None
    assert grant.expires_at - grant.server_time == timedelta(seconds=2.5)
    expires_at = Lease.objects.renew(key, "w1", grant.epoch, ttl=0.75)
    assert expires_at - Lease.objects.inspect(key).server_time <= timedelta(seconds=0.75)


def test_held_key_is_not_acquirable_by_another_owner(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert Lease.objects.acquire(key, "w2", ttl=30) is None
    state = Lease.objects.inspect(key)
    assert state == LeaseState(key, "held", "w1", 1, grant.expires_at, state.server_time)  # type: ignore[union-attr]
    assert state.held


def test_renew_extends_without_changing_epoch(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=10)
    assert grant is not None
    new_expiry = Lease.objects.renew(key, "w1", grant.epoch, ttl=60)
    assert new_expiry > grant.expires_at
    state = Lease.objects.inspect(key)
    assert (state.epoch, state.expires_at, state.owner) == (1, new_expiry, "w1")


def test_release_frees_and_bumps_epoch_then_reacquire_bumps_again(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    Lease.objects.release(key, "w1", grant.epoch)
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch, state.expires_at) == ("free", None, 2, None)
    assert not state.held
    regrant = Lease.objects.acquire(key, "w2", ttl=30)
    assert regrant is not None and regrant.epoch == 3


def test_unknown_key_inspects_as_free_epoch_0(key: str) -> None:
    state = Lease.objects.inspect(key)
    assert (state.key, state.status, state.owner, state.epoch, state.expires_at) == (key, "free", None, 0, None)


def test_same_owner_reacquire_is_a_self_takeover_with_new_epoch(key: str) -> None:
    first = Lease.objects.acquire(key, "w1", ttl=30)
    second = Lease.objects.acquire(key, "w1", ttl=30)
    assert first is not None and second is not None
    assert second.epoch == first.epoch + 1
    with pytest.raises(EpochMismatchError):
        Lease.objects.renew(key, "w1", first.epoch, ttl=30)
    with pytest.raises(EpochMismatchError):
        Lease.objects.release(key, "w1", first.epoch)
    Lease.objects.release(key, "w1", second.epoch)


def test_lapsed_lease_is_taken_over_with_higher_epoch(key: str) -> None:
    old = Lease.objects.acquire(key, "w1", ttl=0.001)
    assert old is not None
    wait_lapsed(key)
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("lapsed", "w1", old.epoch)
    new = Lease.objects.acquire(key, "w2", ttl=30)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(NotOwnerError):
        Lease.objects.renew(key, "w1", old.epoch, ttl=30)


def test_renew_after_lapse_fails_as_lapsed_and_must_reacquire(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=0.001)
    assert grant is not None
    wait_lapsed(key)
    with pytest.raises(LapsedError) as info:
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
    assert (info.value.code, info.value.key, info.value.owner, info.value.epoch) == ("lapsed", key, "w1", grant.epoch)
    again = Lease.objects.acquire(key, "w1", ttl=30)
    assert again is not None and again.epoch == grant.epoch + 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", ["renew", "release"])
def test_failure_precedence_holder_then_lapse_then_epoch(key: str, operation: str, raw_connect) -> None:  # type: ignore[no-untyped-def]
    """Spec 7: not_owner before lapsed before epoch_mismatch; a failure changes nothing."""
    conn = raw_connect()

    def attempt(owner: str, epoch: int) -> type[LeaseLostError]:
        before = row_snapshot(conn, key)
        with pytest.raises(LeaseLostError) as info:
            if operation == "renew":
                Lease.objects.renew(key, owner, epoch, ttl=30)
            else:
                Lease.objects.release(key, owner, epoch)
        assert row_snapshot(conn, key) == before, "a failed call must not write or lock the row"
        return type(info.value)

    assert attempt("w1", 1) is NotOwnerError  # unknown key
    assert row_snapshot(conn, key) is None
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    assert row_snapshot(conn, key) is not None
    assert attempt("w2", grant.epoch) is NotOwnerError  # held by another
    assert attempt("w2", grant.epoch + 5) is NotOwnerError  # other owner wins over stale epoch
    assert attempt("w1", grant.epoch + 1) is EpochMismatchError  # live, wrong epoch
    Lease.objects.release(key, "w1", grant.epoch)
    assert attempt("w1", grant.epoch + 1) is NotOwnerError  # free key
    lapsing = Lease.objects.acquire(key, "w1", ttl=0.001)
    assert lapsing is not None
    wait_lapsed(key)
    assert attempt("w1", lapsing.epoch) is LapsedError
    assert attempt("w1", lapsing.epoch + 7) is LapsedError  # lapse wins over epoch
    assert attempt("w2", lapsing.epoch) is NotOwnerError  # holder check first


def test_each_operation_is_one_statement(key: str, django_assert_num_queries) -> None:  # type: ignore[no-untyped-def]
    with django_assert_num_queries(1):
        grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    with django_assert_num_queries(1):
        Lease.objects.acquire(key, "w2", ttl=30)
    with django_assert_num_queries(1):
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
    with django_assert_num_queries(1):
        Lease.objects.inspect(key)
    with django_assert_num_queries(1):
        Lease.objects.release(key, "w1", grant.epoch)
    with django_assert_num_queries(1), pytest.raises(NotOwnerError):
        Lease.objects.release(key, "w1", grant.epoch)


def test_server_clock_decides_inside_a_long_transaction(key: str) -> None:
    """now() is frozen at transaction start; the operations must read clock_timestamp()."""
    old = Lease.objects.acquire(key, "w1", ttl=1)
    assert old is not None
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            (tx_start,) = cursor.fetchone()
        time.sleep(2)  # the point of the test: real time passes inside one transaction
        grant = Lease.objects.acquire(key, "w2", ttl=30)
        assert grant is not None, "the lease lapsed during the transaction, so it must be acquirable"
        assert grant.server_time - tx_start >= timedelta(seconds=1.9)
        assert grant.expires_at == grant.server_time + timedelta(seconds=30)
        renewed = Lease.objects.renew(key, "w2", grant.epoch, ttl=30)
        assert renewed > grant.expires_at


def test_inside_atomic_the_change_rolls_back_with_the_caller(key: str) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        assert Lease.objects.acquire(key, "w1", ttl=30) is not None
        raise Boom
    assert Lease.objects.inspect(key).status == "free"
    assert Lease.objects.inspect(key).epoch == 0
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None and grant.epoch == 1


def test_a_failed_renew_inside_atomic_leaves_the_transaction_usable(key: str) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    with transaction.atomic():
        with pytest.raises(NotOwnerError):
            Lease.objects.renew(key, "intruder", grant.epoch, ttl=30)
        assert Lease.objects.renew(key, "w1", grant.epoch, ttl=60) > grant.expires_at


def test_grants_are_durable_even_when_synchronous_commit_is_off(key: str) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL synchronous_commit = off")
        assert Lease.objects.acquire(key, "w1", ttl=30) is not None
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == ("on",)


@pytest.mark.django_db(transaction=True)
def test_keys_and_owners_round_trip_verbatim(raw_connect) -> None:  # type: ignore[no-untyped-def]
    conn = raw_connect()
    for name in [
        "it's",
        "'; DROP TABLE pg_lease_django_lease; --",
        "back\\slash",
        "🔒 lease",
        "עברית RTL",
        "%s %(x)s",
    ]:
        grant = Lease.objects.acquire(name, name, ttl=30)
        assert grant is not None and (grant.key, grant.owner) == (name, name)
        assert Lease.objects.inspect(name).owner == name
        assert conn.execute("SELECT owner FROM pg_lease_django_lease WHERE key = %s", [name]).fetchone() == (name,)
        Lease.objects.release(name, name, grant.epoch)
    assert conn.execute("SELECT to_regclass('pg_lease_django_lease') IS NOT NULL").fetchone() == (True,)
    # Any non-empty text without NUL, as the spec says (issue 52): characters a terminal obeys are
    # escaped where a person reads them (tests/db/test_terminal_escapes.py), not refused.
    for name in ("\u202eRTL\u202c", "line\r\nbreak", "esc\x1b[2J", "soft\xadhyphen"):
        grant = Lease.objects.acquire(name, name, ttl=30)
        assert grant is not None and (grant.key, grant.owner) == (name, name)
        Lease.objects.release(grant.key, name, grant.epoch)
    with pytest.raises(InvalidInputError, match="NUL"):
        Lease.objects.acquire("nul\x00", "w1", ttl=30)


@pytest.mark.django_db(databases=["default", "other"])
def test_db_manager_uses_the_named_database(key: str) -> None:
    grant = Lease.objects.db_manager("other").acquire(key, "w1", ttl=30)
    assert grant is not None
    assert Lease.objects.inspect(key).status == "free"
    assert Lease.objects.db_manager("other").inspect(key).owner == "w1"
    assert Lease.objects.acquire(key, "w2", ttl=30) is not None  # independent namespace per database
