"""Issue 33: an interrupt never strands a lease, whatever moment it lands on.

The window is widened as a lapsed leader's open fenced transaction widens it in production: another
session holds the lease row ``FOR UPDATE``, so the acquire statement is in flight (blocked on the
lock, seen in ``pg_blocking_pids``) when the interruption comes. Then the lock is let go, the
interrupted statement's server process is waited out, and the database is checked: nothing is
granted to an owner that is gone, and no session of the interrupted caller is left running.
"""

from __future__ import annotations

import asyncio
import dis
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync

from pg_lease_django import Lease, hold, lease_acquired, lease_lost
from tests.db.test_command_run import LeasesRun, process_gone
from tests.helpers import free, held, needs_session, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]
CHILD = [sys.executable, "-m", "tests.children.run_child"]
#: A hang guard, not a promise: leases run exits within a few seconds of a SIGTERM (docs/operations.md).
HANG_GUARD = 30.0
#: Behind PgBouncer (transaction pooling): the code under test goes through the pooler, the tests'
#: own connections (`raw_connect`) straight to the server.
POOLED = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))


@pytest.fixture
def runs() -> Iterator[Callable[..., LeasesRun]]:
    started: list[LeasesRun] = []

    def start(*args: str) -> LeasesRun:
        run = LeasesRun(*args)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


@contextmanager
def row_locked(raw_connect: Connect, key: str) -> Iterator[psycopg.Connection[Any]]:
    """Hold ``key``'s lease row FOR UPDATE in another session until the block ends (then commit)."""
    locker = raw_connect(autocommit=False)
    locker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    try:
        yield locker
    finally:
        locker.commit()


def blocked_behind(watch: psycopg.Connection[Any], locker: psycopg.Connection[Any]) -> int:
    """The server process waiting on ``locker``'s lock (waits for it to appear)."""
    found: list[int] = []

    def blocked() -> bool:
        rows = watch.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [locker.info.backend_pid]
        ).fetchall()
        found[:] = [row[0] for row in rows]
        return len(found) == 1

    wait_until(blocked, HANG_GUARD, "an acquire to block on the row lock")
    return found[0]


def gone(watch: psycopg.Connection[Any], pid: int) -> None:
    """Wait until server process ``pid`` has ended (its statement committed or rolled back); behind
    PgBouncer, whose server sessions outlive their clients, until it runs no statement."""
    if POOLED:
        not_running(watch, pid)
        return
    wait_until(
        lambda: watch.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == (0,),
        HANG_GUARD,
        f"backend {pid} to end",
    )


def not_running(watch: psycopg.Connection[Any], pid: int) -> None:
    """Wait until server process ``pid`` runs no statement (ended, or idle)."""
    wait_until(
        lambda: watch.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() != ("active",),
        HANG_GUARD,
        f"backend {pid} to stop running its statement",
    )


def no_session_left(watch: psycopg.Connection[Any], application_name: str) -> None:
    """No session named ``application_name`` is left (not checked behind PgBouncer: its sessions are the pooler's)."""
    if POOLED:
        return
    wait_until(
        lambda: (
            watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE %s",
                [application_name],
            ).fetchone()
            == (0,)
        ),
        HANG_GUARD,
        f"no {application_name!r} session left",
    )


# -- finding 2: a signal during a non-blocking acquire --------------------------------------------------


@pytest.mark.parametrize("wait", [[], ["--wait", "30"]], ids=["non-blocking", "blocking"])
def test_sigterm_during_an_acquire_leaves_nothing_granted(
    key: str, runs: Callable[..., LeasesRun], raw_connect: Connect, tmp_path: Path, wait: list[str]
) -> None:
    epoch = free(key)
    marker = tmp_path / "ran"
    watch = raw_connect()
    with row_locked(raw_connect, key) as locker:
        run = runs(key, "--ttl", "60", *wait, "--", *CHILD, "touch", str(marker))
        attempt = blocked_behind(watch, locker)
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.finish(HANG_GUARD) == 128 + signal.SIGTERM
    gone(watch, attempt)  # before the fix: it ran on after the exit, and granted once the lock went
    no_session_left(watch, "pg_lease_django%")
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)
    assert not marker.exists()
    assert "not run, lease not held" in run.stderr


class _Interrupted(BaseException):
    """What a signal handler raises (as `exit_on_signals` and `leases run` do): no psycopg interrupt."""


def test_an_interrupted_non_blocking_manager_acquire_leaves_nothing_granted(key: str, raw_connect: Connect) -> None:
    """``Lease.objects.acquire()`` (non-blocking) interrupted by a signal handler's exception while its
    statement waits on a row lock: before, the statement ran on after the exception and granted the
    lease to the interrupted caller once the lock went; now it is cancelled and settled first."""
    import threading

    epoch = free(key)
    watch = raw_connect()
    main = threading.get_ident()

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with row_locked(raw_connect, key) as locker:
            found: list[int] = []

            def signal_once_blocked() -> None:
                found.append(blocked_behind(watch, locker))
                signal.pthread_kill(main, signal.SIGUSR1)

            killer = threading.Thread(target=signal_once_blocked)
            killer.start()
            with pytest.raises(_Interrupted):
                Lease.objects.acquire(key, "w-interrupted", ttl=60)
            killer.join(HANG_GUARD)
            gone(watch, found[0])  # cancelled on the server while the row is still locked
    finally:
        signal.signal(signal.SIGUSR1, previous)
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


