"""Faults: killed and paused holders, terminated backends, server crashes, server clock steps.

Each test states the documented outcome (docs/FAILURE-MODEL.md) it shows. Whole-run tests use the
stress harness and its history checker; targeted ones drive client processes (:mod:`stress.agent`)
or threads with their own connections, and block statements on a row lock to hit them mid-flight.
"""

from __future__ import annotations

import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import django.db
import psycopg
import pytest
from django.db import connection, transaction

import pg_lease_django
import pg_lease_django.holds.lease_connection
from devkit.dbserver import LocalServer, throwaway_datadir
from devkit.testapp.models import Invoice
from pg_lease_django import Grant, Lease, OutcomeUnknownError, unfenced_writes
from stress.agent import Agent
from stress.checker import Op, check
from stress.harness import Config, Run, migrate, run
from tests.chaos.test_stress import server_url
from tests.helpers import Background, wait_until, wait_until_blocked

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


def test_db_url() -> str:
    """URL of the test database itself (``test_<name>`` while the tests run)."""
    return server_url()


test_db_url.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start client processes on the test database (or another URL); all are ended afterwards."""
    started: list[Agent] = []

    def start(owner: str, url: str | None = None) -> Agent:
        agent = Agent(url or test_db_url(), owner)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.process.poll() is None:
            agent.process.send_signal(signal.SIGCONT)
        agent.close()


def until_lapsed(key: str, agent: Agent | None = None) -> dict[str, Any]:
    """Poll inspect until the key's lease has lapsed on the server clock (a TTL passing, not a sync)."""
    seen: dict[str, Any] = {}

    def lapsed() -> bool:
        nonlocal seen
        seen = agent.call(op="inspect", key=key) if agent else {"status": Lease.objects.inspect(key).status}
        return bool(seen["status"] != "held")

    wait_until(lapsed, timeout=30, what=f"lease {key} to lapse")
    return seen


# ---- killed and paused holders ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.soak
def test_kill_minus_9_of_workers_at_random_points_never_breaks_the_history() -> None:
    """kill -9 at random points (mid-statement, mid-transaction, holding): leases lapse, others take
    over with higher epochs, in-flight operations count as unknown, and the server record has no
    double grant, no lost grant and no stale accepted write."""
    rng = random.Random(7)
    killed: list[str] = []

    def chaos(stress: Run) -> None:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and len(killed) < 6:
            time.sleep(rng.uniform(1.0, 2.5))
            alive = stress.alive()
            if not alive:
                return
            victim = rng.choice(alive)
            stress.kill(victim)
            killed.append(victim)
            stress.spawn(int(victim[1:].split("g")[0]))  # a new process, a new owner identity

    result = run(Config(test_db_url(), seed=11, workers=5, keys=2, seconds=14), during=chaos)
    assert result.report.ok, result.describe()
    assert len(killed) >= 3
    # Someone else acquired a key after a killed worker's last grant on it.
    for victim in killed:
        grants = [op for op in result.ops if op.worker == victim and op.op == "acquire" and op.outcome == "ok"]
        if grants:
            last = max(grants, key=lambda op: op.epoch or 0)
            later = [op for op in result.ops if op.op == "acquire" and op.outcome == "ok" and op.key == last.key]
            assert max(op.epoch or 0 for op in later) > (last.epoch or 0), result.describe()


@pytest.mark.slow
@pytest.mark.soak
def test_sigstop_for_twice_the_ttl_then_sigcont_never_breaks_the_history() -> None:
    """Workers stopped for 2 x TTL at random points (mid-statement, mid-transaction, holding), then
    resumed: their renewals and fenced writes after a takeover are refused; nothing else changes."""
    rng = random.Random(8)
    stops = 0

    def chaos(stress: Run) -> None:
        nonlocal stops
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 1.0))
            alive = stress.alive()
            if not alive:
                return
            victim = rng.choice(alive)
            stress.signal(victim, signal.SIGSTOP)
            time.sleep(2 * stress.config.ttl_max)
            stress.signal(victim, signal.SIGCONT)
            stops += 1

    result = run(Config(test_db_url(), seed=12, workers=5, keys=2, seconds=12, ttl_max=0.3), during=chaos)
    assert result.report.ok, result.describe()
    assert stops >= 5


