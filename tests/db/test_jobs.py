"""hold(), @leased and the heartbeat on a real server, with real processes where it matters.

Every test here is transactional: the hold acquires and renews on a connection of its own, which
sees only what is committed. Nothing sleeps in place of synchronisation: tests poll for a state
(a renewal, a new backend, a lapse) or read a worker's reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, assert_type

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import override_settings

from devkit.dbserver import REPO
from devkit.testapp.models import Entry, Invoice, Report
from pg_lease_django import (
    EpochMismatchError,
    HeartbeatFailedError,
    HeldLease,
    Holding,
    InvalidInputError,
    LapsedError,
    Lease,
    LeaseLostError,
    LeaseTimeoutError,
    NotAcquirableError,
    NotOwnerError,
    UnfencedWriteError,
    current_lease,
    hold,
    lease_acquired,
    lease_lost,
    lease_released,
    lease_skipped,
    leased,
    unfenced_writes,
)
from pg_lease_django.holds import lease_connection, lease_pool, scheduler
from pg_lease_django.holds.lease import Tenure
from pg_lease_django.management.exit_codes import ExitCode
from tests.helpers import needs_session, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]
#: A hang guard, not a latency bound: far beyond any stall of a loaded shared machine.
HANG = 30.0


# ---- helpers ---------------------------------------------------------------------------------


def steal(conn: psycopg.Connection[Any], key: str, owner: str, ttl: float = 30) -> int:
    """Another client acquires ``key`` as ``owner``: a self-takeover when ``owner`` is the holder's."""
    row = conn.execute("SELECT granted, epoch FROM pg_lease_acquire(%s, %s, %s)", [key, owner, timedelta(seconds=ttl)])
    granted, epoch = row.fetchone()  # type: ignore[misc]
    assert granted
    return int(epoch)


def server_clock() -> datetime:
    """The server's clock_timestamp(), read on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]  # type: ignore[no-any-return]


def heartbeat_pids(conn: psycopg.Connection[Any]) -> list[int]:
    """The lease connections of ``hold()`` (the pool of this process: tests run one process at a time)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
        [lease_connection.APPLICATION_NAME],
    )
    return [int(pid) for (pid,) in rows.fetchall()]