def _interrupt_at(step: int, when: str) -> tuple[Callable[..., Any], list[str]]:
    """An execute wrapper that raises `_Interrupted` just before or just after the ``step``-th statement."""
    return _interrupts({step: when})


def _interrupts(at: dict[int, str]) -> tuple[Callable[..., Any], list[str]]:
    """An execute wrapper that raises `_Interrupted` just ``at[n]`` ("before" or "after") the ``n``-th statement."""
    sent: list[str] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        when = at.get(len(sent))
        if when == "before":
            raise _Interrupted
        result = execute(sql, params, many, context)
        if when == "after":
            raise _Interrupted
        return result

    return wrapper, sent


@pytest.mark.parametrize("blocking", [False, True], ids=["non-blocking", "blocking"])
def test_an_acquire_interrupted_at_every_statement_leaves_nothing_granted(key: str, blocking: bool) -> None:
    """The interruption explored, not timed: ``Lease.objects.acquire`` interrupted just before and
    just after each statement it sends (the worst being after the grant committed and before its
    answer is returned); each time, the interrupted owner holds nothing afterwards."""
    from django.db import connection

    count, sent = _interrupt_at(0, "never")
    with connection.execute_wrapper(count):
        assert Lease.objects.acquire(f"{key}/count", "w-count", ttl=60, blocking=blocking) is not None
    steps = len(sent)
    assert steps >= 1
    for step in range(1, steps + 1):
        for when in ("before", "after"):
            target = f"{key}/{step}/{when}"
            wrapper, _ = _interrupt_at(step, when)
            with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
                Lease.objects.acquire(target, "w-int", ttl=60, blocking=blocking)
            state = Lease.objects.inspect(target)
            assert not (state.status == "held" and state.owner == "w-int"), (step, when, sent[:step])


def test_a_release_interrupted_at_every_statement_still_releases(key: str) -> None:
    """``Lease.objects.release`` interrupted just before or just after each statement it sends: the
    lease is free afterwards (interrupted before it took effect, it is completed before the
    interruption goes on: the owner is leaving, its lease must not wait for its TTL)."""
    from django.db import connection

    grant = Lease.objects.acquire(f"{key}/count", "w", ttl=60)
    assert grant is not None
    count, sent = _interrupt_at(0, "never")
    with connection.execute_wrapper(count):
        Lease.objects.release(grant.key, "w", grant.epoch)
    assert sent
    for step in range(1, len(sent) + 1):
        for when in ("before", "after"):
            target = f"{key}/{step}/{when}"
            grant = Lease.objects.acquire(target, "w", ttl=60)
            assert grant is not None
            wrapper, _ = _interrupt_at(step, when)
            with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
                Lease.objects.release(target, "w", grant.epoch)
            state = Lease.objects.inspect(target)
            assert (state.status, state.epoch) == ("free", grant.epoch + 1), (step, when)


# -- finding 1: leases run --campaign and a SIGTERM while its attempt is in flight ------------------------


def test_sigterm_during_a_campaign_attempt_exits_at_once_and_holds_nothing(
    key: str, runs: Callable[..., LeasesRun], raw_connect: Connect, tmp_path: Path
) -> None:
    epoch = free(key)
    marker = tmp_path / "ran"
    watch = raw_connect()
    with row_locked(raw_connect, key) as locker:
        run = runs(key, "--ttl", "60", "--campaign", "--", *CHILD, "touch", str(marker))
        attempt = blocked_behind(watch, locker)
        os.kill(run.proc.pid, signal.SIGTERM)
        # Before the fix it waited in Election.join() for as long as the row stayed locked.
        assert run.finish(HANG_GUARD) == 128 + signal.SIGTERM
        gone(watch, attempt)  # cancelled on the server while the lock is still held
    no_session_left(watch, "pg_lease_django%")
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)
    assert not marker.exists()


# -- finding 5: a cancelled blocking aacquire whose grant had committed ---------------------------------


def test_a_cancelled_blocking_aacquire_releases_a_grant_that_committed(key: str, raw_connect: Connect) -> None:
    epoch = free(key)
    watch = raw_connect()
    owner = "w-cancelled"

    async def scenario() -> None:
        with row_locked(raw_connect, key) as locker:
            task = asyncio.ensure_future(Lease.objects.aacquire(key, owner, ttl=60, blocking=True))
            attempt = await asyncio.to_thread(blocked_behind, watch, locker)
        # The worst moment, made certain: the attempt's grant commits on the server while this
        # (the event loop's) thread has not read its answer yet, and the cancellation lands first.
        wait_until(
            lambda: (
                watch.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [attempt]).fetchone() != ("active",)
            ),
            HANG_GUARD,
            "the attempt to commit",
        )
        holder = watch.execute("SELECT owner FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
        assert holder == (owner,)  # committed, not yet received
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async_to_sync(scenario)()
    no_session_left(watch, f"pg_lease_django wait {owner}")
    state = Lease.objects.inspect(key)
    assert state.status == "free", state  # before the fix: held by the cancelled caller for the 60 s TTL
    assert state.epoch == epoch + 2  # granted, then released by the settling


# -- findings 3 and 4: async blocking holds ------------------------------------------------------------


def waiting_holds(watch: psycopg.Connection[Any], count: int) -> None:
    """Wait until ``count`` blocking holds wait for a release (their last attempt refused, LISTENing)."""
    wait_until(
        lambda: (
            watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'pg_lease_django hold' AND state = 'idle'"
                " AND query LIKE '%%pg_lease_acquire_or_register%%'"
            ).fetchone()
            == (count,)
        ),
        HANG_GUARD,
        f"{count} blocking holds to wait",
    )