def test_holder_stopped_past_its_ttl_is_fenced_out_when_it_resumes(key: str, agents: Callable[..., Agent]) -> None:
    """SIGSTOP a holder for 2 x TTL, let another client take over, SIGCONT: every action of the old
    holder is refused (renew, fenced write, release: ``not_owner``); the new holder is untouched."""
    holder, other = agents("holder"), agents("other")
    counter = holder.call(op="counter", key=key)
    assert counter.get("value") == 0, counter
    grant = holder.call(op="acquire", key=key, ttl=0.5)
    assert grant["ok"]
    holder.process.send_signal(signal.SIGSTOP)
    try:
        holder.send(op="renew", key=key, epoch=grant["epoch"], ttl=5)  # queued: it runs on SIGCONT
        until_lapsed(key, other)
        taken = other.call(op="acquire", key=key, ttl=30)
        assert taken["ok"] and taken["epoch"] == grant["epoch"] + 1
        assert taken["server_time"] >= grant["expires_at"]
    finally:
        holder.process.send_signal(signal.SIGCONT)
    renewed = holder.reply()
    assert (renewed["ok"], renewed["code"]) == (False, "not_owner"), renewed
    wrote = holder.call(op="write", key=key, epoch=grant["epoch"])
    assert (wrote["ok"], wrote["code"]) == (False, "not_owner"), wrote
    released = holder.call(op="release", key=key, epoch=grant["epoch"])
    assert (released["ok"], released["code"]) == (False, "not_owner"), released
    assert other.call(op="write", key=key, epoch=taken["epoch"]) == {"ok": True, "value": 1}
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("other", taken["epoch"])


def test_holder_stopped_inside_a_fenced_write_delays_the_takeover_never_interleaves(
    key: str, agents: Callable[..., Agent]
) -> None:
    """SIGSTOP a holder after its fenced save, before its commit, for 2 x TTL. The fence keeps the
    lease row share-locked, so a takeover (even a non-blocking acquire) waits for the paused
    transaction; on SIGCONT the write commits, and only then is the new epoch granted: the write is
    ordered before the new epoch, never after it. Pausing costs others time, never safety."""
    holder, other = agents("holder"), agents("other")
    holder.call(op="counter", key=key)
    grant = holder.call(op="acquire", key=key, ttl=0.5)
    assert holder.call(op="write", key=key, epoch=grant["epoch"], hold=True) == {"ok": True, "stage": "fenced"}
    holder.process.send_signal(signal.SIGSTOP)
    try:
        holder.send_line("commit")  # read when it resumes
        pid = other.call(op="pid")["pid"]
        until_lapsed(key, other)  # the lease lapses in server time while the holder is stopped
        other.send(op="acquire", key=key, ttl=30)  # non-blocking, yet it waits on the row lock
        with psycopg.connect(test_db_url(), autocommit=True) as watcher:
            wait_until_blocked(watcher, pid)
            time.sleep(0.5)  # part of the scenario: stay stopped for 2 x TTL in all
            wait_until_blocked(watcher, pid)  # the takeover is still waiting
    finally:
        holder.process.send_signal(signal.SIGCONT)
    assert holder.reply() == {"ok": True, "value": 1}
    taken = other.reply()
    assert taken["ok"] and taken["epoch"] == grant["epoch"] + 1
    invoice = Invoice.objects.get(account=key)
    assert (invoice.amount, invoice.lease_epoch) == (1, grant["epoch"])
    stale = holder.call(op="write", key=key, epoch=grant["epoch"])
    assert (stale["ok"], stale["code"]) == (False, "not_owner")


# ---- terminated backends --------------------------------------------------------------------


