"""The async calls of ``Lease.objects`` outside a transaction: on the lease pool, in threads of the package's own.

Django has no async database connection; even 6.x's ``aget`` is ``sync_to_async``. So each call's
statement blocks a thread. By default ``sync_to_async`` runs every such call of a process outside a
request on one shared thread, so one call waiting on a row lock held up every other.

Here a call borrows a connection of the pool ``hold()`` uses for its one statement. That pool,
`lease_pool`, is owned, kept small, and closed when idle and at exit. The call runs on a thread of
`Threads`, which starts a thread whenever none is idle, so no call waits for another. Inside the
caller's transaction none of this is used: the statement belongs to that transaction, and
``Lease.objects`` runs it there through ``sync_to_async``.

A thread cannot be interrupted: a cancelled call runs to its end in its thread, and a release still
frees the lease. An acquire attempt cancelled in flight is cancelled on the server, and `attempt`
releases a grant it committed before the cancellation goes on. Every interrupted attempt is settled
so, as `wait.settling` describes.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import AsyncToSync, sync_to_async
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import operations
from pg_lease_django.exceptions import UnconfirmedCommitError
from pg_lease_django.operations import Attempt
from pg_lease_django.wait import settling

from .lease_pool import LeasePool, pool_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The lease pool's bound on a dead network for these calls (keepalives, connect_timeout), in seconds:
#: that of ``hold(ttl=30)``, whose renewals come every 10 s, so that the two share connections.
IO_TIMEOUT = 10.0
#: Idle threads kept for the next calls; a thread beyond them ends after its call.
KEEP_IDLE = 2
#: Seconds an idle thread waits for a call before it ends.
IDLE_FOR = 30.0


class Threads:
    """Threads for blocking calls: an idle one takes the next call, else a new one is started.

    Never asyncio's default executor, which the whole application shares (``cpus + 4`` threads):
    calls waiting on row locks there would leave none for other ``to_thread`` calls. At most
    `KEEP_IDLE` threads wait for work, each for `IDLE_FOR` s. A child process starts with none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no submitted job has claimed yet
        self._pid = os.getpid()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (which raises nothing) on a thread of its own or an idle one."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's threads are not here
                self._jobs, self._idle, self._pid = queue.SimpleQueue(), 0, os.getpid()
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
        if claimed:
            self._jobs.put(job)
        else:
            threading.Thread(target=self._work, args=(job,), name="pg_lease call", daemon=True).start()

    def _work(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()
            job = self._next()

    def _next(self) -> Callable[[], None] | None:
        with self._lock:
            if self._idle >= KEEP_IDLE:
                return None
            self._idle += 1
        while True:
            try:
                return self._jobs.get(timeout=IDLE_FOR)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job claimed this thread meanwhile
                        self._idle -= 1
                        return None


_threads = Threads()


def in_thread(fn: Callable[[], T], start: Callable[[Callable[[], None]], None] = _threads.submit) -> asyncio.Future[T]:
    """``fn()`` in a copy of this context on a thread ``start`` runs it on (by default one of `Threads`);
    its outcome as a future of the running loop. Cancelling the future does not stop ``fn``."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def deliver(outcome: Callable[[], None]) -> None:  # the event loop's thread
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = context.run(fn)
        except BaseException as exc:
            outcome = functools.partial(future.set_exception, exc)
        else:
            outcome = functools.partial(future.set_result, result)
        with suppress(RuntimeError):  # the loop is closed: nobody awaits the outcome any more
            loop.call_soon_threadsafe(deliver, outcome)

    start(run)
    return future


async def in_transaction(alias: str) -> bool:
    """Whether the caller's connection to ``alias`` is in a transaction.

    It is when ``AUTOCOMMIT`` is off, or when a sync caller above this coroutine holds one, as with
    ``async_to_sync`` within ``atomic()``. Django's connections are thread-local, so the sync caller's
    is asked in its own thread, where ``sync_to_async`` runs. That thread waits for this coroutine, so
    no other call queues there. It is asked only when there is such a caller, which asgiref's
    ``AsyncToSync.executors.current`` tells, as it tells ``sync_to_async``. Without one, async code
    cannot have opened a transaction: that is the case under an ASGI server's loop or ``asyncio.run``.
    This neither opens nor creates a connection.
    """
    if not connections.settings[alias]["AUTOCOMMIT"]:
        return True
    executors = getattr(AsyncToSync, "executors", None)
    if executors is not None and getattr(executors, "current", None) is None:
        return False
    return await sync_to_async(_callers_in_transaction)(alias)


def _callers_in_transaction(alias: str) -> bool:
    for connection in connections.all(initialized_only=True):
        if connection.alias == alias:
            return connection.in_atomic_block or (connection.connection is not None and not connection.autocommit)
    return False


def _pool(alias: str) -> LeasePool:
    return pool_for(alias, io_timeout=IO_TIMEOUT)


async def call(alias: str, fn: Callable[[BaseDatabaseWrapper], T]) -> T:
    """``fn`` on a connection of ``alias``'s lease pool, in a thread of `Threads`; cancelled, it runs on to its end."""
    return await in_thread(functools.partial(_on_lent, alias, fn))


def _on_lent(alias: str, fn: Callable[[BaseDatabaseWrapper], T]) -> T:
    with _pool(alias).connection(None) as conn:
        conn.reset_timeout()
        return fn(conn.wrapper)


class _NotSent(Exception):
    """The attempt was abandoned before its statement was sent."""


class _Attempting:
    """One attempt's state, shared by its thread and the task awaiting it (under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raw: Any = None  # the psycopg connection it is sent on
        self.abandoned = False
        self.finished = False


async def attempt(
    alias: str, key: str, owner: str, ttl: timedelta, *, blocking: bool = False, within: timedelta | None = None
) -> Attempt:
    """One acquire attempt of ``key`` on ``alias``'s lease pool through `operations.attempt`, settled when cancelled.

    ``blocking`` marks the first try of a blocking acquire. It waits for a lock at most ``within``,
    its deadline, as `operations.attempt_within` does. Like every attempt of a blocking wait, it
    releases a grant whose commit the synchronous standby did not confirm before it raises
    `UnconfirmedCommitError`. A non-blocking call leaves such a grant to its TTL.

    The awaiting task may be cancelled while the statement runs, also by ``asyncio.timeout``. Then the
    statement is cancelled on the server, again and again until its thread has it back. The thread
    sees it abandoned and releases a grant it committed, through `wait.settling.settle`. When the
    statement had already ended, the task settles it the same way. Either way this happens before the
    cancellation goes on, and a second cancellation does not cut it short; see
    `wait.settling.settled_anyway`.
    """
    state = _Attempting()
    running = in_thread(functools.partial(_attempt_on_lent, alias, key, owner, ttl, state, blocking, within))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with state.lock:
            state.abandoned = True
            finished = state.finished
        await settling.settled_anyway(
            _settle(alias, key, owner, state, running, finished), f"the cancelled acquire of {key!r} by {owner!r}"
        )
        raise


def _attempt_on_lent(
    alias: str, key: str, owner: str, ttl: timedelta, state: _Attempting, blocking: bool, within: timedelta | None
) -> Attempt:
    with _pool(alias).connection(None) as conn:
        conn.reset_timeout()
        conn.wrapper.ensure_connection()  # connected, so that its statement can be cancelled
        with state.lock:
            if state.abandoned:
                raise _NotSent  # nobody awaits it
            state.raw = conn.wrapper.connection
        try:
            if blocking:
                return operations.attempt_within(conn.wrapper, key, owner, ttl, within)
            return operations.attempt(conn.wrapper, key, owner, ttl)
        except UnconfirmedCommitError:
            if blocking:
                conn.settle(key, owner)  # its grant is nobody's
            raise
        finally:
            with state.lock:
                state.finished = True
                abandoned = state.abandoned
            if abandoned:  # the task was cancelled before its answer: a grant is nobody's
                conn.settle(key, owner)


async def _settle(
    alias: str, key: str, owner: str, state: _Attempting, running: asyncio.Future[Attempt], finished: bool
) -> None:
    if not finished:  # its thread settles it once its statement has ended: cancel that on the server
        while not running.done():
            if state.raw is not None:
                await in_thread(functools.partial(_cancel_statement, state.raw))
            await asyncio.wait({running}, timeout=0.05)
        return
    await asyncio.wait({running})  # its outcome is on its way to this loop
    if running.exception() is None and not running.result().granted:
        return  # refused: nothing to give back
    await in_thread(functools.partial(_pool(alias).settle, key, owner))


def _cancel_statement(raw: Any) -> None:
    # A cancel request that arrives while the session is idle is ignored by the server.
    with suppress(Exception):
        raw.cancel_safe(timeout=settling.SETTLE_WITHIN)