@needs_session  # sees the waiters as LISTENing sessions: behind PgBouncer they poll (no LISTEN)
def test_a_cancelled_blocking_async_hold_stops_waiting_at_once(key: str, raw_connect: Connect) -> None:
    epoch = held(key, "holder", ttl=60)
    watch = raw_connect()
    acquired: list[Any] = []

    def record(sender: Any, **kwargs: Any) -> None:
        acquired.append(kwargs)

    async def scenario() -> None:
        async def waiter() -> None:
            async with hold(key, 60, owner="w-cancelled", blocking=True):
                pytest.fail("the body of a cancelled hold ran")

        task = asyncio.ensure_future(waiter())
        await asyncio.to_thread(waiting_holds, watch, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    lease_acquired.connect(record)
    try:
        async_to_sync(scenario)()
        # Before the fix its thread went on waiting (a session per cancelled hold) until the key
        # freed, then took the lease for a body that never ran.
        no_session_left(watch, "pg_lease_django hold")
        Lease.objects.release(key, "holder", epoch)
    finally:
        lease_acquired.disconnect(record)
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)
    assert acquired == []


@needs_session  # sees the waiters as LISTENing sessions: behind PgBouncer they poll (no LISTEN)
def test_waiting_async_holds_leave_a_holder_free_to_exit(key: str, raw_connect: Connect) -> None:
    watch = raw_connect()
    order: list[str] = []

    async def scenario() -> None:
        # A small default executor stands for one that waiting holds have filled up (6 threads on 2 CPUs).
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        release, held_now = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with hold(key, 60, owner="holder"):
                order.append("holder")
                held_now.set()
                await release.wait()

        async def waiter(name: str) -> None:
            async with hold(key, 60, owner=name, blocking=True, timeout=HANG_GUARD):
                order.append(name)

        first = asyncio.ensure_future(holder())
        await held_now.wait()
        waiters = [asyncio.ensure_future(waiter(f"w{n}")) for n in range(2)]
        with ThreadPoolExecutor(max_workers=1) as watching:  # not the starved default executor
            await asyncio.get_running_loop().run_in_executor(watching, waiting_holds, watch, 2)
        release.set()
        await first
        # Before the fix the holder's exit queued behind both waits in the executor: the waiters
        # timed out (LeaseTimeoutError) while the finished holder kept the lease.
        await asyncio.gather(*waiters)

    async_to_sync(scenario)()
    assert sorted(order[1:]) == ["w0", "w1"] and order[0] == "holder"
    no_session_left(watch, "pg_lease_django hold")
    assert Lease.objects.inspect(key).status == "free"


# -- finding 6: COMMAND's background children ------------------------------------------------------------


def test_leases_run_holds_the_lease_until_the_processes_command_left_running_exit(
    key: str, runs: Callable[..., LeasesRun], tmp_path: Path
) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    run = runs(key, "--ttl", "5", "--owner", "runner-bg", "--", *CHILD, "background", str(fifo))
    command = run.expect("exiting")
    background = run.expect("ready")
    # COMMAND has exited and been reaped by leases run (its /proc entry is gone, not a zombie).
    wait_until(lambda: not os.path.exists(f"/proc/{command['pid']}"), HANG_GUARD, "COMMAND to be reaped")
    # As under flock(1), the background child still holds it (before the fix: released at once, exit 0).
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner) == ("held", "runner-bg")
    assert run.proc.poll() is None
    with open(fifo, "w"):
        pass  # the background child reads EOF and exits
    assert run.finish(HANG_GUARD) == 0
    assert process_gone(background["pid"])  # exited (an orphan's zombie runs nothing)
    after = Lease.objects.inspect(key)
    assert (after.status, after.epoch) == ("free", state.epoch + 1)  # released its own epoch, after the child


# -- finding 7: a fork child leaving a hold it inherited --------------------------------------------------


def test_a_fork_child_leaving_an_inherited_hold_after_its_trust_window_reports_no_loss(key: str) -> None:
    seen: list[str] = []

    def on_lost(lease: Any) -> None:
        seen.append("on_lost")

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append("lease_lost")

    lease_lost.connect(receiver)
    read_end, write_end = os.pipe()
    pid = -1
    try:
        with hold(key, 1.5, owner="parent", on_lost=on_lost) as lease:
            pid = os.fork()
            if pid == 0:
                # The child's copy of the trust window is never renewed: wait for it to run out.
                while lease.trust_remaining > 0:
                    time.sleep(0.02)
            else:
                os.close(write_end)
                with os.fdopen(read_end) as reports:
                    child_seen = json.loads(reports.read())  # written once the child has left the hold
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
                assert not lease.lost  # the parent still holds and renews it
                assert Lease.objects.inspect(key).owner == "parent"
        if pid == 0:
            os.write(write_end, json.dumps(seen).encode())
    finally:
        if pid == 0:
            os._exit(0)
        lease_lost.disconnect(receiver)
    # Before the fix the child reported a loss (on_lost, lease_lost and a "lost" log line).
    assert child_seen == []
    assert seen == []
    assert Lease.objects.inspect(key).status == "free"


# -- each step of an async hold's acquire: the attempt in flight, the wait between attempts -------------