def backends(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


class Recorder:
    """Collects lease signals as (name, key, extra) while connected."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []

    def acquired(self, sender: Any, lease: HeldLease, **kwargs: Any) -> None:
        self.events.append(("acquired", lease.key, lease.epoch))

    def released(self, sender: Any, lease: HeldLease, freed: bool, **kwargs: Any) -> None:
        self.events.append(("released", lease.key, freed))

    def lost(self, sender: Any, lease: HeldLease, error: LeaseLostError, **kwargs: Any) -> None:
        self.events.append(("lost", lease.key, type(error)))

    def of(self, key: str) -> list[tuple[str, Any]]:
        return [(name, extra) for name, k, extra in self.events if k == key]


@pytest.fixture
def other_key(key: str) -> str:
    """A second key for the same test."""
    return f"{key}:other"


@pytest.fixture
def signals() -> Iterator[Recorder]:
    recorder = Recorder()
    lease_acquired.connect(recorder.acquired)
    lease_released.connect(recorder.released)
    lease_lost.connect(recorder.lost)
    yield recorder
    lease_acquired.disconnect(recorder.acquired)
    lease_released.disconnect(recorder.released)
    lease_lost.disconnect(recorder.lost)


# ---- the basic contract ----------------------------------------------------------------------


def test_hold_renews_in_the_background_and_releases_its_own_epoch_on_exit(key: str, signals: Recorder) -> None:
    with hold(key, ttl=1, renew_every=0.1) as lease:
        state = Lease.objects.inspect(key)
        assert (state.status, state.owner, state.epoch) == ("held", lease.owner, lease.epoch)
        first_expiry = lease.expires_at
        wait_until(lambda: lease.expires_at > first_expiry, what="a renewal")
        assert Lease.objects.inspect(key).expires_at == lease.expires_at
        assert lease.epoch == state.epoch  # renewals keep the epoch
        lease.check()
        assert not lease.lost and lease.error is None
        assert 0 < lease.trust_remaining <= 0.9
        assert current_lease() is lease and current_lease(key) is lease
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", lease.epoch + 1)
    assert current_lease() is None
    assert not lease.lost
    with pytest.raises(NotOwnerError, match="has ended"):
        lease.check()
    assert signals.of(key) == [("acquired", lease.epoch), ("released", True)]


def test_default_owner_is_host_pid_and_a_random_suffix_unique_per_hold(key: str, other_key: str) -> None:
    with hold(key, ttl=5) as a, hold(other_key, ttl=5) as b:
        host, pid, suffix = a.owner.split(":")
        assert pid == str(os.getpid()) and len(suffix) == 8 and host
        assert a.owner != b.owner
    with hold(key, ttl=5, owner="billing-worker-1") as lease:
        assert Lease.objects.inspect(key).owner == lease.owner == "billing-worker-1"


def test_job_exception_releases_and_propagates(key: str, signals: Recorder) -> None:
    with pytest.raises(ZeroDivisionError), hold(key, ttl=5) as lease:
        _ = 1 / 0
    assert Lease.objects.inspect(key).status == "free"
    assert signals.of(key) == [("acquired", lease.epoch), ("released", True)]


def test_busy_key_raises_not_acquirable_and_leaves_the_holder_alone(key: str) -> None:
    other = Lease.objects.acquire(key, "someone-else", ttl=30)
    assert other is not None
    with pytest.raises(NotAcquirableError) as caught, hold(key, ttl=5):
        pytest.fail("entered a busy hold")
    assert caught.value.key == key and caught.value.code == "not_acquirable"
    # It names the holder (owner stays the caller, as for every error).
    error = caught.value
    assert (error.holder, error.current_epoch, error.expires_at) == ("someone-else", other.epoch, other.expires_at)
    assert error.owner != "someone-else" and "'someone-else' at epoch" in str(error)
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("someone-else", other.epoch)


def test_blocking_hold_waits_and_trusts_from_the_attempt_that_succeeded(key: str) -> None:
    before_grant = time.monotonic()
    other = Lease.objects.acquire(key, "short-lived", ttl=0.6)
    assert other is not None
    # The other lease lapses at this monotonic time or later: its server_time was read after before_grant.
    lapses_at = before_grant + (other.expires_at - other.server_time).total_seconds()
    with pytest.raises(LeaseTimeoutError):
        hold(key, ttl=3, blocking=True, timeout=0.05).__enter__()
    started = time.monotonic()
    # Polls far apart: the waiter's next attempt is at the other's expiry, sent no sooner than lapses_at.
    with override_settings(PG_LEASE_POLL_INTERVAL=120), hold(key, ttl=3, blocking=True, timeout=10) as lease:
        waited = time.monotonic() - started
        assert waited >= 0.3  # it did wait for the lapse...
        assert lease.epoch == other.epoch + 1
        # ...but the trust window (0.9 x TTL) starts at the attempt that succeeded, sent at lapses_at or
        # later, not at the start of the wait. Monotonic arithmetic only: a stall cannot fail it.
        remaining = lease.trust_remaining
        trusted_until = time.monotonic() + remaining  # an upper bound of the window's end, if still trusted
        assert remaining > 0 and trusted_until >= lapses_at + 3 * 0.9 - 0.02, (trusted_until - lapses_at, remaining)


def test_hold_is_also_a_decorator_making_a_fresh_hold_per_call(key: str) -> None:
    @hold(key, ttl=5)
    def job(x: int) -> tuple[int, str]:
        lease = current_lease()
        assert lease is not None
        return x * 2, lease.owner

    first, second = job(1), job(2)
    assert first[0] == 2 and second[0] == 4 and first[1] != second[1]
    assert Lease.objects.inspect(key).status == "free"

    holding = hold(key, ttl=5)
    assert isinstance(holding, Holding)
    with holding, pytest.raises(RuntimeError, match="already active"), holding:
        pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": 5, "timeout": 1}, "timeout only applies"),
        ({"ttl": 5, "owner": ""}, "owner"),
        ({"ttl": 5, "renew_every": -1}, "renew_every"),
        ({"ttl": 5, "hold_at_least": -1}, "hold_at_least"),
        ({"ttl": 5, "on_lost": 3}, "on_lost"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        hold("k", **kwargs)


def test_renew_interval_must_fit_in_the_trust_window(key: str) -> None:
    with pytest.raises(InvalidInputError, match="trust window"), hold(key, ttl=1, renew_every=0.95):
        pass
    assert Lease.objects.inspect(key).status == "free"  # refused before acquiring


def test_safety_margin_setting_shortens_the_trust_window(key: str) -> None:
    with override_settings(PG_LEASE_SAFETY_MARGIN=0.5), hold(key, ttl=4) as lease:
        assert 1.5 < lease.trust_remaining <= 2.0
    with override_settings(PG_LEASE_SAFETY_MARGIN=1), pytest.raises(ImproperlyConfigured), hold(key, ttl=4):
        pass


# ---- @leased ---------------------------------------------------------------------------------


def test_leased_skips_or_raises_when_busy(key: str, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    @leased(key, ttl=5)
    def skipping() -> str:
        calls.append("skip")
        return "ran"

    @leased(key, ttl=5, on_busy="raise")
    def raising() -> str:
        calls.append("raise")
        return "ran"

    assert skipping() == "ran" and raising() == "ran"
    other = Lease.objects.acquire(key, "elsewhere", ttl=30)
    assert other is not None
    skips: list[dict[str, Any]] = []

    def on_skip(sender: Any, **kwargs: Any) -> None:
        skips.append({"sender": sender, **kwargs})

    lease_skipped.connect(on_skip)
    try:
        with caplog.at_level(logging.WARNING, logger="pg_lease_django.jobs"):
            assert skipping() is None
    finally:
        lease_skipped.disconnect(on_skip)
    with pytest.raises(NotAcquirableError):
        raising()
    assert calls == ["skip", "raise"]
    assert Lease.objects.inspect(key).owner == "elsewhere"
    [skip] = skips
    assert skip["sender"] is skipping.__wrapped__ and skip["key"] == key  # type: ignore[attr-defined]
    assert isinstance(skip["error"], NotAcquirableError)
    assert [r.levelno for r in caplog.records if "skipped" in r.getMessage()] == [logging.WARNING]


def test_leased_on_busy_exit_ends_the_process_with_leases_runs_busy_status(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_busy="exit"``: a skip raises ``SystemExit`` with ``leases run``'s status for the same outcome
    (75 busy, 77 timed out), after the same warning and `lease_skipped`; a call that runs returns its result."""
    calls: list[int] = []

    @leased(key, ttl=5, on_busy="exit")
    def job(n: int) -> int:
        calls.append(n)
        return n * 2

    @leased(key, ttl=5, blocking=True, timeout=0.2, on_busy="exit")
    def waiting_job() -> str:
        return "ran"

    assert_type(job(1), int)  # no None: a skipped call does not return
    assert job(21) == 42
    assert Lease.objects.acquire(key, "elsewhere", ttl=30) is not None
    skips: list[dict[str, Any]] = []

    def on_skip(sender: Any, **kwargs: Any) -> None:
        skips.append({"sender": sender, **kwargs})

    lease_skipped.connect(on_skip)
    try:
        with caplog.at_level(logging.WARNING, logger="pg_lease_django.jobs"), pytest.raises(SystemExit) as busy:
            job(3)
        with pytest.raises(SystemExit) as timed_out:
            waiting_job()
    finally:
        lease_skipped.disconnect(on_skip)
    assert (busy.value.code, timed_out.value.code) == (ExitCode.BUSY, ExitCode.TIMED_OUT) == (75, 77)
    assert calls == [1, 21]
    assert [type(skip["error"]) for skip in skips] == [NotAcquirableError, LeaseTimeoutError]
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING] * 2
    assert [r.getMessage().rsplit("; ", 1)[1] for r in warnings] == ["exiting with status 75", "exiting with status 77"]
    assert Lease.objects.inspect(key).owner == "elsewhere"


