"""An acquire interrupted from another thread at the two moments a stop can race its answer.

``InFlight.interrupt`` (``Election.stop()`` during a campaign's attempt, a cancelled ``async with
hold()``) shuts the attempt's socket at once when it sees no statement in flight. Seen a moment
before the attempt is sent, or a moment after its answer came, that is wrong in two ways, each seen
once in CI among 44 signalled ``leases run --campaign`` processes (a lease left granted to a run
that had exited):

- **Sent, not yet read.** The attempt's bytes left the client just before the socket was shut; its
  server process (busy, or not scheduled on a loaded machine) reads it later, grants and commits,
  and only then finds its client gone. A settling that looks among the running statements finds
  none, reads the lease free and leaves. It must wait out the interrupted session's server process
  itself (its client closed, it ends once it has answered what it read) before it reads the lease.
- **Answered, not yet returned.** The grant came back and the socket was shut before the call
  was over: the connection went back to the pool looking clean, and the hold's release was sent on
  it, failed, and the grant stayed. A connection whose call was interrupted is never lent again.

Forced here with a real server: its process for the session is stopped (SIGSTOP) until the
settling has looked; the interrupt is run from the statement's own execute wrapper after the answer.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db.backends.signals import connection_created
from psycopg.pq import TransactionStatus

from pg_lease_django import hold
from pg_lease_django.holds.holding import report_next_acquire_to
from pg_lease_django.holds.lease_connection import InFlight, _shut
from tests.db.test_interrupts import HANG_GUARD, _fresh_lease_connections
from tests.helpers import POOLED, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(POOLED, reason="a pooler's pids are its own: settling there finds attempts by marker"),
]

Connect = Callable[..., psycopg.Connection[Any]]


def _is_attempt(sql: str, params: Any) -> bool:
    """Whether an execute wrapper sees an attempt: its marker is in the text, or (bound client-side,
    Django's default) the parameter of the comment the text starts with."""
    return any("pg_lease_django attempt" in str(part) for part in (sql, *(params or ())))


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (PermissionError, ProcessLookupError) as exc:  # a server on another machine, or of another user
        pytest.skip(f"cannot signal the server's processes from here: {exc}")


@contextmanager
def _wrapping(wrapper: Callable[..., Any]) -> Iterator[None]:
    """``wrapper`` around every statement of every connection opened meanwhile (the hold's own)."""

    def attach(sender: Any, connection: Any, **kwargs: Any) -> None:
        if wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(wrapper)

    connection_created.connect(attach, weak=False)
    try:
        yield
    finally:
        connection_created.disconnect(attach)


def _enter_in_a_thread(holding: Any, raised: list[BaseException]) -> threading.Thread:
    def enter() -> None:
        try:
            holding.__enter__()
        except BaseException as exc:  # the interruption, after the settling
            raised.append(exc)
        else:
            holding.__exit__(None, None, None)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    return thread


def _not_granted_to(watch: psycopg.Connection[Any], key: str, owner: str) -> None:
    row = watch.execute(
        "SELECT owner, epoch, expires_at > clock_timestamp() FROM pg_lease_django_lease WHERE key = %s", [key]
    ).fetchone()
    assert row is None or row[0] != owner or not row[2], f"left granted to {owner}, who is gone: {row}"


def test_an_attempt_read_after_the_settling_looked_is_waited_out_and_released(key: str, raw_connect: Connect) -> None:
    """The attempt's server process stopped before the attempt is sent; once sent, the interrupt
    shuts its socket, as it does when it saw no statement in flight a moment earlier; the process
    let go once the settling has looked: the attempt grants after that look, and the settling still
    waits it out and releases it. Nothing is left granted to the owner, whose server process is gone."""
    watch = raw_connect()
    owner = "w-unread"
    stopped, looked = threading.Event(), threading.Event()
    sessions: list[Any] = []
    pids: list[int] = []
    looks = [0]

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if _is_attempt(sql, params) and not sessions:
            sessions.append(context["connection"].connection)
            pids.append(int(sessions[0].info.backend_pid))
            _signal(pids[0], signal.SIGSTOP)
            stopped.set()
        result = execute(sql, params, many, context)
        # The settling has looked: it asked twice whether the attempt still runs (it waits), or it
        # read the lease (it has stopped waiting). Only then may the attempt's process go on.
        if "pg_cancel_backend" in sql:
            looks[0] += 1
            if looks[0] >= 2:
                looked.set()
        elif "pg_lease_inspect" in sql and sessions:
            looked.set()
        return result

    holding = hold(key, 60, owner=owner)
    call = InFlight()
    report_next_acquire_to(holding, call)
    raised: list[BaseException] = []
    with _wrapping(wrapper):
        thread = _enter_in_a_thread(holding, raised)
        try:
            assert stopped.wait(HANG_GUARD), "the attempt was never sent"
            raw = sessions[0]
            wait_until(lambda: raw.info.transaction_status == TransactionStatus.ACTIVE, HANG_GUARD, "the attempt sent")
            call.interrupted = True  # what InFlight.interrupt sets, then (no statement seen in flight) shuts
            _shut(raw)
            assert looked.wait(HANG_GUARD), "the settling never looked for the attempt"
        finally:
            if pids:
                _signal(pids[0], signal.SIGCONT)
        thread.join(HANG_GUARD)
    assert not thread.is_alive(), "the interrupted acquire never returned"
    assert raised, "the acquire returned a grant: the interleaving was not forced"
    pid = pids[0]
    wait_until(
        lambda: watch.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() is None,
        HANG_GUARD,
        "the interrupted session's server process to end",
    )
    _not_granted_to(watch, key, owner)


def test_an_attempt_interrupted_after_its_answer_leaves_a_connection_the_release_does_not_use(
    key: str, raw_connect: Connect, settings: Any
) -> None:
    """The interrupt lands after the grant came back, before the call was over (run from the
    attempt's execute wrapper, once the answer is in): the hold is entered with the grant, and
    leaving it releases the lease, on a connection that was not the interrupted one (one lease
    connection per database: the release would be sent on that one if it went back to the pool)."""
    settings.PG_LEASE_HOLD_CONNECTIONS = 1
    _fresh_lease_connections()
    watch = raw_connect()
    owner = "w-answered"
    call = InFlight()
    sent: list[tuple[int, str, Any]] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append((int(context["connection"].connection.info.backend_pid), sql, params))
        result = execute(sql, params, many, context)
        if _is_attempt(sql, params) and not call.interrupted:
            call.interrupt(grace=0.2)  # no statement in flight: the socket is shut at once
        return result

    holding = hold(key, 60, owner=owner)
    report_next_acquire_to(holding, call)
    with _wrapping(wrapper):
        lease = holding.__enter__()
        assert call.interrupted
        holding.__exit__(None, None, None)
    assert lease.epoch >= 1
    _not_granted_to(watch, key, owner)
    interrupted = next(pid for pid, sql, params in sent if _is_attempt(sql, params))
    after = [sql for pid, sql, _ in sent[1:] if pid == interrupted]
    assert after == [], f"sent on the session whose socket the interrupt shut: {after}"