@pytest.mark.parametrize("blocking", [False, True], ids=["non-blocking", "blocking"])
def test_a_hold_cancelled_while_its_attempt_is_in_flight_is_cancelled_on_the_server(
    key: str, raw_connect: Connect, blocking: bool
) -> None:
    epoch = free(key)
    watch = raw_connect()

    async def scenario() -> None:
        async def holder() -> None:
            async with hold(key, 60, owner="w-cancelled", blocking=blocking):
                pytest.fail("the body of a cancelled hold ran")

        with row_locked(raw_connect, key) as locker:
            task = asyncio.ensure_future(holder())
            with ThreadPoolExecutor(max_workers=1) as watching:
                loop = asyncio.get_running_loop()
                attempt = await loop.run_in_executor(watching, blocked_behind, watch, locker)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Cancelled on the server while the row is still locked: it cannot grant later.
                await loop.run_in_executor(watching, gone, watch, attempt)

    async_to_sync(scenario)()
    no_session_left(watch, "pg_lease_django hold")
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


# -- hold()'s own connections: its enter and its exit interrupted at each statement ----------------------


class _HoldStatements:
    """An execute wrapper on each lease connection of ``hold()`` (`lease_pool`) opened while it is installed.

    Django's ``connection_created`` signal attaches it to each of those connections (they are Django
    connections of their own, named ``pg_lease_django hold``), with no hook in the package. It counts
    the statements sent from the time it is `arm`-ed and raises `_Interrupted` just before or just
    after the ones it is armed for, in whichever thread sends them (the thread entering or leaving a sync hold,
    an async hold's own thread). The heartbeat's renewals are not counted (a TTL of 60 s puts the
    first one 20 s after the grant; they run on threads of their own).

    ``contender``: ``(key, owner, epoch)`` released from ``side`` just after the first acquire
    attempt has been answered (refused): a blocking hold then waits, is notified and attempts again,
    with no timing involved.
    """

    def __init__(self, side: psycopg.Connection[Any]) -> None:
        self.side = side
        self.sent: list[str] = []
        self.at: dict[int, str] = {}
        self.contender: tuple[str, str, int] | None = None

    def arm(self, at: dict[int, str] | None = None) -> None:
        """Count from here; interrupt just ``at[n]`` ("before" or "after") the ``n``-th statement."""
        self.sent, self.at = [], at or {}

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if threading.current_thread().name.startswith("pg_lease heartbeat"):
            return execute(sql, params, many, context)
        self.sent.append(sql)
        when = self.at.get(len(self.sent))
        if when == "before":
            self.interrupt()
        result = execute(sql, params, many, context)
        if self.contender is not None and "pg_lease_acquire" in sql:
            contender, self.contender = self.contender, None
            self.side.execute("SELECT * FROM pg_lease_release(%s::text, %s::text, %s::bigint)", list(contender))
        if when == "after":
            self.interrupt()
        return result

    def interrupt(self) -> None:
        """What lands at an armed point: a signal handler's exception (tests/db/test_interrupts_jobs.py adds others)."""
        raise _Interrupted


@contextmanager
def hold_statements(
    raw_connect: Connect, kind: Callable[[psycopg.Connection[Any]], _HoldStatements] = _HoldStatements
) -> Iterator[_HoldStatements]:
    """Install a ``kind`` of `_HoldStatements` on the lease connections ``hold()`` opens in the block."""
    from django.db.backends.signals import connection_created

    from pg_lease_django.holds import lease_connection, lease_pool

    statements = kind(raw_connect())

    def attach(sender: Any, connection: Any, **kwargs: Any) -> None:
        options = connection.settings_dict.get("OPTIONS") or {}
        ours = options.get("application_name") == lease_connection.APPLICATION_NAME
        if ours and statements not in connection.execute_wrappers:
            connection.execute_wrappers.append(statements)

    lease_pool.close_connections()  # each lease connection of the block is opened in it
    connection_created.connect(attach, weak=False)
    try:
        yield statements
    finally:
        connection_created.disconnect(attach)
        lease_pool.close_connections()


def _in_a_hold(
    mode: str, key: str, owner: str, blocking: bool, body: Callable[[Any], None], before: Callable[[], None]
) -> None:
    """``before()``, then ``body(lease)`` inside ``hold(key, 60, owner=owner)``: a ``with`` or an ``async with``."""
    timeout = HANG_GUARD if blocking else None  # a hold that waited forever would fail, not hang
    _fresh_lease_connections()
    before()
    if mode == "sync":
        with hold(key, 60, owner=owner, blocking=blocking, timeout=timeout) as lease:
            body(lease)
        return

    async def scenario() -> None:
        async with hold(key, 60, owner=owner, blocking=blocking, timeout=timeout) as lease:
            body(lease)

    async_to_sync(scenario)()


def _fresh_lease_connections() -> None:
    # Each hold opens a lease connection of its own, so that every run sends the same statements
    # (a reused connection skips its session's setup): the pool keeps idle ones between holds.
    from pg_lease_django.holds import lease_pool

    lease_pool.close_connections()


def _no_hold_left(key: str) -> None:
    from pg_lease_django.holds.scheduler import active_holds

    assert [lease for lease in active_holds() if lease.key.startswith(key)] == []  # no heartbeat renewing


def _no_hold_session_left(watch: psycopg.Connection[Any]) -> None:
    # Behind PgBouncer the server sessions are the pooler's (and may keep the name): not checked there.
    if not POOLED:
        no_session_left(watch, "pg_lease_django hold")


HOLD_CASES = [
    pytest.param("sync", "free", id="sync-non-blocking"),
    pytest.param("sync", "blocking", id="sync-blocking"),
    pytest.param("sync", "contended", id="sync-blocking-contended"),
    pytest.param("async", "free", id="async-non-blocking"),
    pytest.param("async", "blocking", id="async-blocking"),
    pytest.param("async", "contended", id="async-blocking-contended"),
]