@pytest.mark.parametrize("form", ["command", "main"])
def test_a_skipped_job_process_exits_75_and_77_and_one_that_ran_exits_0(key: str, form: str, tmp_path: Path) -> None:
    """What cron and systemd see: a management command's ``handle()`` and a script's ``main()`` under
    ``@leased(..., on_busy="exit")``, each a real process."""

    def run(marker: str, *wait: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "tests.children.leased_child", form, key, str(tmp_path / marker), *wait]
        return subprocess.run(argv, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)

    ran = run("ran")
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "ran").exists()
    epoch = Lease.objects.inspect(key).epoch
    assert Lease.objects.acquire(key, "elsewhere", ttl=60) is not None
    busy = run("busy")
    assert busy.returncode == ExitCode.BUSY.value == 75, busy.stderr
    assert "skipped" in busy.stderr and "exiting with status 75" in busy.stderr
    timed_out = run("timed-out", "0.3")
    assert timed_out.returncode == ExitCode.TIMED_OUT.value == 77, timed_out.stderr
    assert not (tmp_path / "busy").exists() and not (tmp_path / "timed-out").exists()
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("elsewhere", epoch + 1)


def test_leased_key_templates_and_callables(key: str) -> None:
    class Obj:
        pk = 42

    @leased(key + ":invoice:{invoice_id}:{kind}", ttl=5)
    def send_invoice(invoice_id: int, kind: str = "email") -> str:
        lease = current_lease()
        assert lease is not None
        return lease.key

    @leased(key + ":obj:{obj.pk}", ttl=5)
    def touch(obj: Obj) -> str | None:
        lease = current_lease()
        return lease.key if lease else None

    @leased(lambda account, **kw: f"{key}:account:{account.upper()}", ttl=5)
    def sync(account: str, *, full: bool = False) -> str:
        lease = current_lease()
        assert lease is not None
        return lease.key

    assert send_invoice(7) == f"{key}:invoice:7:email"
    assert send_invoice(invoice_id=8, kind="sms") == f"{key}:invoice:8:sms"
    assert touch(Obj()) == f"{key}:obj:42"
    assert sync("acme", full=True) == f"{key}:account:ACME"
    assert send_invoice.__name__ == "send_invoice" and send_invoice.__wrapped__ is not None  # type: ignore[attr-defined]

    with pytest.raises(InvalidInputError, match="no parameter 'missing'"):
        leased("job:{missing}", ttl=5)(send_invoice.__wrapped__)  # type: ignore[attr-defined]
    with pytest.raises(InvalidInputError, match="on_busy"):
        leased(key, ttl=5, on_busy="wait")  # type: ignore[call-overload]