class RowLocker:
    """Holds the lease row ``FOR UPDATE`` in an open transaction, so the next lease statement blocks."""

    def __init__(self, key: str) -> None:
        self.conn = psycopg.connect(test_db_url())
        self.conn.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def _in_thread_with_pid(fn: Callable[[], Any]) -> tuple[Background, int]:
    """Run ``fn`` in a thread with its own Django connection; return the thread and that backend's pid."""
    ready = threading.Event()
    pid: list[int] = []

    def body() -> Any:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            ready.set()
            return fn()
        finally:
            ready.set()
            connection.close()

    thread = Background(body)
    thread.start()
    assert ready.wait(30) and pid
    return thread, pid[0]


def _terminate_blocked(key: str, fn: Callable[[], Any]) -> BaseException:
    """Block ``fn``'s lease statement on the row lock, pg_terminate_backend it, return what it raised."""
    locker = RowLocker(key)
    try:
        thread, pid = _in_thread_with_pid(fn)
        with psycopg.connect(test_db_url(), autocommit=True) as admin:
            wait_until_blocked(admin, pid)
            assert admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        locker.release()
    assert thread.error is not None, f"no error; returned {thread.result!r}"
    return thread.error


def _held(key: str, ttl: float = 30) -> Grant:
    grant = Lease.objects.acquire(key, "holder", ttl)
    assert grant is not None
    return grant


def _fenced_increment(key: str, grant: Grant) -> int:
    with transaction.atomic():
        invoice = Invoice.objects.get(account=key)
        invoice.amount += 1
        invoice.save(fence=grant, update_fields=["amount"])
    return invoice.amount


@pytest.mark.parametrize("operation", ["acquire_lapsed", "acquire_self", "renew", "release", "fenced_write"])
def test_backend_terminated_mid_operation(key: str, operation: str) -> None:
    """pg_terminate_backend while the operation's statement runs (blocked on the lease row).

    Documented outcome: the caller gets ``django.db.OperationalError``, for a lease call its subclass
    ``OutcomeUnknownError`` (the connection is gone; the next call reconnects); the statement's
    transaction was rolled back, so nothing changed. In general (a termination right after the
    commit) the caller cannot tell whether it happened:
    acquire again with the same owner (a self-takeover gives a fresh epoch, fencing any grant it
    missed), renew again, release again (``not_owner`` then means it went through). Never a
    double grant: the epoch is where it was.
    """
    with unfenced_writes():
        Invoice.objects.create(account=key)
    grant = _held(key, ttl=0.2 if operation == "acquire_lapsed" else 30)
    if operation == "acquire_lapsed":
        until_lapsed(key)
    before = Lease.objects.inspect(key)
    calls: dict[str, Callable[[], Any]] = {
        "acquire_lapsed": lambda: Lease.objects.acquire(key, "taker", 30),
        "acquire_self": lambda: Lease.objects.acquire(key, "holder", 30),
        "renew": lambda: Lease.objects.renew(key, "holder", grant.epoch, 30),
        "release": lambda: Lease.objects.release(key, "holder", grant.epoch),
        "fenced_write": lambda: _fenced_increment(key, grant),
    }
    error = _terminate_blocked(key, calls[operation])
    assert isinstance(error, django.db.OperationalError), repr(error)
    if operation != "fenced_write":  # a lease statement: the package's typed "no answer" (Django's own write: Django's)
        assert isinstance(error, OutcomeUnknownError) and error.code == "outcome_unknown", repr(error)
    after = Lease.objects.inspect(key)
    assert (after.owner, after.epoch, after.status) == (before.owner, before.epoch, before.status)
    assert Invoice.objects.get(account=key).amount == 0
    # Retrying is the recovery; it runs on a new connection.
    result = calls[operation]()
    if operation.startswith("acquire"):
        assert result is not None and result.epoch == before.epoch + 1
    elif operation == "release":
        assert Lease.objects.inspect(key).status == "free"
    elif operation == "fenced_write":
        assert result == 1