@pytest.mark.parametrize(("mode", "how"), HOLD_CASES)
def test_a_hold_interrupted_at_every_statement_of_its_enter_holds_nothing(
    key: str, raw_connect: Connect, mode: str, how: str
) -> None:
    """``hold()``'s enter (the acquire on its own lease connections) interrupted just before and just
    after each statement it sends: the body never runs, the interrupted owner holds nothing, no
    heartbeat is left renewing. "contended": a blocking hold whose first attempt is refused (a
    contender holds the key and releases it as soon as that attempt is answered), so its wait is
    explored too (LISTEN, the refused attempt, the granting one, UNLISTEN and what follows)."""
    blocking = how != "free"
    watch = raw_connect()

    def prepare(target: str) -> Callable[[], None]:
        def before() -> None:
            if how == "contended":
                statements.contender = (target, "contender", held(target, "contender", ttl=60))

        return before

    def never(lease: Any) -> None:
        pytest.fail("the body of an interrupted hold ran")

    with hold_statements(raw_connect) as statements:
        # The enter's statements: those sent before the body runs (the rest are the exit's).
        entered: list[str] = []
        count = f"{key}/count"
        _in_a_hold(mode, count, "w-count", blocking, lambda lease: entered.extend(statements.sent), prepare(count))
        sent, steps = entered, len(entered)
        _no_hold_left(key)
        assert Lease.objects.inspect(count).status == "free"
        assert any("pg_lease_acquire" in sql for sql in sent)
        if how == "contended":
            assert sum("pg_lease_acquire" in sql for sql in sent[:steps]) == 2, sent
        for step in range(1, steps + 1):
            for when in ("before", "after"):
                target = f"{key}/{step}/{when}"
                statements.arm({step: when})
                with pytest.raises(_Interrupted):
                    _in_a_hold(mode, target, "w-int", blocking, never, prepare(target))
                state = Lease.objects.inspect(target)
                assert not (state.status == "held" and state.owner == "w-int"), (step, when, statements.sent[:step])
                _no_hold_left(key)
    _no_hold_session_left(watch)


@pytest.mark.parametrize(("mode", "how"), [case for case in HOLD_CASES if case.values[1] != "contended"])
def test_a_hold_interrupted_at_every_statement_of_its_exit_still_releases(
    key: str, raw_connect: Connect, mode: str, how: str
) -> None:
    """``hold()``'s exit (the release on its own lease connections) interrupted just before and just
    after each statement it sends: the interruption goes on, and the lease is free afterwards
    (completed the way ``Lease.objects.release`` completes an interrupted release: the owner is
    leaving, its lease must not wait for its TTL), with no heartbeat left renewing."""
    blocking = how != "free"
    watch = raw_connect()
    granted: list[int] = []

    def count(lease: Any) -> None:
        granted.append(lease.epoch)
        statements.arm()  # count the exit's statements only

    with hold_statements(raw_connect) as statements:
        _in_a_hold(mode, f"{key}/count", "w-count", blocking, count, lambda: None)
        steps = len(statements.sent)
        assert any("pg_lease_release" in sql for sql in statements.sent), statements.sent
        for step in range(1, steps + 1):
            for when in ("before", "after"):
                target = f"{key}/{step}/{when}"

                def interrupt_exit(lease: Any) -> None:
                    granted.append(lease.epoch)
                    statements.arm({step: when})  # noqa: B023 - called before the loop moves on

                with pytest.raises(_Interrupted):
                    _in_a_hold(mode, target, "w-int", blocking, interrupt_exit, lambda: None)
                state = Lease.objects.inspect(target)
                # Before the fix: held by the gone owner until its TTL (and the interrupt swallowed).
                assert (state.status, state.epoch) == ("free", granted[-1] + 1), (step, when, statements.sent)
                _no_hold_left(key)
    _no_hold_session_left(watch)


# -- a second interruption while the first is settled --------------------------------------------------


def _first_and_again(sent: list[str], first: int) -> Iterator[dict[int, str]]:
    """A first interruption just after statement ``first``, then again before or after each later one of ``sent``."""
    for again in range(first + 1, len(sent) + 1):
        for when in ("before", "after"):
            yield {first: "after", again: when}


def _index_of(sent: list[str], fragment: str) -> int:
    """The 1-based position of the first statement of ``sent`` that contains ``fragment``."""
    return next(index for index, sql in enumerate(sent, 1) if fragment in sql)


@pytest.mark.parametrize("blocking", [False, True], ids=["non-blocking", "blocking"])
def test_an_acquire_interrupted_again_while_it_is_settled_leaves_nothing_granted(key: str, blocking: bool) -> None:
    """The worst moment (the grant committed, its answer not returned), then a second interruption
    (a second signal) at each statement of the settling: the settling starts over, the grant is
    released, and an interruption goes on."""
    from django.db import connection

    wrapper, sent = _interrupts({})
    with connection.execute_wrapper(wrapper):
        assert Lease.objects.acquire(f"{key}/count", "w-count", ttl=60, blocking=blocking) is not None
    granting = _index_of(sent, "pg_lease_acquire")
    wrapper, sent = _interrupts({granting: "after"})
    with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
        Lease.objects.acquire(f"{key}/once", "w-int", ttl=60, blocking=blocking)
    assert len(sent) > granting  # the settling's statements
    for number, at in enumerate(_first_and_again(sent, granting)):
        target = f"{key}/{number}"
        wrapper, _ = _interrupts(at)
        with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
            Lease.objects.acquire(target, "w-int", ttl=60, blocking=blocking)
        state = Lease.objects.inspect(target)
        # Before the fix the second interruption cut the settling short: held until the TTL.
        assert not (state.status == "held" and state.owner == "w-int"), (at, sent)