def test_nested_holds_of_different_keys_each_fence_their_own_writes(key: str, other_key: str) -> None:
    with hold(key, ttl=5) as outer:
        with hold(other_key, ttl=5) as inner:
            assert current_lease() is inner
            assert current_lease(key) is outer and current_lease(other_key) is inner
            a, b = Invoice(account=key), Invoice(account=other_key)
            a.save()  # no fence passed: the active lease of each row's key is used
            b.save()
            assert (a.lease_epoch, b.lease_epoch) == (outer.epoch, inner.epoch)
            with pytest.raises(NotAcquirableError):  # holds are not reentrant: each has its own owner
                hold(key, ttl=5).__enter__()
        assert current_lease() is outer
        assert Lease.objects.inspect(other_key).status == "free"
        assert Lease.objects.inspect(key).status == "held"
        with pytest.raises(UnfencedWriteError):
            Invoice(account=other_key).save()  # that hold has ended
    with pytest.raises(UnfencedWriteError):
        Invoice(account=key).save()


def test_a_fenced_save_inside_hold_after_the_lease_was_lost(key: str, raw_connect: Connect, signals: Recorder) -> None:
    seen: list[HeldLease] = []
    intruder = raw_connect()
    with hold(key, ttl=5, renew_every=0.1, owner=f"job-{key}"[:200], on_lost=seen.append) as lease:
        invoice = Invoice(account=key)
        invoice.save()
        assert invoice.lease_epoch == lease.epoch
        # A restarted incarnation of the same owner takes over: the hold's epoch is now stale.
        new_epoch = steal(intruder, key, lease.owner)
        assert lease.wait_lost(timeout=5)
        assert lease.lost and isinstance(lease.error, EpochMismatchError)
        with pytest.raises(EpochMismatchError):
            lease.check()
        invoice.status = "sent"
        with pytest.raises(EpochMismatchError):
            invoice.save()  # the database refuses it: nothing lands
        with pytest.raises(EpochMismatchError):
            Invoice(account=key, status="new").save()
    assert list(Invoice.objects.filter(account=key).values_list("status", "lease_epoch")) == [("draft", lease.epoch)]
    assert seen == [lease]
    assert signals.of(key) == [("acquired", lease.epoch), ("lost", EpochMismatchError)]
    state = Lease.objects.inspect(key)  # the exit did not release the new holder's lease
    assert (state.status, state.epoch) == ("held", new_epoch)


