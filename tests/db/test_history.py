"""A lease's history and hand-off requests, on a real server.

The database records each tenure in the statement of its transition (whoever sends it: the manager,
a raw client), one row per grant and none per renewal, for the keys ``PG_LEASE_HISTORY`` names. A
hand-off request is advice: the holder's next renewal learns it, its release is recorded as a
hand-off, and a holder that ignores it keeps its lease.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

from pg_lease_django import HeldLease, Lease, hold
from pg_lease_django.checks import check_history_scope_is_current
from pg_lease_django.exceptions import (
    AlreadyFreeError,
    AlreadyLapsedError,
    EpochMovedOnError,
    InvalidInputError,
    NeverAcquiredError,
)
from pg_lease_django.models import EndReason, LeaseTenure
from pg_lease_django.provisioning.history import recorded_prefixes, sync_scope
from pg_lease_django.signals import lease_handoff_requested
from tests.helpers import Background, held, lapsed, wait_until

# Most tests run in a transaction rolled back at their end: the epoch advance and the prune below
# raise the epoch floor, which other tests' new keys start above. Those that need other connections
# (a raw client, threads, hold()'s lease connections) commit.
pytestmark = pytest.mark.django_db
committing = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def recorded(key: str) -> Iterator[str]:
    """Record the history of ``key`` (and keys under it) for this test only."""
    with override_settings(PG_LEASE_HISTORY=[key]):
        sync_scope()
        yield key
    sync_scope()


def session_user() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT session_user")
        row = cursor.fetchone()
    assert row is not None
    return str(row[0])


def tenures(key: str) -> list[tuple[Any, ...]]:
    return list(LeaseTenure.objects.for_key(key).values_list("epoch", "owner", "end_reason", "ended_by", "ended_at"))


def test_each_transition_is_recorded_once_with_how_it_ended(recorded: str) -> None:
    key = recorded
    first = Lease.objects.acquire(key, "w1", ttl=30)
    assert first is not None
    for _ in range(3):
        Lease.objects.renew(key, "w1", first.epoch, ttl=30)  # renewals write no history
    [(epoch, owner, reason, by, ended_at)] = tenures(key)
    assert (epoch, owner, reason, by, ended_at) == (first.epoch, "w1", None, None, None)
    assert LeaseTenure.objects.get(key=key).granted_at == first.server_time

    again = Lease.objects.acquire(key, "w1", ttl=0.001)  # the same owner, a new epoch
    assert again is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="lapse")
    taken = Lease.objects.acquire(key, "w2", ttl=30)
    assert taken is not None
    Lease.objects.request_handoff(key)
    Lease.objects.release(key, "w2", taken.epoch)
    mine = Lease.objects.acquire(key, "w3", ttl=30)
    assert mine is not None
    Lease.objects.release(key, "w3", mine.epoch)
    forced = Lease.objects.acquire(key, "w4", ttl=30)
    assert forced is not None
    Lease.objects.force_release(key, operator="alice@ops")
    advanced = Lease.objects.acquire(key, "w5", ttl=30)
    assert advanced is not None
    Lease.objects.advance_epochs(by=10)

    rows = tenures(key)
    assert [(e, o, r, b) for e, o, r, b, _ in rows] == [
        (first.epoch, "w1", EndReason.REACQUIRED, "w1"),
        (again.epoch, "w1", EndReason.LAPSED, "w2"),
        (taken.epoch, "w2", EndReason.HANDED_OFF, "w2"),
        (mine.epoch, "w3", EndReason.RELEASED, "w3"),
        (forced.epoch, "w4", EndReason.FORCE_RELEASED, "alice@ops"),
        (advanced.epoch, "w5", EndReason.EPOCHS_ADVANCED, session_user()),
    ]
    # A lapse ends at the lapsed grant's expiry, not when it was taken over.
    assert rows[1][4] == again.expires_at
    assert all(ended is not None for *_, ended in rows)


def test_a_lapsed_row_pruned_ends_its_tenure_and_a_first_grant_opens_one(recorded: str) -> None:
    key = recorded
    epoch = lapsed(key, "w-old")
    Lease.objects.prune(free_for=0)
    assert Lease.objects.inspect(key).status == "free"
    [(e, owner, reason, by, _ended)] = tenures(key)
    assert (e, owner, reason, by) == (epoch, "w-old", EndReason.LAPSED, None)
    fresh = Lease.objects.acquire(key, "w-new", ttl=30)
    assert fresh is not None and fresh.epoch > epoch
    assert tenures(key)[-1][:3] == (fresh.epoch, "w-new", None)


def test_only_the_keys_of_the_setting_are_recorded(key: str) -> None:
    with override_settings(PG_LEASE_HISTORY=[f"{key}/jobs:"]):
        assert sync_scope() == (f"{key}/jobs:",)
        assert recorded_prefixes() == (f"{key}/jobs:",)
        held(f"{key}/jobs:a")
        held(f"{key}/other")
        assert LeaseTenure.objects.filter(key__startswith=key).values_list("key", flat=True).get() == f"{key}/jobs:a"
    sync_scope()
    held(f"{key}/jobs:b")
    assert not LeaseTenure.objects.filter(key=f"{key}/jobs:b").exists()


@committing
def test_a_raw_client_is_recorded_in_the_same_statement(recorded: str, raw_connect: Connect) -> None:
    """No second round trip: the tenure exists inside the acquiring transaction, and goes with its rollback."""
    key = recorded
    client = raw_connect(autocommit=False)
    acquire = "SELECT granted, epoch FROM pg_lease_acquire(%s, 'psql', '30 s')"
    row = client.execute(acquire, [key]).fetchone()
    assert row is not None
    granted, epoch = row
    assert granted
    inside = client.execute("SELECT owner, epoch FROM pg_lease_django_tenure WHERE key = %s", [key]).fetchall()
    assert inside == [("psql", epoch)]
    assert tenures(key) == []  # not committed yet: Django's connection sees nothing
    client.rollback()
    assert client.execute("SELECT count(*) FROM pg_lease_django_tenure WHERE key = %s", [key]).fetchone() == (0,)


@committing
def test_concurrent_grants_match_the_history_one_to_one(recorded: str) -> None:
    """Eight threads, each on its own connection, race for three keys: every grant is one tenure."""
    keys = [f"{recorded}/{n}" for n in range(3)]
    grants: list[tuple[str, int, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        from django.db import connection

        start.wait()
        try:
            for round_ in range(25):
                k = keys[(n + round_) % len(keys)]
                owner = f"w{n}"
                grant = Lease.objects.acquire(k, owner, ttl=30)
                if grant is not None:
                    with lock:
                        grants.append((k, grant.epoch, owner))
                    Lease.objects.release(k, owner, grant.epoch)
        finally:
            connection.close()

    threads = [Background(functools.partial(worker, n)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.outcome(60)
    recorded_rows = list(LeaseTenure.objects.filter(key__in=keys).values_list("key", "epoch", "owner", "end_reason"))
    assert len(grants) >= 25
    assert sorted((k, e, o) for k, e, o, _ in recorded_rows) == sorted(grants)
    assert {reason for *_, reason in recorded_rows} == {EndReason.RELEASED}


def test_request_handoff_refuses_when_nobody_holds(key: str) -> None:
    with pytest.raises(NeverAcquiredError):
        Lease.objects.request_handoff(key)
    epoch = held(key, "w1")
    with pytest.raises(EpochMovedOnError):
        Lease.objects.request_handoff(key, epoch=epoch + 1)
    first = Lease.objects.request_handoff(key, epoch=epoch)
    again = Lease.objects.request_handoff(key)
    assert (first.owner, first.epoch) == ("w1", epoch)
    assert again.requested_at == first.requested_at  # asking again keeps the first request
    Lease.objects.release(key, "w1", epoch)
    with pytest.raises(AlreadyFreeError):
        Lease.objects.request_handoff(key)
    lapsed(key)
    with pytest.raises(AlreadyLapsedError) as gone:
        Lease.objects.request_handoff(key)
    state = Lease.objects.inspect(key)  # the lapsed holder: the key's side of the error
    assert (gone.value.owner, gone.value.holder, gone.value.current_epoch) == (None, state.owner, state.epoch)
    with pytest.raises(InvalidInputError):
        Lease.objects.request_handoff("")
    # A new grant clears the request.
    grant = Lease.objects.acquire(key, "w2", ttl=30)
    assert grant is not None
    assert Lease.objects.get(key=key).handoff_requested_at is None


@committing
def test_a_hold_learns_of_a_handoff_at_its_next_renewal_and_may_ignore_it(key: str) -> None:
    seen: list[HeldLease] = []
    signalled: list[HeldLease] = []

    def receiver(sender: Any, lease: HeldLease, **kwargs: Any) -> None:
        signalled.append(lease)

    lease_handoff_requested.connect(receiver)
    try:
        with hold(key, ttl=3, renew_every=0.2, on_handoff=seen.append) as lease:
            assert not lease.handoff_requested
            assert lease.wait_stop(timeout=0.05) is False
            Lease.objects.request_handoff(key, epoch=lease.epoch)
            assert lease.wait_stop(timeout=5) is True
            assert lease.handoff_requested and not lease.lost
            assert seen == [lease] and signalled == [lease]
            # Ignoring it keeps the lease: renewals go on past several intervals, and nobody else gets it.
            expiry = lease.expires_at
            wait_until(lambda: lease.expires_at > expiry + timedelta(seconds=0.5), what="later renewals")
            assert Lease.objects.acquire(key, "other", ttl=30) is None
            lease.check()
    finally:
        lease_handoff_requested.disconnect(receiver)
    assert Lease.objects.inspect(key).status == "free"


@committing
def test_handoff_hands_over_well_within_a_ttl(recorded: str) -> None:
    """A holder that steps down on request lets a blocked waiter in after about one renew interval."""
    key = recorded
    ttl = 6.0
    waiter = Background(lambda: Lease.objects.acquire(key, "next", ttl=30, blocking=True, timeout=ttl))
    with hold(key, ttl=ttl, owner="leader") as lease:
        waiter.start()
        wait_until(lambda: Lease.objects.filter(key=key).exists(), what="the lease row")
        Lease.objects.request_handoff(key)
        assert lease.wait_stop(timeout=ttl)
        assert lease.handoff_requested
    grant = waiter.outcome(ttl)
    assert grant is not None and grant.owner == "next"
    [(_, _, reason, _, ended_at), (_, owner, _, _, _)] = tenures(key)
    assert (reason, owner) == (EndReason.HANDED_OFF, "next")
    handed = LeaseTenure.objects.get(key=key, owner="next").granted_at - ended_at
    assert handed < timedelta(seconds=ttl / 2), handed


def test_prune_history_keeps_running_tenures(recorded: str) -> None:
    key = recorded
    done = held(f"{key}/done", "w1")
    Lease.objects.release(f"{key}/done", "w1", done)
    held(f"{key}/running", "w2")
    mine = LeaseTenure.objects.filter(key__startswith=key)
    assert mine.prune(older_than=3600) == 0
    assert mine.prune(older_than=0, dry_run=True) == 1
    assert mine.prune(older_than=0) == 1
    assert list(mine.values_list("owner", flat=True)) == ["w2"]
    with pytest.raises(InvalidInputError):
        mine.prune(older_than=-1)


@committing
def test_settings_are_checked_and_a_stale_copy_is_reported(key: str) -> None:
    for bad in ("jobs:", [1], ["x" * 256], None):
        with override_settings(PG_LEASE_HISTORY=bad), pytest.raises(ImproperlyConfigured):
            sync_scope()
    with override_settings(PG_LEASE_HISTORY_RETENTION=0), pytest.raises(ImproperlyConfigured):
        LeaseTenure.objects.prune()
    assert check_history_scope_is_current(databases=["default"]) == []
    with override_settings(PG_LEASE_HISTORY=[key]):
        [warning] = check_history_scope_is_current(databases=["default"])
        assert warning.id == "pg_lease_django.W005"
        call_command("migrate", "pg_lease_django", verbosity=0)  # migrate copies the setting
        assert check_history_scope_is_current(databases=["default"]) == []
    sync_scope()


@committing
def test_renew_keeps_its_three_columns_and_force_release_by_operator_is_for_operators(raw_connect: Connect) -> None:
    """``pg_lease_renew`` is ``pg_lease_heartbeat`` without the hand-off column (SQL clients, and the
    previous version during a rolling deploy); the three-argument force release is revoked from PUBLIC
    like the two-argument one."""
    conn = raw_connect()
    row = conn.execute("SELECT * FROM pg_lease_renew('never-acquired', 'w', 1, '30 s')").fetchone()
    assert row is not None and row[:2] == ("not_owner", None) and len(row) == 3
    for function in ("pg_lease_force_release(text,bigint)", "pg_lease_force_release(text,bigint,text)"):
        assert conn.execute("SELECT has_function_privilege('pg_monitor', %s, 'EXECUTE')", [function]).fetchone() == (
            False,
        )


def test_a_lapsed_tenure_ends_at_its_expiry_whatever_clears_it(recorded: str) -> None:
    """A force release or an epoch advance of a lease that had already lapsed records the lapse, at its
    expiry, not the later clearing (the force release adds its operator)."""
    forced, advanced = f"{recorded}/forced", f"{recorded}/advanced"
    for key in (forced, advanced):
        lapsed(key, "w-old")
    Lease.objects.force_release(forced, operator="alice@ops")
    Lease.objects.advance_epochs(by=3)
    rows = {row.key: row for row in LeaseTenure.objects.filter(key__in=[forced, advanced])}
    for key, by in ((forced, "alice@ops"), (advanced, None)):
        row = rows[key]
        expired = Lease.objects.get(key=key).released_at if key == forced else None
        assert (row.end_reason, row.ended_by) == (EndReason.LAPSED, by), (key, row.end_reason, row.ended_by)
        assert row.ended_at is not None and (expired is None or row.ended_at < expired)
        assert row.ended_at <= row.granted_at + timedelta(seconds=1)  # its 1 ms TTL, not the clearing


def test_a_setting_a_caller_controls_cannot_make_a_release_look_forced(recorded: str) -> None:
    """Only pg_lease_force_release labels a tenure force-released: a session setting of the caller's
    (the 0009 draft read one) changes nothing."""
    from django.db import connection

    key = recorded
    epoch = held(key, "alice")
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('pg_lease.force_released_by', 'ops-admin', true)")
    Lease.objects.release(key, "alice", epoch)
    [(_, owner, reason, by, _)] = tenures(key)
    assert (owner, reason, by) == ("alice", EndReason.RELEASED, "alice")