def test_a_release_interrupted_again_while_it_is_completed_still_releases(key: str) -> None:
    """A release interrupted before its statement, then again at each statement of its completion."""
    from django.db import connection

    grant = Lease.objects.acquire(f"{key}/once", "w", ttl=60)
    assert grant is not None
    wrapper, sent = _interrupts({1: "before"})
    with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
        Lease.objects.release(grant.key, "w", grant.epoch)
    assert len(sent) > 1  # the completion's statements
    for again in range(2, len(sent) + 1):
        for when in ("before", "after"):
            target = f"{key}/{again}/{when}"
            grant = Lease.objects.acquire(target, "w", ttl=60)
            assert grant is not None
            wrapper, _ = _interrupts({1: "before", again: when})
            with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
                Lease.objects.release(target, "w", grant.epoch)
            state = Lease.objects.inspect(target)
            assert (state.status, state.epoch) == ("free", grant.epoch + 1), (again, when, sent)


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_a_hold_interrupted_again_while_it_is_settled_holds_nothing(key: str, raw_connect: Connect, phase: str) -> None:
    """``hold()``'s enter interrupted just after its granting attempt, or its exit just before its
    release, then again at each statement of the settling (or the completion of the release)."""
    watch = raw_connect()
    granted: list[int] = []
    first = [0]

    def interrupt_exit(at: dict[int, str]) -> Callable[[Any], None]:
        def body(lease: Any) -> None:
            granted.append(lease.epoch)
            statements.arm(at)

        return body

    with hold_statements(raw_connect) as statements:
        if phase == "enter":
            statements.arm()
            _in_a_hold("sync", f"{key}/count", "w-count", False, lambda lease: None, lambda: None)
            first[0] = _index_of(statements.sent, "pg_lease_acquire")
            statements.arm({first[0]: "after"})
            with pytest.raises(_Interrupted):
                _in_a_hold("sync", f"{key}/once", "w-int", False, lambda lease: None, lambda: None)
        else:
            _in_a_hold("sync", f"{key}/count", "w-count", False, interrupt_exit({}), lambda: None)
            first[0] = _index_of(statements.sent, "pg_lease_release") - 1
            with pytest.raises(_Interrupted):
                _in_a_hold("sync", f"{key}/once", "w-int", False, interrupt_exit({first[0]: "after"}), lambda: None)
        sent = list(statements.sent)
        assert len(sent) > first[0] + 1, sent  # the settling's statements
        for number, at in enumerate(_first_and_again(sent, first[0])):
            target = f"{key}/{number}"
            with pytest.raises(_Interrupted):
                if phase == "enter":
                    statements.arm(at)
                    _in_a_hold("sync", target, "w-int", False, lambda lease: None, lambda: None)
                else:
                    _in_a_hold("sync", target, "w-int", False, interrupt_exit(at), lambda: None)
            state = Lease.objects.inspect(target)
            assert not (state.status == "held" and state.owner == "w-int"), (at, sent)
            _no_hold_left(key)
    _no_hold_session_left(watch)


# -- finding 7's last item: an interrupt at any instruction of a sync hold's own bookkeeping -----------


def _codes(phase: str) -> set[Any]:
    """The code of ``hold()``'s enter (after the statements: they are explored above) or its exit."""
    from pg_lease_django.holds import heartbeat, holding, session
    from pg_lease_django.holds import lease as held

    if phase == "enter":
        functions: list[Any] = [
            holding.Holding.__enter__,
            holding.Holding._push,
            session.HoldSession.start,
            heartbeat.Heartbeat.start,
        ]
    else:
        functions = [
            holding.Holding.__exit__,
            holding.Holding._pop,
            session.HoldSession.finish,
            held.Tenure.end,
            heartbeat.Heartbeat.finish,
            heartbeat.Heartbeat._finish,
        ]
    return {function.__code__ for function in functions}


_NO_SIGNAL_CHECK = {dis.opmap["RETURN_VALUE"], dis.opmap["NOP"]}


@contextmanager
def _interrupt_at_instruction(codes: set[Any], number: int) -> Iterator[list[str]]:
    """Raise `_Interrupted` at the ``number``-th bytecode instruction run in ``codes`` (0: never), in this thread.

    A signal's handler runs between two instructions of the main thread (at some of them: these are
    all of them but returns and no-ops), so this is every place a signal can interrupt this code, one
    per run, but one: the first instruction of a function (where CPython checks for signals too) is
    not traced. There, at the very start of ``Holding.__exit__``, no handler of ours can run (gh-74174).
    """
    seen: list[str] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        # Not before a return or a no-op: CPython checks for signals at calls and backward jumps
        # (and on entering a function: not traced here), never there.
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] not in _NO_SIGNAL_CHECK:
            seen.append(f"{frame.f_code.co_name}:{frame.f_lasti}")
            if len(seen) == number:
                raise _Interrupted
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code not in codes:
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        return local

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield seen
    finally:
        sys.settrace(previous)


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_a_sync_hold_interrupted_at_every_instruction_of_its_bookkeeping_leaves_nothing(key: str, phase: str) -> None:
    """``with hold()`` interrupted at each bytecode instruction of its enter (``Holding.__enter__`` and
    what it runs once the lease is granted) or of its exit (down to the release): afterwards nothing
    is held by the interrupted owner, no heartbeat renews it, and no lease is left current."""
    from pg_lease_django import current_lease

    codes = _codes(phase)

    def run(target: str, number: int) -> list[str]:
        if phase == "enter":
            with _interrupt_at_instruction(codes, number) as seen, hold(target, 60, owner="w-int"):
                pass
            return seen
        with hold(target, 60, owner="w-int"):
            tracing = _interrupt_at_instruction(codes, number)
            seen = tracing.__enter__()
        tracing.__exit__(None, None, None)
        return seen

    where = run(f"{key}/count", 0)
    instructions = len(where)
    assert instructions > 20
    failures = []
    for number in range(1, instructions + 1):
        target = f"{key}/{number}"
        try:
            run(target, number)
        except _Interrupted:
            pass
        else:
            failures.append((where[number - 1], "not interrupted"))
        state = Lease.objects.inspect(target)
        if state.status == "held" and state.owner == "w-int":
            failures.append((where[number - 1], "held"))
        if any(lease.key == target for lease in _active_holds()):
            failures.append((where[number - 1], "renewed"))
        if current_lease(target) is not None:
            failures.append((where[number - 1], "current"))
    assert failures == [], " ".join(f"{place}/{what}" for place, what in failures)