# ---- heartbeats and the trust window ----------------------------------------------------------


@needs_session  # identifies backends by pid / application_name, which the pooler hides
def test_heartbeat_uses_its_own_connection_and_reconnects_after_pg_terminate_backend(
    key: str, raw_connect: Connect
) -> None:
    admin = raw_connect()
    with hold(key, ttl=2, renew_every=0.1, owner=f"hb-{key}"[-60:]) as lease:
        wait_until(lambda: len(heartbeat_pids(admin)) >= 1, what="the lease connections")
        first_pids = set(heartbeat_pids(admin))
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            assert cursor.fetchone()[0] not in first_pids  # never the job's connection
        for pid in first_pids:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_until(lambda: set(heartbeat_pids(admin)) - first_pids != set(), what="a reconnected heartbeat")
        after = lease.expires_at
        wait_until(lambda: lease.expires_at > after, what="a renewal on the new connection")
        assert not lease.lost
        state = Lease.objects.inspect(key)
        assert (state.status, state.owner, state.epoch) == ("held", lease.owner, lease.epoch)
    assert Lease.objects.inspect(key).status == "free"
    lease_pool.close_connections()  # idle pooled connections close on their own after a while; now
    wait_until(lambda: heartbeat_pids(admin) == [], what="the lease backends to exit")


def test_trust_window_ends_before_the_server_lets_anyone_else_in(
    key: str, raw_connect: Connect, signals: Recorder
) -> None:
    blocker = raw_connect(autocommit=False)
    seen: list[HeldLease] = []
    # A wide margin (trust 1 s of a 2 s lease): the check below runs after the loss, and a commit
    # flush on a shared machine can take longer than the default 10% (0.15 s here).
    with override_settings(PG_LEASE_SAFETY_MARGIN=0.5), hold(key, ttl=2, renew_every=0.1, on_lost=seen.append) as lease:
        # Hold the lease row locked: every renewal now waits, times out and is retried (transient).
        blocker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
        assert lease.wait_lost(timeout=5)
        # Lost on the holder's own clock while the server still says it holds: nobody else can
        # have acquired in between.
        state = Lease.objects.inspect(key)
        assert (state.status, state.owner, state.epoch) == ("held", lease.owner, lease.epoch)
        assert state.expires_at is not None and state.server_time < state.expires_at
        assert isinstance(lease.error, LapsedError) and "trust window" in str(lease.error)
        with pytest.raises(LapsedError):
            lease.check()
        assert lease.trust_remaining == 0
        blocker.rollback()
    assert seen == [lease]
    assert signals.of(key) == [("acquired", lease.epoch), ("lost", LapsedError)]
    # Lost by its own clock, not by a verdict: the exit still released its own (owner, epoch) if it could.
    assert Lease.objects.inspect(key).status in ("free", "lapsed")


