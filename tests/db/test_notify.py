"""Release and force release notify only when a waiter registered for the key (``pg_lease_wake_waiters``).

A raw connection LISTENs on the channel. "Nothing was sent" is proven with a marker: a notification
this test sends after the release committed. Notifications are queued in commit order, so the
first one heard being the marker means the release sent none (no timeout can make that pass).
Interleavings are forced with open transactions and observed on the server, never by sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.sql
import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import override_settings

from pg_lease_django import Grant, Lease, LeaseTimeoutError
from pg_lease_django.sql import NOTIFY_CHANNEL
from tests.helpers import Background, needs_session, row_snapshot, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), needs_session]

Connect = Callable[..., psycopg.Connection[Any]]

#: A poll interval no test waits for: a prompt grant must come from a notification.
HOURS = 3600.0
#: A hang guard, not a latency bound: far beyond any stall of a loaded shared machine, far below
#: what a missed notification costs (HOURS).
HANG = 30.0
REGISTER = "SELECT granted, owner FROM pg_lease_acquire_or_register(%s, %s, '60 s', %s::interval)"


def listen(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(NOTIFY_CHANNEL)))
    return conn


def heard_until_marker(listener: psycopg.Connection[Any], sender: psycopg.Connection[Any], key: str) -> list[str]:
    """Payloads on the channel up to a marker sent now (after everything the test committed), marker excluded."""
    marker = f"marker {key}"
    sender.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, marker])
    heard: list[str] = []
    for notify in listener.notifies(timeout=10):
        if notify.payload == marker:
            return heard
        heard.append(notify.payload)
    pytest.fail(f"the marker never arrived; heard {heard}")


def hold(conn: psycopg.Connection[Any], key: str, owner: str = "holder", ttl: str = "60 s") -> int:
    row = conn.execute("SELECT granted, epoch FROM pg_lease_acquire(%s, %s, %s)", [key, owner, ttl]).fetchone()
    assert row is not None and row[0], f"{key} not granted to {owner}"
    return int(row[1])


def release(conn: psycopg.Connection[Any], key: str, epoch: int, owner: str = "holder") -> None:
    row = conn.execute("SELECT outcome FROM pg_lease_release(%s, %s, %s)", [key, owner, epoch]).fetchone()
    assert row == ("ok",)


def registrations(conn: psycopg.Connection[Any], key: str) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT until > clock_timestamp() FROM pg_lease_django_waiter WHERE key = %s", [key]).fetchall()


def blocked_on_advisory_lock(observer: psycopg.Connection[Any], pid: int) -> bool:
    row = observer.execute(
        "SELECT wait_event_type = 'Lock' AND wait_event = 'advisory' FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    return row == (True,)


# --- no waiter, no notification ----------------------------------------------------------------------


def test_release_and_force_release_without_a_waiter_send_nothing(key: str, raw_connect: Connect) -> None:
    listener, sender = listen(raw_connect()), raw_connect()
    grant = Lease.objects.acquire(key, "holder", ttl=60)
    assert grant is not None
    Lease.objects.release(key, "holder", grant.epoch)
    assert Lease.objects.acquire(key, "holder", ttl=60) is not None
    Lease.objects.force_release(key)
    assert heard_until_marker(listener, sender, key) == []


def test_a_plain_refused_attempt_does_not_register(key: str, raw_connect: Connect) -> None:
    """Only a waiter that LISTENs registers: non-blocking attempts and the polling wait do not."""
    holder, listener, sender = raw_connect(), listen(raw_connect()), raw_connect()
    epoch = hold(holder, key)
    assert Lease.objects.acquire(key, "other", ttl=30) is None
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=0.01), pytest.raises(LeaseTimeoutError):
        Lease.objects.acquire(key, "poller", ttl=30, blocking=True, timeout=0.05)
    assert registrations(holder, key) == []
    release(holder, key, epoch)
    assert heard_until_marker(listener, sender, key) == []


# --- a waiter is woken by the notification ----------------------------------------------------------


@pytest.mark.parametrize("how", ["release", "force_release"])
def test_a_blocking_waiter_is_woken_by_the_notification(key: str, raw_connect: Connect, how: str) -> None:
    holder, observer, listener, sender = raw_connect(), raw_connect(), listen(raw_connect()), raw_connect()
    epoch = hold(holder, key, ttl="1 hour")

    def wait() -> Grant:
        try:
            return Lease.objects.acquire(key, "waiter", ttl=30, blocking=True, timeout=600)
        finally:
            connection.close()

    with override_settings(PG_LEASE_POLL_INTERVAL=HOURS):
        waiter = Background(wait)
        waiter.start()
        wait_until(lambda: registrations(observer, key) == [(True,)], what="the waiter to register")
        released_at = time.monotonic()
        if how == "release":
            release(holder, key, epoch)
        else:
            assert Lease.objects.force_release(key) == epoch + 1
        got = waiter.outcome()
        lag = time.monotonic() - released_at
    assert (got.owner, got.epoch) == ("waiter", epoch + 2)
    assert lag < HANG, "woken by the notification, not by the poll interval or the holder's expiry (1 h)"
    assert heard_until_marker(listener, sender, key) == [key]
    assert registrations(observer, key) == [], "the release took the registration"


def test_an_async_waiter_is_woken_by_the_notification(key: str, raw_connect: Connect) -> None:
    holder, observer, listener, sender = raw_connect(), raw_connect(), listen(raw_connect()), raw_connect()
    epoch = hold(holder, key, ttl="1 hour")

    async def scenario() -> tuple[Grant, float]:
        waiter = asyncio.create_task(Lease.objects.aacquire(key, "waiter", ttl=30, blocking=True, timeout=600))
        deadline = time.monotonic() + 10
        while registrations(observer, key) != [(True,)]:
            assert not waiter.done(), waiter
            assert time.monotonic() < deadline, "the waiter never registered"
            await asyncio.sleep(0.005)
        released_at = time.monotonic()
        release(holder, key, epoch)
        grant = await waiter
        return grant, time.monotonic() - released_at

    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=HOURS):
        got, lag = async_to_sync(scenario)()
    assert (got.owner, got.epoch) == ("waiter", epoch + 2)
    assert lag < HANG, "woken by the notification, not by the poll interval or the holder's expiry (1 h)"
    assert heard_until_marker(listener, sender, key) == [key]


# --- the two interleavings of a registration and a release -------------------------------------------


def test_a_registration_in_flight_makes_the_release_notify(key: str, raw_connect: Connect) -> None:
    """The registrant has not committed when the release looks: the release cannot see it, so it notifies."""
    holder, listener, sender = raw_connect(), listen(raw_connect()), raw_connect()
    registrant = raw_connect(autocommit=False)
    epoch = hold(holder, key)
    assert registrant.execute(REGISTER, [key, "waiter", "1 minute"]).fetchone() == (False, "holder")
    release(holder, key, epoch)  # does not wait for the registrant
    registrant.commit()
    assert heard_until_marker(listener, sender, key) == [key]


def test_a_release_in_flight_holds_a_registering_attempt_until_it_commits(key: str, raw_connect: Connect) -> None:
    """The release looked first (nobody registered) and has not committed: the waiter's attempt waits for
    it, then finds the lease free, so no notification is needed."""
    holder, observer, waiter, listener, sender = (
        raw_connect(),
        raw_connect(),
        raw_connect(),
        listen(raw_connect()),
        raw_connect(),
    )
    epoch = hold(holder, key)
    holder.autocommit = False
    release(holder, key, epoch)  # freed, looked for waiters, not committed
    attempt = Background(lambda: waiter.execute(REGISTER, [key, "waiter", "1 minute"]).fetchone())
    attempt.start()
    wait_until(lambda: blocked_on_advisory_lock(observer, waiter.info.backend_pid), what="the attempt to wait")
    holder.commit()
    assert attempt.outcome() == (True, "waiter")
    assert heard_until_marker(listener, sender, key) == []


def test_a_registering_attempt_waits_for_a_release_in_flight_at_most_its_retry_bound(
    key: str, raw_connect: Connect
) -> None:
    """A release left open (or anyone holding the same advisory lock) delays an attempt by its bound at most."""
    holder, waiter = raw_connect(), raw_connect(autocommit=False)
    epoch = hold(holder, key)
    holder.autocommit = False
    release(holder, key, epoch)
    # Waiting on for the lock (the release never commits) would end in this statement_timeout instead.
    waiter.execute("SET statement_timeout = '60s'")
    started = time.monotonic()
    assert waiter.execute(REGISTER, [key, "waiter", "200 ms"]).fetchone() == (False, "holder")
    assert 0.2 <= time.monotonic() - started < HANG
    assert waiter.execute("SHOW lock_timeout").fetchone() == ("0",), "the caller's lock_timeout is restored"
    waiter.commit()
    holder.commit()
    assert registrations(waiter, key) == [], "registered only under the lock, which it did not get"


# --- stale registrations -----------------------------------------------------------------------------


def test_a_stale_registration_costs_at_most_one_notification(key: str, raw_connect: Connect) -> None:
    holder, listener, sender = raw_connect(), listen(raw_connect()), raw_connect()
    gone = raw_connect()
    epoch = hold(holder, key)
    assert gone.execute(REGISTER, [key, "gone", "1 minute"]).fetchone() == (False, "holder")
    gone.close()  # the waiter is gone; its registration stays until a release takes it
    release(holder, key, epoch)
    release(holder, key, hold(holder, key))  # nobody registered again: no notification
    assert heard_until_marker(listener, sender, key) == [key]


def test_an_expired_registration_sends_nothing_and_is_removed(key: str, raw_connect: Connect) -> None:
    holder, listener, sender = raw_connect(), listen(raw_connect()), raw_connect()
    epoch = hold(holder, key)
    assert raw_connect().execute(REGISTER, [key, "gone", "1 minute"]).fetchone() == (False, "holder")
    # The waiter never came back: its registration has run out (moved into the past, by the table's owner).
    holder.execute("UPDATE pg_lease_django_waiter SET until = clock_timestamp() - interval '1 s' WHERE key = %s", [key])
    release(holder, key, epoch)
    assert heard_until_marker(listener, sender, key) == []
    assert registrations(holder, key) == []


# --- what a registration costs -----------------------------------------------------------------------


def test_registering_takes_no_lock_on_the_lease_row_and_needs_no_durable_commit(key: str, raw_connect: Connect) -> None:
    holder, observer = raw_connect(), raw_connect()
    waiter = raw_connect(autocommit=False)
    hold(holder, key)
    before = row_snapshot(observer, key)
    assert waiter.execute(REGISTER, [key, "waiter", "1 minute"]).fetchone() == (False, "holder")
    assert waiter.execute("SHOW synchronous_commit").fetchone() == ("off",), "a refusal is not worth a flush"
    waiter.commit()
    assert row_snapshot(observer, key) == before, "the lease row was locked or rewritten"
    # A transaction that wrote something first keeps its durable commit.
    assert waiter.execute("SELECT granted FROM pg_lease_acquire(%s, 'waiter', '60 s')", [f"{key}/b"]).fetchone() == (
        True,
    )
    assert waiter.execute(REGISTER, [key, "waiter", "1 minute"]).fetchone() == (False, "holder")
    assert waiter.execute("SHOW synchronous_commit").fetchone() == ("on",)
    waiter.commit()
    # A grant stays durable.
    assert waiter.execute(REGISTER, [f"{key}/c", "waiter", "1 minute"]).fetchone() == (True, "waiter")
    assert waiter.execute("SHOW synchronous_commit").fetchone() == ("on",)
    waiter.commit()


@pytest.mark.parametrize("retry_within", ["-1 s", None, "1 mon", "366 days"])
def test_a_bad_retry_bound_is_invalid_input(key: str, raw_connect: Connect, retry_within: str | None) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="retry_within"):
        raw_connect().execute(REGISTER, [key, "waiter", retry_within])


def test_the_waiter_table_is_unlogged_and_closed_to_public(raw_connect: Connect) -> None:
    conn = raw_connect()
    assert conn.execute(
        "SELECT relpersistence FROM pg_class WHERE oid = 'pg_lease_django_waiter'::regclass"
    ).fetchone() == ("u",)
    for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE"):
        assert conn.execute(
            "SELECT has_table_privilege('public', 'public.pg_lease_django_waiter', %s)", [privilege]
        ).fetchone() == (False,), privilege
    for function in ("pg_lease_wake_waiters(text)", "pg_lease_waiter_lock(text)"):
        assert conn.execute(
            "SELECT has_function_privilege('public', %s, 'EXECUTE')", [f"public.{function}"]
        ).fetchone() == (False,), function


# --- the SQL-level wait ------------------------------------------------------------------------------


def test_the_sql_level_wait_neither_registers_nor_needs_a_notification(key: str, raw_connect: Connect) -> None:
    holder, waiter, observer, listener, sender = (
        raw_connect(),
        raw_connect(),
        raw_connect(),
        listen(raw_connect()),
        raw_connect(),
    )
    epoch = hold(holder, key)
    attempt = Background(
        lambda: waiter.execute(
            "SELECT granted, owner FROM pg_lease_acquire(%s, 'waiter', '60 s', '10 s')", [key]
        ).fetchone()
    )
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
    assert registrations(observer, key) == []
    release(holder, key, epoch)
    assert attempt.outcome() == (True, "waiter")
    assert heard_until_marker(listener, sender, key) == []