def _active_holds() -> list[Any]:
    from pg_lease_django.holds.scheduler import active_holds

    return active_holds()


# -- a cancelled non-blocking aacquire ------------------------------------------------------------------


def test_a_cancelled_non_blocking_aacquire_is_cancelled_on_the_server(key: str, raw_connect: Connect) -> None:
    """A non-blocking ``aacquire`` (its statement in a thread, on the lease pool) cancelled while
    its statement waits on a row lock: the statement is cancelled on the server while the row is
    still locked, so it cannot grant later, and the cancellation goes on."""
    epoch = free(key)
    watch = raw_connect()

    async def scenario() -> None:
        with row_locked(raw_connect, key) as locker:
            task = asyncio.ensure_future(Lease.objects.aacquire(key, "w-cancelled", ttl=60))
            with ThreadPoolExecutor(max_workers=1) as watching:
                loop = asyncio.get_running_loop()
                attempt = await loop.run_in_executor(watching, blocked_behind, watch, locker)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Before the fix the statement ran on in its thread and granted once the lock went.
                # Cancelled on the server while the row is still locked.
                await loop.run_in_executor(watching, not_running, watch, attempt)

    async_to_sync(scenario)()
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


@contextmanager
def on_lease_connections(wrapper: Callable[..., Any]) -> Iterator[None]:
    """Install the execute ``wrapper`` on the lease connections opened in the block (the lease pool's,
    which ``hold()`` and the async calls of ``Lease.objects`` use outside a transaction)."""
    from django.db.backends.signals import connection_created

    from pg_lease_django.holds import lease_connection, lease_pool

    def attach(sender: Any, connection: Any, **kwargs: Any) -> None:
        if (connection.settings_dict.get("OPTIONS") or {}).get("application_name") == lease_connection.APPLICATION_NAME:
            connection.execute_wrappers.append(wrapper)

    lease_pool.close_connections()  # each lease connection of the block is opened in it
    connection_created.connect(attach, weak=False)
    try:
        yield
    finally:
        connection_created.disconnect(attach)
        lease_pool.close_connections()