def test_a_crashed_heartbeat_counts_as_lost_and_the_exit_still_releases(
    key: str, signals: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(self: Tenure, expires_at: Any, sent_at: float) -> bool:
        raise RuntimeError("a bug in the heartbeat")

    # A bug in the heartbeat thread: recording a renewal raises, which nothing there expects.
    monkeypatch.setattr(Tenure, "renewed", crash)
    # A long TTL: the crash comes with the first renewal, even after a slow commit of the acquire.
    with hold(key, ttl=30, renew_every=0.1) as lease:
        assert lease.wait_lost(timeout=10)
        assert isinstance(lease.error, HeartbeatFailedError) and lease.error.code == "heartbeat_failed"
        assert "crashed" in str(lease.error)
        with pytest.raises(HeartbeatFailedError):
            lease.check()
    assert signals.of(key) == [("acquired", lease.epoch), ("lost", HeartbeatFailedError)]
    # Not a verdict from the server: the exit still released its own (owner, epoch).
    assert Lease.objects.inspect(key).status == "free"


def test_a_transaction_kept_open_after_a_fenced_write_keeps_the_lease_and_holds_off_takeovers(
    key: str, raw_connect: Connect
) -> None:
    # The fenced write keeps the lease row locked FOR KEY SHARE until commit: renewals (FOR NO KEY
    # UPDATE) go on, a takeover or a release (FOR UPDATE) waits. (0.1.0 locked FOR SHARE, which
    # starved the heartbeat: the job lost its lease.)
    admin = raw_connect()
    admin.execute("SET lock_timeout = '300ms'")
    with hold(key, ttl=1.5, renew_every=0.1) as lease, transaction.atomic():
        Invoice(account=key).save()
        renewed_at = admin.execute("SELECT expires_at FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
        wait_until(
            lambda: (
                admin.execute("SELECT expires_at FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
                != renewed_at
            ),
            what="a renewal while the fenced transaction is open",
        )
        with pytest.raises(psycopg.errors.LockNotAvailable):
            admin.execute("SELECT * FROM pg_lease_force_release(%s, NULL)", [key])
        lease.check()
    assert Invoice.objects.filter(account=key, lease_epoch=lease.epoch).count() == 1


# ---- async -----------------------------------------------------------------------------------


def test_async_job_is_cancelled_when_the_lease_is_lost(key: str, raw_connect: Connect) -> None:
    intruder = raw_connect()
    owner = f"async-{key}"[:200]
    events: list[str] = []
    started = asyncio.Event()

    # A TTL whose trust window (108 s) and default renew interval (40 s) are beyond the hang guard:
    # only a renewal every 0.1 s learns of the theft within it.
    @leased(key, ttl=120, renew_every=0.1, owner=owner)
    async def job() -> str:
        events.append("started")
        started.set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "finished"

    async def main() -> float:
        task = asyncio.create_task(job())
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.to_thread(steal, intruder, key, owner)
        stolen_at = time.monotonic()
        with pytest.raises(EpochMismatchError):  # a renewal's verdict (a lapsed trust window: LapsedError)
            await asyncio.wait_for(task, HANG)
        assert not task.cancelled()  # our cancellation became the precise error, as asyncio.timeout() does
        return time.monotonic() - stolen_at

    reaction = asyncio.run(main())
    assert events == ["started", "cancelled"]
    assert reaction < HANG  # a renewal (every 0.1 s) saw the verdict: the next one at 40 s would be too late


def test_async_job_runs_and_skips_like_sync(key: str) -> None:
    @leased(key, ttl=5)
    async def job(x: int) -> int:
        await asyncio.sleep(0)
        lease = current_lease()
        assert lease is not None and lease.key == key
        return x + 1

    assert asyncio.run(job(1)) == 2
    assert Lease.objects.inspect(key).status == "free"
    assert Lease.objects.acquire(key, "elsewhere", ttl=30) is not None
    assert asyncio.run(job(1)) is None


def test_async_hold_as_context_manager(key: str) -> None:
    async def main() -> tuple[int, str | None]:
        async with hold(key, ttl=5) as lease:
            inner = current_lease()
            return lease.epoch, inner.owner if inner else None

    epoch, owner = asyncio.run(main())
    assert owner is not None and epoch >= 1
    assert Lease.objects.inspect(key).status == "free"


# ---- exit: hold_at_least -----------------------------------------------------------------------


def test_hold_at_least_keeps_the_lease_until_then_and_then_it_lapses(key: str, signals: Recorder) -> None:
    at_least = timedelta(seconds=1.5)
    before_enter = server_clock()
    with hold(key, ttl=1, hold_at_least=at_least.total_seconds()) as lease:
        acquired_at = Lease.objects.get(key=key).acquired_at
        assert acquired_at is not None
        # Stay 0.5 s (server clock): keeping it until exit + hold_at_least would then show.
        wait_until(lambda: server_clock() - acquired_at >= timedelta(seconds=0.5), what="0.5 s into the hold")
        before_exit = server_clock()
    after_exit = server_clock()
    row = Lease.objects.get(key=key)
    assert (row.owner, row.epoch) == (lease.owner, lease.epoch)  # still held, same epoch
    assert row.acquired_at == acquired_at and row.expires_at is not None
    # Kept until grant + hold_at_least (longer than the TTL), on the server clock: the hold counts from
    # its attempt (sent after before_enter, granted at acquired_at) and renews at exit (between
    # before_exit and after_exit) to the time left. Whatever stalls the machine makes, that puts it in:
    slack = timedelta(milliseconds=10)  # two clocks of one machine, read by two processes
    assert before_enter + at_least - slack <= row.expires_at, (row.expires_at - acquired_at).total_seconds()
    assert row.expires_at <= acquired_at + at_least + (after_exit - before_exit) + slack, (
        (row.expires_at - acquired_at).total_seconds(),
        (after_exit - before_exit).total_seconds(),
    )
    assert lease.expires_at == row.expires_at
    assert Lease.objects.acquire(key, "next-host", ttl=5) is None  # a second run right away is refused
    assert signals.of(key) == [("acquired", lease.epoch), ("released", False)]
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what="the lease to lapse")
    assert Lease.objects.acquire(key, "next-host", ttl=5) is not None


def test_hold_at_least_shorter_than_the_job_releases_normally(key: str) -> None:
    with hold(key, ttl=5, hold_at_least=0.05) as lease:
        wait_until(lambda: lease.trust_remaining < 4.5 - 0.1, what="the job to outlast hold_at_least")
    assert Lease.objects.inspect(key).status == "free"


# ---- real processes --------------------------------------------------------------------------


def worker_env() -> dict[str, str]:
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    url = f"postgresql://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    return {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONUNBUFFERED": "1"}


class Worker:
    """A tests.children.jobs_worker process whose JSON reports are read line by line."""

    def __init__(self, mode: str, key: str, ttl: float, name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.children.jobs_worker", mode, key, str(ttl), name],
            cwd=REPO,
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.events.append(json.loads(line))
                self._lock.notify_all()

    def expect(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        with self._lock:
            found = self._lock.wait_for(lambda: any(e["event"] == event for e in self.events), timeout)
            assert found, f"worker never reported {event!r}; got {self.events}"
            return next(e for e in self.events if e["event"] == event)

    def finish(self, timeout: float = 60.0) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        with_signal = worker.proc.poll() is None
        if with_signal:
            os.kill(worker.proc.pid, signal.SIGCONT)
        worker.kill()


def test_a_worker_paused_past_its_ttl_stops_before_any_fenced_write_lands(key: str, workers: list[Worker]) -> None:
    ttl = 1.0
    a = Worker("loop", key, ttl, "A")
    workers.append(a)
    epoch_a = a.expect("acquired")["epoch"]
    wait_until(lambda: Entry.objects.filter(account=key, writer="A").count() >= 3, what="A's first writes")
    os.kill(a.proc.pid, signal.SIGSTOP)
    paused_at = time.monotonic()

    b = Worker("takeover", key, ttl, "B")
    workers.append(b)
    epoch_b = b.expect("acquired")["epoch"]
    assert epoch_b > epoch_a
    b.expect("wrote")
    wait_until(lambda: time.monotonic() - paused_at >= 2 * ttl, what="2 x TTL of pause")
    os.kill(a.proc.pid, signal.SIGCONT)

    stopped = a.expect("stopped")
    assert stopped["error"] in ("LapsedError", "NotOwnerError") and stopped["lost"] is True
    assert a.expect("check_again")["error"] in ("LapsedError", "NotOwnerError")
    assert a.finish() == 0
    assert b.finish() == 0

    rows = list(Entry.objects.filter(account=key).order_by("pk").values_list("writer", "lease_epoch"))
    a_rows = [epoch for writer, epoch in rows if writer == "A"]
    assert len(a_rows) == stopped["wrote"]  # every write A believed landed did, and nothing else
    assert set(a_rows) == {epoch_a}
    assert rows[len(a_rows) :] == [("B", epoch_b)]  # nothing from A after B took over
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch_b + 1)  # B released its own epoch on exit


@pytest.mark.parametrize(("signum", "codes"), [(signal.SIGTERM, {143}), (signal.SIGINT, {-signal.SIGINT, 130})])
def test_sigterm_and_sigint_release_the_lease(key: str, workers: list[Worker], signum: int, codes: set[int]) -> None:
    w = Worker("hold", key, 30, "sig")
    workers.append(w)
    epoch = w.expect("acquired")["epoch"]
    assert Lease.objects.inspect(key).status == "held"
    os.kill(w.proc.pid, signum)
    assert w.finish() in codes
    assert w.expect("released") == {"event": "released", "epoch": epoch, "freed": True}
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)  # released, not left to lapse


# ---- hygiene ---------------------------------------------------------------------------------


@needs_session  # identifies backends by pid / application_name, which the pooler hides
def test_no_leaked_connections_or_threads(
    key: str, other_key: str, raw_connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Idle workers, the idle scheduler and its idle connections go after IDLE_EXIT: make it short.
    monkeypatch.setattr(scheduler, "IDLE_EXIT", 0.2)
    admin = raw_connect()
    connection.ensure_connection()
    wait_until(lambda: scheduler.scheduler_threads() == 0, what="an idle scheduler from earlier tests to exit")
    wait_until(lambda: heartbeat_pids(admin) == [], what="idle lease connections from earlier tests to close")
    before = (backends(admin), threading.active_count())
    # Threads of earlier tests may still end meanwhile (an idle async-call thread waits 30 s): what
    # must not be left is a thread this test started.
    threads_before = set(threading.enumerate())

    with hold(key, ttl=2, renew_every=0.05) as lease:
        wait_until(lambda: renewals(lease) > 0, what="a renewal")
        # One scheduler and one worker (renewals of one hold are never in flight twice); one connection.
        assert threading.active_count() <= before[1] + 2
        assert backends(admin) <= before[0] + 2
        lease.check()
    with pytest.raises(KeyError), hold(key, ttl=2):
        raise KeyError("job failed")
    other = Lease.objects.acquire(other_key, "elsewhere", ttl=30)
    assert other is not None
    with pytest.raises(NotAcquirableError), hold(other_key, ttl=2):
        pass
    assert leased(other_key, ttl=2)(lambda: 1)() is None
    with hold(key, ttl=5, renew_every=0.05) as lease:
        steal(admin, key, lease.owner)
        assert lease.wait_lost(5)

    @leased(f"{key}:async", ttl=2)
    async def job() -> int:
        return 1

    assert asyncio.run(job()) == 1

    wait_until(lambda: not set(threading.enumerate()) - threads_before, what="the scheduler and its workers to exit")
    wait_until(lambda: backends(admin) == before[0], what="every lease connection to close")


def renewals(lease: HeldLease) -> int:
    """How many renewals moved the trust window of ``lease`` (0 until the first)."""
    tenure = lease._tenure
    return int(tenure.trusted_until > tenure.granted_at + tenure.trust_span)


def test_composes_with_django_tasks(key: str) -> None:
    pytest.importorskip("django.tasks", reason="django.tasks (Django 6) is not installed: @task composition untested")
    from tests import jobs_tasks

    result = jobs_tasks.add_under_lease.enqueue(2, 3, key=key)  # the immediate backend runs it now
    assert result.return_value == [5, True]
    assert Lease.objects.inspect(f"{key}:add").status == "free"
    assert Lease.objects.acquire(f"{key}:add", "elsewhere", ttl=30) is not None
    result = jobs_tasks.add_under_lease.enqueue(2, 3, key=key)
    assert result.return_value is None  # busy: skipped


@pytest.mark.django_db(transaction=True)
def test_queryset_writes_inside_hold_use_the_current_lease_for_a_class_level_key() -> None:
    with unfenced_writes():
        Report.objects.create(title="draft")
    with hold(Report.lease_key, ttl=30) as lease:
        assert Report.objects.filter(title="draft").update(title="final") == 1
    assert Report.objects.get(title="final").lease_epoch == lease.epoch
