"""Issue 44: the statement-by-statement interrupt harness over what is built on ``hold()``.

``@leased`` (sync and async), ``elect()`` and ``aelect()`` are interrupted just before and just
after each statement they send on their lease connections (`_HoldStatements` of
tests/db/test_interrupts.py): by a signal handler's exception raised where the statement is sent, and
by each call's own way of being stopped there (``Election.stop()``, a cancellation of the task).
``leases run`` (plain, ``--wait``, ``--campaign``) gets a real SIGTERM or SIGINT at each of its
statements (`tests.children.interrupted_run`). Each test is one point: a statement's index and before/after.
The number of statements of each call is pinned (`POINTS`): a change in what a call sends shows
here first, and the table of points stays what the tests say it is.

After each interruption: the call has ended (it raised the interruption, or returned), nothing is
granted to the interrupted owner (read from another session), no heartbeat renews it, and no
session of ours is left idle in a transaction.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync

from pg_lease_django import aelect, current_election, elect, leased
from tests.db.test_command_run import LeasesRun
from tests.db.test_interrupts import (
    CHILD,
    HANG_GUARD,
    Connect,
    _fresh_lease_connections,
    _HoldStatements,
    _Interrupted,
    _no_hold_left,
    _no_hold_session_left,
    hold_statements,
    no_session_left,
)
from tests.helpers import held, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: Behind PgBouncer (transaction pooling) a blocking hold polls: no LISTEN, UNLISTEN or check of the
#: channels listened to, so fewer statements (`POINTS` below).
POOLED = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))

#: The statements each call sends on its lease connections, by form: the points are each one's
#: before and after.
POINTS: dict[str, int] = {
    "leased/free": 3,
    "leased/blocking": 5,
    "leased/contended": 7,
    "elect/free": 3,
    "elect/contended": 4,
    "run/plain": 4,
    "run/wait": 6,
    "run/campaign": 4,
}
if POOLED:
    POINTS.update({"leased/blocking": 3, "leased/contended": 4})


def _points(call: str) -> list[Any]:
    """``(step, when)`` for each point of ``call``: before and after each of its statements."""
    return [
        pytest.param(step, when, id=f"{step}-{when}")
        for step in range(1, POINTS[call] + 1)
        for when in ("before", "after")
    ]


def _check_count(call: str, sent: list[str]) -> None:
    """The counting run sent the pinned number of statements."""
    assert len(sent) == POINTS[call], (call, len(sent), sent)


def _settled(watch: psycopg.Connection[Any], target: str, owner: str, said: str = "") -> None:
    """Nothing of ``target`` granted to ``owner`` (gone), and no session left idle in a transaction.

    ``said``: what the interrupted process wrote to stderr, shown when a grant is found left, since
    the settling logs there why it could not release one.
    """
    row = watch.execute(
        "SELECT owner, expires_at > clock_timestamp() FROM pg_lease_django_lease WHERE key = %s", [target]
    ).fetchone()
    assert row is None or row[0] != owner or not row[1], (row, said)
    idle = watch.execute(
        "SELECT pid, application_name, left(query, 120) FROM pg_stat_activity"
        " WHERE datname = current_database() AND state LIKE 'idle in transaction%%'"
    ).fetchall()
    assert idle == []


# -- @leased: a job's call, sync and async -----------------------------------------------------------


def _call_leased(mode: str, target: str, owner: str, how: str, body: Callable[[], None]) -> None:
    """Call a function decorated ``@leased(target, ...)`` (``def`` or ``async def``) whose body is ``body()``."""
    blocking = how != "free"
    timeout = HANG_GUARD if blocking else None  # a wait that never ended would fail, not hang
    _fresh_lease_connections()
    decorate = leased(target, ttl=60, owner=owner, blocking=blocking, timeout=timeout, on_busy="raise")
    if mode == "sync":

        @decorate
        def job() -> None:
            body()

        job()
        return

    @decorate
    async def ajob() -> None:
        body()

    async_to_sync(ajob)()


LEASED_CASES = [
    (mode, how, step, when)
    for mode in ("sync", "async")
    for how in ("free", "blocking", "contended")
    for step in range(1, POINTS[f"leased/{how}"] + 1)
    for when in ("before", "after")
]


@pytest.mark.parametrize(
    ("mode", "how", "step", "when"),
    [pytest.param(*case, id="-".join(map(str, case))) for case in LEASED_CASES],
)
def test_a_leased_call_interrupted_at_a_statement_leaves_nothing_granted(
    key: str, raw_connect: Connect, mode: str, how: str, step: int, when: str
) -> None:
    """A ``@leased`` call interrupted just ``when`` its ``step``-th statement (its hold's enter, then
    its exit): the interruption goes on, the body runs only if the enter was over, and the lease is
    not left to the interrupted owner (an interrupted exit still releases: free, one epoch on)."""
    watch = raw_connect()
    ran: list[int] = []
    with hold_statements(raw_connect) as statements:

        def prepare(target: str) -> None:
            if how == "contended":  # a holder that lets go as soon as the first attempt is refused
                statements.contender = (target, "contender", held(target, "contender", ttl=60))

        count = f"{key}/count"
        prepare(count)
        statements.arm()
        _call_leased(mode, count, "w-count", how, lambda: ran.append(len(statements.sent)))
        _check_count(f"leased/{how}", statements.sent)
        entered = ran.pop()
        assert any("pg_lease_release" in sql for sql in statements.sent[entered:]), statements.sent

        target = f"{key}/{step}/{when}"
        prepare(target)
        statements.arm({step: when})
        with pytest.raises(_Interrupted):
            _call_leased(mode, target, "w-int", how, lambda: ran.append(len(statements.sent)))
        assert len(ran) == (1 if step > entered else 0)  # the body ran once the enter was over
        _settled(watch, target, "w-int")
        if step > entered:
            state = watch.execute("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = %s", [target]).fetchone()
            assert state is not None and state[0] is None, state  # released by the interrupted exit
        _no_hold_left(key)
    _no_hold_session_left(watch)


# -- elect() and aelect(): one term's campaign ---------------------------------------------------------


class _Stops(_HoldStatements):
    """At an armed point: ``Election.stop()`` (what a SIGTERM in ``with elect()`` calls) from the election's
    thread, that is, exactly between two of its statements; its interrupt of the attempt in flight
    (a thread of its own) is let finish before the statement is sent or its answer returned."""

    def interrupt(self) -> None:
        election = current_election()
        assert election is not None, "a statement of the election sent outside its thread"
        election.stop()
        _join_threads("pg_lease election stop")


class _Cancels(_HoldStatements):
    """At an armed point: ``aelect()``'s task cancelled (asyncio.timeout, a shutdown), from the worker
    thread sending the statement, which waits until the cancellation has landed in the task (and its
    interrupt of the attempt in flight has finished) before it sends the statement or returns its answer."""

    task: asyncio.Task[Any]
    loop: asyncio.AbstractEventLoop

    def interrupt(self) -> None:
        landed = threading.Event()

        def cancel() -> None:  # the event loop's thread
            self.task.cancel()
            self.loop.call_soon(landed.set)  # after the task's step that the cancellation schedules

        self.loop.call_soon_threadsafe(cancel)
        assert landed.wait(HANG_GUARD)
        _join_threads("pg_lease hold cancelled")


def _join_threads(name: str) -> None:
    for thread in threading.enumerate():
        if thread.name == name and thread is not threading.current_thread():
            thread.join(HANG_GUARD)
            assert not thread.is_alive()


def _campaign(mode: str, target: str, owner: str, statements: _HoldStatements, led: list[int]) -> None:
    """One term of ``elect()`` or ``aelect()`` for ``target``: lead (``led`` gets the statements sent by
    then), step down and stop (``stop()``; the task cancelled once stepped down). Raises what ended it."""
    _fresh_lease_connections()
    if mode == "sync":

        def lead(lease: Any) -> None:
            led.append(len(statements.sent))
            election = current_election()
            assert election is not None
            election.stop()

        election = elect(target, ttl=60, owner=owner, on_started_leading=lead, on_stopped_leading=lambda: None)
        assert election.join(HANG_GUARD)  # a hang guard: the thread ends once stopped
        return

    async def scenario() -> None:
        async def alead(lease: Any) -> None:
            led.append(len(statements.sent))

        def stopped() -> None:
            task.cancel()  # the campaign's one term is over

        task = asyncio.ensure_future(
            aelect(target, ttl=60, owner=owner, on_started_leading=alead, on_stopped_leading=stopped)
        )
        if isinstance(statements, _Cancels):
            statements.task, statements.loop = task, asyncio.get_running_loop()
        await asyncio.wait_for(asyncio.shield(task), HANG_GUARD)  # a hang guard

    async_to_sync(scenario)()


ELECT_FORMS = {"sync": ("raise", "stop"), "async": ("raise", "cancel")}
ELECT_CASES = [
    (mode, form, how, step, when)
    for mode, forms in ELECT_FORMS.items()
    for form in forms
    for how in ("free", "contended")
    for step in range(1, POINTS[f"elect/{how}"] + 1)
    for when in ("before", "after")
]


@pytest.mark.parametrize(
    ("mode", "form", "how", "step", "when"),
    [pytest.param(*case, id="-".join(map(str, case))) for case in ELECT_CASES],
)
def test_an_election_interrupted_at_a_statement_leaves_nothing_granted(
    key: str,
    raw_connect: Connect,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    form: str,
    how: str,
    step: int,
    when: str,
) -> None:
    """One term of ``elect()`` (``mode="sync"``) or ``aelect()`` interrupted just ``when`` its ``step``-th
    statement: by an exception raised there (``form="raise"``: the election's thread, or the async
    hold's worker thread), by ``stop()`` or by the task's cancellation. The campaign ends (the
    thread; the task raises the interruption), leads only if its attempt was over, and leaves
    nothing granted to its owner. "contended": the first attempt is refused (a holder lets go as
    soon as it is answered), so a refused attempt and the next one are explored too."""
    settings.PG_LEASE_POLL_INTERVAL = 0.05  # the rest between a refused attempt and the next
    watch = raw_connect()
    led: list[int] = []
    kind = {"raise": _HoldStatements, "stop": _Stops, "cancel": _Cancels}[form]
    with hold_statements(raw_connect, kind) as statements:

        def prepare(target: str) -> None:
            if how == "contended":
                statements.contender = (target, "contender", held(target, "contender", ttl=60))

        count = f"{key}/count"
        prepare(count)
        statements.arm()
        if mode == "sync":
            _campaign(mode, count, "w-count", statements, led)
        else:
            with pytest.raises(asyncio.CancelledError):
                _campaign(mode, count, "w-count", statements, led)
        _check_count(f"elect/{how}", statements.sent)
        entered = led.pop()
        assert any("pg_lease_release" in sql for sql in statements.sent[entered:]), statements.sent
        _settled(watch, count, "w-count")

        target = f"{key}/{step}/{when}"
        prepare(target)
        statements.arm({step: when})
        if form == "raise":
            if mode == "sync":  # the thread ends, logging its crash
                _campaign(mode, target, "w-int", statements, led)
                assert any("crashed" in record.getMessage() for record in caplog.records)
            else:
                with pytest.raises(_Interrupted):
                    _campaign(mode, target, "w-int", statements, led)
        elif form == "stop":
            _campaign(mode, target, "w-int", statements, led)
        else:
            with pytest.raises(asyncio.CancelledError):
                _campaign(mode, target, "w-int", statements, led)
        # Led only once the attempt won; stopped just after the grant was answered, the term is
        # still led, the callback seeing the stop at once (``Election._attempt``), and released.
        leads = step > entered or (form == "stop" and (step, when) == (entered, "after"))
        assert len(led) == (1 if leads else 0), (led, entered)
        if form == "cancel":  # a cancelled exit goes on in its thread (shielded): wait for it to end
            # (its heartbeat unregistered after the release: both are waited for)
            wait_until(
                lambda: not _granted(watch, target, "w-int") and not _holds_of(key), HANG_GUARD, "the shielded exit"
            )
        _settled(watch, target, "w-int")
        _no_hold_left(key)
    _no_hold_session_left(watch)


def _holds_of(key: str) -> list[Any]:
    from pg_lease_django.holds.scheduler import active_holds

    return [lease for lease in active_holds() if lease.key.startswith(key)]


def _granted(watch: psycopg.Connection[Any], target: str, owner: str) -> bool:
    row = watch.execute(
        "SELECT owner = %s AND expires_at > clock_timestamp() FROM pg_lease_django_lease WHERE key = %s",
        [owner, target],
    ).fetchone()
    return bool(row and row[0])


# -- leases run: a real signal at each of its statements --------------------------------------------


#: ``leases run``'s forms: its arguments after KEY (MARKER: a file that COMMAND creates). ``--campaign``
#: runs one term: its COMMAND creates the file, then sends ``leases run`` a SIGTERM (which stops the
#: campaign), as a deploy would while it leads.
RUN_FORMS: dict[str, list[str]] = {
    "plain": ["--", *CHILD, "touch", "MARKER"],
    "wait": ["--wait", "30", "--", *CHILD, "touch", "MARKER"],
    "campaign": ["--campaign", "--", "sh", "-c", 'touch "$0" && kill -TERM $PPID', "MARKER"],
}
RUN_CASES = [
    (form, signame, step, when)
    for form, signames in (
        ("plain", ("SIGTERM", "SIGINT")),
        ("wait", ("SIGTERM",)),
        ("campaign", ("SIGTERM", "SIGINT")),
    )
    for signame in signames
    for step in range(1, POINTS[f"run/{form}"] + 1)
    for when in ("before", "after")
]


@pytest.fixture
def runs() -> Iterator[Callable[..., LeasesRun]]:
    """Start ``leases run`` processes (`LeasesRun`), killed at the end of the test if still running."""
    started: list[LeasesRun] = []

    def start(*args: str, **options: Any) -> LeasesRun:
        run = LeasesRun(*args, **options)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


@pytest.fixture(scope="module")
def counted() -> set[str]:
    """The forms of ``leases run`` whose statements this worker has counted. Once per form is enough:
    the count is pinned (`POINTS`), and a counting process per test doubled the cost of each point."""
    return set()


def _leases_run(runs: Callable[..., LeasesRun], target: str, form: str, marker: Path, **environ: str) -> LeasesRun:
    args = [arg.replace("MARKER", str(marker)) for arg in RUN_FORMS[form]]
    return runs(
        target,
        "--ttl",
        "60",
        "--owner",
        "w-run",
        *args,
        entry=["-m", "tests.children.interrupted_run"],
        environ=environ,
    )


@pytest.mark.slow  # 44 processes (and a counting one per form and worker): once per CI run, not per leg
@pytest.mark.parametrize(
    ("form", "signame", "step", "when"),
    [pytest.param(*case, id="-".join(map(str, case))) for case in RUN_CASES],
)
def test_leases_run_signalled_at_a_statement_leaves_nothing_granted(
    key: str,
    raw_connect: Connect,
    runs: Callable[..., LeasesRun],
    counted: set[str],
    tmp_path: Path,
    form: str,
    signame: str,
    step: int,
    when: str,
) -> None:
    """``manage.py leases run`` (``--wait``, ``--campaign``) sent a real SIGTERM or SIGINT just ``when``
    its ``step``-th statement (`tests.children.interrupted_run`): before COMMAND started it exits 128 + N
    and COMMAND never runs; after, the signal goes to COMMAND's group and the run ends as it would
    have. Either way it exits (no hang), its sessions end, none idle in a transaction, and the
    lease is not left granted to the run's owner. The run's statements are counted once per form
    and worker (`counted`)."""
    watch = raw_connect()
    signum = int(getattr(signal, signame))
    if form not in counted:
        log = tmp_path / "statements"
        count = _leases_run(runs, f"{key}/count", form, tmp_path / "count-ran", PG_LEASE_TEST_STATEMENTS=str(log))
        count.finish(HANG_GUARD)
        _check_count(f"run/{form}", log.read_text().splitlines())
        _settled(watch, f"{key}/count", "w-run")
        counted.add(form)

    target, marker = f"{key}/{step}/{when}", tmp_path / "ran"
    run = _leases_run(runs, target, form, marker, PG_LEASE_TEST_SIGNAL_AT=f"{step}:{when}:{signum}")
    code = run.finish(HANG_GUARD)  # a hang guard: it exits
    if marker.exists():  # COMMAND ran: the signal went to it (or, campaigning, stopped the campaign)
        assert code in (0, 128 + signal.SIGTERM, 128 + signum), (code, run.stderr)
    elif code == -signum:  # at its first statement (reading the schema), before its handlers are installed
        assert step == 1, (step, when, run.stderr)
    else:
        assert code == 128 + signum, (code, run.stderr)
        assert "not run" in run.stderr or "stopped campaigning" in run.stderr, run.stderr
    no_session_left(watch, "pg_lease_django%")
    _settled(watch, target, "w-run", run.stderr)