def test_a_non_blocking_aacquire_cancelled_after_its_grant_committed_releases_it(key: str) -> None:
    """The worst moment: the grant has committed in its thread and the task is cancelled before it
    gets the answer (the statement's answer is held up by an execute wrapper until the cancellation
    has landed). The grant is released before the cancellation goes on."""
    epoch = free(key)
    answered, cancelled = threading.Event(), threading.Event()

    def hold_up_the_answer(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "pg_lease_acquire" in sql:
            answered.set()
            assert cancelled.wait(HANG_GUARD)
        return result

    async def scenario() -> None:
        task = asyncio.ensure_future(Lease.objects.aacquire(key, "w-cancelled", ttl=60))
        await asyncio.get_running_loop().run_in_executor(None, answered.wait, HANG_GUARD)
        task.cancel()
        await asyncio.sleep(0)  # the cancellation lands in the task
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    with on_lease_connections(hold_up_the_answer):
        async_to_sync(scenario)()
    state = Lease.objects.inspect(key)
    # Before the fix: held by the cancelled caller for its 60 s TTL.
    assert (state.status, state.epoch) == ("free", epoch + 2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hold_at_least_exit_interrupted_at_every_statement_still_keeps_only_until_then(
    key: str, raw_connect: Connect, mode: str
) -> None:
    """With ``hold_at_least``, the exit's last move is a renewal to exactly the time left (not a
    release). Interrupted just before or just after each of its statements, it is made again before
    the interruption goes on: the lease then lapses at ``grant + hold_at_least``, not at its TTL."""
    watch = raw_connect()
    grants: list[Any] = []

    def run(target: str, at: dict[int, str]) -> None:
        _fresh_lease_connections()

        def body(lease: Any) -> None:
            grants.append(lease.expires_at)
            statements.arm(at)

        if mode == "sync":
            with hold(target, 60, owner="w-int", hold_at_least=20) as lease:
                body(lease)
            return

        async def scenario() -> None:
            async with hold(target, 60, owner="w-int", hold_at_least=20) as lease:
                body(lease)

        async_to_sync(scenario)()

    with hold_statements(raw_connect) as statements:
        run(f"{key}/count", {})
        sent = list(statements.sent)
        assert any("pg_lease_heartbeat" in sql for sql in sent), sent
        for step in range(1, len(sent) + 1):
            for when in ("before", "after"):
                target = f"{key}/{step}/{when}"
                with pytest.raises(_Interrupted):
                    run(target, {step: when})
                state = Lease.objects.inspect(target)
                # Granted for 60 s; kept until 20 s after the grant (server clock), give or take a round trip.
                assert state.status == "held" and state.expires_at <= grants[-1] - timedelta(seconds=30), (
                    step,
                    when,
                    state,
                )
                _no_hold_left(key)
    _no_hold_session_left(watch)


# -- a second cancellation while an async acquire is settled ------------------------------------------


def test_a_blocking_aacquire_cancelled_again_while_it_is_settled_still_releases_its_grant(
    key: str, raw_connect: Connect
) -> None:
    """The worst moment (the grant committed, its answer not read: this test holds the event loop),
    the task cancelled, then cancelled again while the settling's release waits for the row (another
    session holds it FOR UPDATE): the settling goes on to its end (`settled_anyway`) and the grant
    is released before the cancellation goes on. Before: the second cancellation cut it short, and
    the grant stayed with the cancelled caller for its 60 s TTL."""
    epoch = free(key)
    watch = raw_connect()
    owner = "w-twice"

    async def scenario() -> None:
        with row_locked(raw_connect, key) as locker:
            task = asyncio.ensure_future(Lease.objects.aacquire(key, owner, ttl=60, blocking=True))
            attempt = await asyncio.to_thread(blocked_behind, watch, locker)
        not_running(watch, attempt)  # in this thread: the task cannot read the grant's answer meanwhile
        assert watch.execute("SELECT owner FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone() == (owner,)
        with row_locked(raw_connect, key) as locker:  # the settling's release will wait for this row
            task.cancel()
            releaser = await asyncio.to_thread(blocked_behind, watch, locker)
            task.cancel()  # again, while the release waits
            await asyncio.sleep(0.05)
            assert not task.done()  # still settling
        await asyncio.to_thread(not_running, watch, releaser)
        with pytest.raises(asyncio.CancelledError):
            await task

    async_to_sync(scenario)()
    no_session_left(watch, f"pg_lease_django wait {owner}")
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 2), state  # granted, then released by the settling


def test_a_non_blocking_aacquire_cancelled_again_while_it_is_settled_still_releases_its_grant(
    key: str, raw_connect: Connect
) -> None:
    """As above for the non-blocking ``aacquire`` (its statement in a thread): the grant's answer is
    held up until the first cancellation has landed, the settling's release waits for a row another
    session locks, and a second cancellation lands meanwhile."""
    epoch = free(key)
    watch = raw_connect()
    answered, cancelled = threading.Event(), threading.Event()

    def hold_up_the_answer(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "pg_lease_acquire" in sql:
            answered.set()
            assert cancelled.wait(HANG_GUARD)
        return result

    async def scenario() -> None:
        task = asyncio.ensure_future(Lease.objects.aacquire(key, "w-twice", ttl=60))
        await asyncio.to_thread(answered.wait, HANG_GUARD)
        with row_locked(raw_connect, key) as locker:
            task.cancel()
            await asyncio.sleep(0)  # the cancellation lands in the task
            cancelled.set()
            releaser = await asyncio.to_thread(blocked_behind, watch, locker)
            task.cancel()  # again, while the settling's release waits
            await asyncio.sleep(0.05)
            assert not task.done()
        await asyncio.to_thread(not_running, watch, releaser)
        with pytest.raises(asyncio.CancelledError):
            await task

    with on_lease_connections(hold_up_the_answer):
        async_to_sync(scenario)()
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 2), state


def test_a_fourth_interruption_of_the_settling_gives_up_and_says_so(key: str, caplog: pytest.LogCaptureFixture) -> None:
    """The settling starts over at each interruption, three times; a fourth ends it at once, and what
    it was settling is left to lapse at its TTL, logged at ERROR with the key and the owner (not
    silently): the bound on how long interruptions can keep a caller in the settling."""
    from django.db import connection

    wrapper, sent = _interrupts({})
    with connection.execute_wrapper(wrapper):
        assert Lease.objects.acquire(f"{key}/count", "w-count", ttl=60) is not None
    granting = _index_of(sent, "pg_lease_acquire")
    wrapper, sent = _interrupts({granting: "after"})
    with connection.execute_wrapper(wrapper), pytest.raises(_Interrupted):
        Lease.objects.acquire(f"{key}/once", "w-int", ttl=60)
    per_run = len(sent) - granting  # the statements of one run of the settling
    # Interrupt the first statement of each run of the settling (each run starts with the next one
    # sent): four runs, four interruptions.
    at = {granting: "after", **{granting + run: "before" for run in range(1, 5)}}
    target = f"{key}/given-up"
    wrapper, sent = _interrupts(at)
    with (
        caplog.at_level("WARNING", logger="pg_lease_django"),
        connection.execute_wrapper(wrapper),
        pytest.raises(_Interrupted),
    ):
        Lease.objects.acquire(target, "w-int", ttl=60)
    assert per_run >= 2
    given_up = [r for r in caplog.records if r.levelname == "ERROR" and "giving up" in r.getMessage()]
    assert len(given_up) == 1, [r.getMessage() for r in caplog.records]
    assert repr(target) in given_up[0].getMessage() and "'w-int'" in given_up[0].getMessage()
    assert len([r for r in caplog.records if "starting over" in r.getMessage()]) == 3