def test_backend_terminated_between_operations_fails_the_next_call_only(key: str) -> None:
    """A connection terminated while idle: the next call (here inspect; any other alike) raises
    ``django.db.OperationalError`` without having run; the one after reconnects and works."""
    grant = _held(key)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with psycopg.connect(test_db_url(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_until(
            lambda: admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == (0,),
            what="the backend to exit",
        )
    with pytest.raises(django.db.OperationalError):
        Lease.objects.inspect(key)
    connection.close()
    assert Lease.objects.inspect(key).epoch == grant.epoch
    assert Lease.objects.renew(key, "holder", grant.epoch, 30) is not None


@pytest.mark.parametrize("in_atomic", [False, True], ids=["autocommit", "in-atomic"])
def test_backend_terminated_during_a_blocking_wait(key: str, in_atomic: bool) -> None:
    """A blocking acquire waiting for a held key, its backend terminated between attempts. Outside a
    transaction the waiter reconnects and waits on: granted, once, when the holder releases
    (tests/cluster/test_failover_listen.py: the same across a failover). Inside ``atomic()`` the transaction is
    gone: Django's ``OperationalError``, as for any other lost connection, and no grant."""
    grant = _held(key)

    def wait() -> Grant | None:
        if in_atomic:
            with transaction.atomic():
                return Lease.objects.acquire(key, "waiter", 30, blocking=True, timeout=20)
        return Lease.objects.acquire(key, "waiter", 30, blocking=True, timeout=20)

    thread, pid = _in_thread_with_pid(wait)
    with psycopg.connect(test_db_url(), autocommit=True) as admin:
        # Waiting between attempts: idle (in its transaction, inside atomic()), its last statement an attempt.
        wait_until(
            lambda: (
                admin.execute(
                    "SELECT state LIKE 'idle%%' AND query ILIKE '%%pg_lease_acquire%%' FROM pg_stat_activity "
                    "WHERE pid = %s",
                    [pid],
                ).fetchone()
                == (True,)
            ),
            what="the waiter to wait",
        )
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    if in_atomic:
        thread.join(30)
        assert not thread.is_alive()
        assert Lease.objects.inspect(key).owner == "holder"
        assert isinstance(thread.error, django.db.OperationalError), repr(thread.error)
        return
    Lease.objects.release(key, "holder", grant.epoch)
    won = thread.outcome(30)
    assert won is not None and (won.owner, won.epoch) == ("waiter", grant.epoch + 2)
    assert Lease.objects.inspect(key).owner == "waiter"


def test_terminated_heartbeat_connection_is_replaced_and_the_lease_kept(key: str) -> None:
    """pg_terminate_backend of the ``hold()`` lease connections, three times in a row: the heartbeat
    reconnects and renews within the trust window, so the lease stays held at the same epoch and is
    not declared lost; leaving the block releases it. Never a second holder, never a new epoch."""
    hold = getattr(pg_lease_django, "hold", None)
    if hold is None:
        pytest.skip("pg_lease_django.hold does not exist yet: no heartbeat connection to terminate")
    with hold(key, ttl=1.5) as lease, psycopg.connect(test_db_url(), autocommit=True) as admin:
        epoch = lease.epoch
        # The lease connections of hold() (one pool per process, shared by its holds).
        name = pg_lease_django.holds.lease_connection.APPLICATION_NAME

        def heartbeat_pids() -> list[int]:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
                [name],
            ).fetchall()
            return [int(pid) for (pid,) in rows]

        def renewed_after(expires_at: datetime) -> bool:
            state = Lease.objects.inspect(key)
            return state.expires_at is not None and state.expires_at > expires_at

        for _ in range(3):
            wait_until(lambda: heartbeat_pids() != [], what="the heartbeat connection")
            for pid in heartbeat_pids():
                admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            expires_at = Lease.objects.inspect(key).expires_at
            assert expires_at is not None
            wait_until(lambda: renewed_after(expires_at), what="a renewal after the termination")  # noqa: B023
        state = Lease.objects.inspect(key)
        assert (state.status, state.owner, state.epoch) == ("held", lease.owner, epoch)
        assert not lease.lost
    after = Lease.objects.inspect(key)
    assert (after.status, after.epoch) == ("free", epoch + 1)


@pytest.mark.slow
@pytest.mark.soak
def test_random_backend_terminations_never_break_the_history() -> None:
    """pg_terminate_backend of random worker backends every ~0.3 s: unknown outcomes, never a second holder."""
    result = run(Config(test_db_url(), seed=13, workers=5, keys=2, seconds=12, terminate_every=0.3))
    assert result.report.ok, result.describe()
    assert result.terminated >= 10
    unknown = [op for op in result.ops if op.outcome == "unknown"]
    assert unknown, result.describe()
    assert all(op.cause and op.cause.startswith("connection") for op in unknown), result.describe()


# ---- server crash -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.soak
def test_immediate_shutdown_and_restart_while_workers_run() -> None:
    """pg_ctl -m immediate (a crash) twice while workers run, on a server with synchronous_commit=off:
    every acknowledged grant is in the server record afterwards (the library forces synchronous
    commit for lease writes), epochs never go backwards, no double grant. Acknowledged fenced writes
    follow the server's setting (not forced), so their durability is not required here; the counter
    still equals the accepted increments."""
    server = LocalServer(throwaway_datadir("crash-run"))
    server.start("synchronous_commit=off")
    restarts = 0

    def crash(stress: Run) -> None:
        nonlocal restarts
        for _ in range(2):
            # Operations recorded since the last crash: the workers are going (again). A few dozen, not
            # a count that a loaded machine cannot reach within the run's seconds.
            wanted = len(stress.history()) + 30
            wait_until(lambda: len(stress.history()) > wanted, timeout=60, what="workers to get going")  # noqa: B023
            server.restart("immediate", "synchronous_commit=off")
            restarts += 1

    try:
        result = run(Config(server.url(), seed=14, workers=5, keys=2, seconds=12, writes_durable=False), during=crash)
    finally:
        server.destroy()
    assert restarts == 2
    assert result.report.ok, result.describe()
    assert any(op.outcome == "unknown" for op in result.ops), "the crashes hit no operation"
    assert result.report.counts.get("acquire:ok", 0) > 20


# ---- server clock steps (libfaketime) --------------------------------------------------------------

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


@pytest.fixture
def faketime_server() -> Iterator[tuple[LocalServer, Path]]:
    """A throwaway server whose clock follows the offset written in a file (libfaketime)."""
    library = LIBFAKETIME if LIBFAKETIME.exists() else None
    if library is None:
        found = shutil.which("faketime")
        candidates = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1")) if found else []
        library = candidates[0] if candidates else None
    if library is None:
        pytest.skip("libfaketime is not installed (Debian: apt-get install -y faketime libfaketime)")
    datadir = throwaway_datadir("faketime")
    offset = datadir.parent / f"{datadir.name}.faketime"
    offset.write_text("+0s\n")
    offset.chmod(0o644)
    server = LocalServer(
        datadir,
        extra_env={
            "LD_PRELOAD": str(library),
            "FAKETIME_TIMESTAMP_FILE": str(offset),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        },
    )
    try:
        server.start()
        migrate(server.url())
        yield server, offset
    finally:
        server.destroy()
        offset.unlink(missing_ok=True)


def _step(offset: Path, value: str) -> None:
    offset.write_text(value + "\n")


@pytest.mark.slow
def test_server_clock_steps_forward_and_back(
    faketime_server: tuple[LocalServer, Path], agents: Callable[..., Agent]
) -> None:
    """Forward by 2 x TTL: the lease lapses at once; the old holder's renewals and fenced writes
    fail (``lapsed``, then ``not_owner`` after the takeover); another client acquires with the next
    epoch. Back by TTL: the current lease lasts a TTL longer in real time (takeover delayed),
    renewals compute their expiry from the stepped-back clock, and a later grant can carry an
    earlier server time than an older one; epochs still only go up, never a second holder."""
    server, offset = faketime_server
    url = server.url()
    key, ttl = "clock", 2.0
    holder, other = agents("holder", url), agents("other", url)
    holder.call(op="counter", key=key)
    history: list[Op] = []

    def record(agent: Agent, op: str, **command: Any) -> dict[str, Any]:
        invoke = time.monotonic()
        answer = agent.call(op=op, key=key, **command)
        history.append(
            Op(
                agent.owner,
                key,
                op,
                invoke,
                time.monotonic(),
                "ok" if answer["ok"] else "fail",
                cause=answer.get("code"),
                epoch=answer.get("epoch", command.get("epoch")),
                server_time=answer.get("server_time"),
                expires_at=answer.get("expires_at"),
                ttl=command.get("ttl"),
                owner=answer.get("owner"),
                status=answer.get("status"),
            )
        )
        return answer

    first = record(holder, "acquire", ttl=ttl)
    assert first["ok"]
    assert record(holder, "inspect")["status"] == "held"

    _step(offset, f"+{2 * ttl:g}s")  # forward by 2 x TTL
    assert record(other, "inspect")["status"] == "lapsed"
    assert record(holder, "renew", epoch=first["epoch"], ttl=ttl)["code"] == "lapsed"
    assert record(holder, "write", epoch=first["epoch"])["code"] == "lapsed"
    second = record(other, "acquire", ttl=ttl)
    assert second["ok"] and second["epoch"] == first["epoch"] + 1
    assert record(holder, "renew", epoch=first["epoch"], ttl=ttl)["code"] == "not_owner"
    assert record(holder, "write", epoch=first["epoch"])["code"] == "not_owner"
    assert record(other, "write", epoch=second["epoch"])["ok"]

    _step(offset, f"+{ttl:g}s")  # back by TTL
    assert record(other, "inspect")["status"] == "held"
    assert not record(holder, "acquire", ttl=ttl)["ok"]  # still held: the step lengthened it
    renewed = record(other, "renew", epoch=second["epoch"], ttl=ttl)
    assert renewed["ok"] and renewed["expires_at"] < second["expires_at"]  # from the earlier clock: shorter
    assert record(other, "release", epoch=second["epoch"])["ok"]
    third = record(holder, "acquire", ttl=ttl)
    assert third["ok"] and third["epoch"] == second["epoch"] + 2
    assert third["server_time"] < second["server_time"]  # a later grant, an earlier server time

    report = check(history)
    assert report.safe, report.render()  # epochs unique and in real-time order, no stale action accepted
    assert "grant_time_order" in {v.kind for v in report.clock_violations}, report.render()
    assert _counter(url, key) == 1


def _counter(url: str, key: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT amount FROM testapp_invoice WHERE account = %s", [key]).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
@pytest.mark.soak
def test_server_clock_steps_while_workers_run(faketime_server: tuple[LocalServer, Path]) -> None:
    """Workers run while the server clock jumps forward by 2 x the longest TTL, then back by one TTL,
    twice. Safety holds throughout (epochs, real-time order, fencing, counters, server record);
    only the clock-dependent properties (grant times, no overlap in server time) may be reported."""
    server, offset = faketime_server
    ttl = 0.3
    steps: list[str] = []

    def step_clock(stress: Run) -> None:
        for round_ in range(2):
            wanted = 100 + 150 * round_
            wait_until(lambda: len(stress.history()) > wanted, timeout=60, what="workers to get going")  # noqa: B023
            shift = 2 * ttl * (round_ + 1) - ttl * round_  # +0.6 s, then +0.9 s (net of the step back)
            _step(offset, f"+{shift:g}s")
            steps.append(f"+{shift:g}s")
            time.sleep(1.0)  # part of the scenario: run with the clock ahead
            _step(offset, f"+{shift - ttl:g}s")
            steps.append(f"+{shift - ttl:g}s")
            time.sleep(1.0)

    result = run(Config(server.url(), seed=15, workers=5, keys=2, seconds=10, ttl_max=ttl), during=step_clock)
    assert len(steps) == 4
    assert result.report.safe, result.describe()
    print(f"clock violations under the steps: {sorted(v.kind for v in result.report.clock_violations)}")
