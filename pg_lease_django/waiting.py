"""The blocking acquire's two drivers: `wait_plan` run on the caller's Django connection, and on the event loop.

Nothing here is public API: ``acquire(blocking=True)``, ``aacquire(blocking=True)`` and
``hold(blocking=True)`` are (see docs/blocking.md). What to do next and when to give up is
`wait_plan`'s, written once; here is only how each step is done. An attempt is one statement
(``pg_lease_acquire``, or ``pg_lease_acquire_or_register`` when the waiter LISTENs for releases);
a pause waits for a notification or the time; a lost connection is dropped and opened again.
Between attempts no transaction or snapshot is held (outside ``atomic()``), and a refused attempt
takes no lock. An attempt interrupted in flight is settled (`settling.settle`) before the
interruption goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseErrorWrapper

from . import conf, operations, sql
from .metrics import hooks as metrics
from .operations import Attempt, Grant
from .settling import abandon_statement, asettle, attempt_backend, commits_on_its_own, settle
from .sql import run, statements
from .sql.arun import Session
from .wait_plan import Granted, Lost, PauseFor, ReadEpoch, Reconnect, Step, TryOnce, advance, wait_plan

logger = logging.getLogger(__name__)


def wait_and_acquire(
    connection: BaseDatabaseWrapper,
    key: str,
    owner: str,
    ttl: timedelta,
    wait: timedelta | None,
    *,
    before_attempt: Callable[[], object] | None = None,
    interrupted: Callable[[], bool] | None = None,
) -> Grant:
    """Retry on ``connection`` until granted: on a release notification, at the holder's expiry, or every poll.

    ``before_attempt`` is called just before each attempt is sent (the heartbeat's trust window
    starts there); ``interrupted`` says whether another thread interrupted the wait (then an attempt
    cut off by a shut socket is settled too, not reported as lost). Inside ``atomic()`` LISTEN would
    only start at commit, so it polls. A waiter that LISTENs registers with each refused attempt
    (``ACQUIRE_OR_REGISTER``): releases notify only then. Outside a transaction a lost connection is
    reopened, LISTEN included.
    """
    # LISTEN inside a transaction takes effect only at its commit: inside atomic() (or with
    # autocommit off) a waiter could never hear a release, so it polls. Outside a transaction a
    # lost connection loses nothing but the attempt in flight: reconnect (Django's next cursor
    # does) and go on, once sure that attempt granted nothing. Inside one, the transaction is gone.
    own_commit = commits_on_its_own(connection)
    waiter = _Waiter(connection, key, owner, ttl, listen=conf.listen_enabled() and own_commit, interrupted=interrupted)
    with metrics.waiting(key):
        try:
            return waiter.run(wait_plan(key, owner, wait, rejoin=own_commit), before_attempt)
        except BaseException:
            # An attempt whose answer never came (interrupted, cancelled) may have committed a grant,
            # and a grant answered but not returned (interrupted while leaving LISTEN) is nobody's:
            # settle either before the exception goes on. A grant answered with an unconfirmed commit
            # (UnconfirmedCommitError leaves in_flight set) is settled too. Inside a transaction the
            # attempt went with it; a lost connection is the plan's to report: nothing to settle.
            if own_commit and (waiter.in_flight is not None or waiter.granted is not None):
                settle(connection, key, owner, waiter.in_flight)
            raise


class _Waiter:
    """Runs a `wait_plan` on a Django connection, one session (a LISTEN) per connection."""

    def __init__(
        self,
        connection: BaseDatabaseWrapper,
        key: str,
        owner: str,
        ttl: timedelta,
        *,
        listen: bool,
        interrupted: Callable[[], bool] | None,
    ) -> None:
        self.connection, self.key, self.owner, self.ttl = connection, key, owner, ttl
        self.listen = listen
        self.interrupted = interrupted
        self.in_flight: int | None = None  # the server process of the attempt sent, until answered
        self.sent = False  # the current step's statement was sent
        self.granted: Grant | None = None  # answered, not yet returned (UNLISTEN still to send)

    def run(self, plan: Generator[Step, Any, Grant], before_attempt: Callable[[], object] | None) -> Grant:
        step = self._next(plan, None)
        while True:
            session = _Session()
            try:
                with _listening(self.connection, self.listen, session):
                    while not isinstance(step, Granted | Reconnect):
                        step = self._next(plan, self._do(step, before_attempt))
            except (OperationalError, InterfaceError) as exc:
                if not session.lost:
                    raise
                step = self._next(plan, Lost(exc, sent=self.sent))
            if isinstance(step, Granted):
                return step.grant
            if isinstance(step, Reconnect):
                with suppress(Exception):
                    self.connection.close()  # already closed by _listening; the next cursor reconnects
                time.sleep(step.seconds)
                step = self._next(plan, None)

    def _next(self, plan: Generator[Step, Any, Grant], answer: Any) -> Step | Granted:
        try:
            step = advance(plan, answer)
        except BaseException:
            # The plan raised (timeout, or a lost connection given up, or a lost attempt whose outcome
            # is unknown): a lost attempt is reported, not settled; unless an interrupt shut its socket.
            if not (isinstance(answer, Lost) and self.interrupted is not None and self.interrupted()):
                self.in_flight = None
            raise
        if isinstance(step, Granted):
            self.granted = step.grant
        return step

    def _do(self, step: Step, before_attempt: Callable[[], object] | None) -> Any:
        self.sent = False
        if isinstance(step, TryOnce):
            if before_attempt is not None:
                before_attempt()
            self.in_flight = attempt_backend(self.connection)
            self.sent = True
            if self.listen:
                tried = operations.attempt_or_register(
                    self.connection, self.key, self.owner, self.ttl, step.register_for
                )
            else:
                tried = operations.attempt(self.connection, self.key, self.owner, self.ttl)
            self.in_flight = None
            return tried
        if isinstance(step, ReadEpoch):
            self.sent = True
            return operations.inspect(self.connection, self.key).epoch
        assert isinstance(step, PauseFor)
        if self.listen and step.wakeable:
            _wait_for_release(self.connection, self.key, step.seconds)
        else:
            time.sleep(step.seconds)
        return None


@dataclass
class _Session:
    """One connection's stretch of a wait; ``lost``: it ended because the connection was lost."""

    lost: bool = False


@contextmanager
def _listening(connection: BaseDatabaseWrapper, listen: bool, session: _Session) -> Iterator[None]:
    """LISTEN for the wait (if ``listen``); on every way out leave no LISTEN and no running statement.

    Cleanup never replaces the exception in flight (the timeout, a database error, or an
    interrupt such as KeyboardInterrupt, an exception from a signal handler, a cancellation).
    An exception with no open connection left (lost, or never opened) sets ``session.lost``.
    """
    try:
        if listen:
            run.run(connection, statements.LISTEN)
        yield
    except BaseException:
        raw = connection.connection
        session.lost = raw is None or raw.closed
        abandon_statement(connection)
        if listen:
            _unlisten(connection)
        raise
    if listen:
        _unlisten(connection)


def _unlisten(connection: BaseDatabaseWrapper) -> None:
    raw = connection.connection
    if raw is None:  # closed: the server dropped the LISTEN with the session
        return
    if raw.closed:  # lost: so is the LISTEN; let Django's wrapper know the connection is gone
        with suppress(Exception):
            connection.close()
        return
    try:
        run.run(connection, statements.UNLISTEN)
    except Exception:
        # Closing the session is the only other way to be sure no LISTEN outlives the wait;
        # a grant already obtained stays valid.
        logger.warning("UNLISTEN after a blocking acquire failed: closing the connection", exc_info=True)
        with suppress(Exception):
            connection.close()


def _wait_for_release(connection: BaseDatabaseWrapper, key: str, seconds: float) -> None:
    # psycopg queues notifications that arrive during an attempt and yields them here first,
    # so a release that commits between our refused attempt and this wait is not missed.
    deadline = time.monotonic() + seconds
    raw = connection.connection
    # The raw connection's errors are psycopg's: map them to Django's, as for every other call.
    with connection.wrap_database_errors:
        while (remaining := deadline - time.monotonic()) > 0:
            for notify in raw.notifies(timeout=remaining, stop_after=1):
                if notify.payload == key:
                    return


# ---- the same plan on the event loop: LeaseManager.aacquire(blocking=True) ----------------------


@dataclass(frozen=True)
class _OwnWait:
    """What an async blocking acquire takes from the caller's connection to wait on one of its own."""

    schema: str  # the lease app's schema in that database
    connect: dict[str, Any]  # psycopg.AsyncConnection.connect() arguments
    role: str | None  # OPTIONS["assume_role"], set as Django's backend sets it on its connections
    listen: bool
    errors: DatabaseErrorWrapper  # Django's mapping of psycopg's errors, as for every other call


async def await_and_acquire(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, wait: timedelta | None
) -> Grant:
    """`wait_and_acquire` for the event loop: the same plan, and no thread held while waiting.

    ``connection_of`` returns the caller's connection; it is called in Django's thread for sync code
    (``sync_to_async``), where that is the connection the caller's other ORM calls use.

    Raises:
        UnconfirmedCommitError: an attempt's grant committed on the primary, but the server could not
            confirm it reached the synchronous standby (the WARNING of `commit_confirmation`, on any
            statement of the wait). As `wait_and_acquire` does, the waiter has released that grant
            (nobody received it) before raising; that release may be unconfirmed too. The outcome is
            unknown, as for a lost connection: the caller holds nothing it may act on; acquire again
            (a grant that survives a failover is fenced by the next one).
    """
    with metrics.waiting(key):
        return await _await_and_acquire(connection_of, key, owner, ttl, wait)


async def _await_and_acquire(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, wait: timedelta | None
) -> Grant:
    own = await sync_to_async(_own_wait)(connection_of, owner)
    if own is None:
        return await _poll_in_transaction(connection_of, key, owner, ttl, wait)
    # Each attempt is one statement (ACQUIRE, or ACQUIRE_OR_REGISTER when it listens) on the
    # waiter's own connection rather than an attempt in a thread: a thread cannot be interrupted,
    # so an attempt stuck behind a row lock when the task is cancelled would run on and could
    # commit a grant nobody receives, while psycopg cancels a statement in flight on cancellation
    # and waits for it to end. No thread is taken even for the attempts, and, as in acquire(),
    # LISTEN and attempts share one session: a release committed while an attempt is in flight
    # is queued there, not missed. A lost connection (the server crashed, a failover) is opened again.
    plan = wait_plan(key, owner, wait, rejoin=True)
    attempt = statements.ACQUIRE_OR_REGISTER if own.listen else statements.ACQUIRE
    attempting = False  # an attempt's statement is in flight: its outcome unknown if interrupted
    with own.errors:
        session: Session | None = None
        try:
            step = advance(plan, None)
            while not isinstance(step, Granted):
                if isinstance(step, Reconnect):
                    if session is not None:
                        await session.close()
                        session = None
                    await asyncio.sleep(step.seconds)
                    step = advance(plan, None)
                    continue
                attempting = False
                answer: Any
                try:
                    if session is None:
                        session = await Session.connect(own.connect, own.schema, role=own.role, listen=own.listen)
                    if isinstance(step, TryOnce):
                        params: list[Any] = [key, owner, ttl, step.register_for][: 4 if own.listen else 3]
                        attempting = True
                        with operations.quota_refusals(key):
                            # An unconfirmed grant raises here, the attempt still "in flight": settled below.
                            tried = await session.one(attempt, params)
                        attempting = False
                        answer = operations.attempted(key, tried)
                    elif isinstance(step, ReadEpoch):
                        answer = (await session.one(statements.INSPECT, [key])).epoch
                    else:
                        if own.listen and step.wakeable:
                            await _await_release(session.conn, key, step.seconds)
                        else:
                            await asyncio.sleep(step.seconds)
                        answer = None
                except psycopg.Error as exc:
                    if not (session is None or session.closed):
                        raise  # an error of the statement, the connection is fine
                    answer = Lost(exc, sent=attempting)
                step = advance(plan, answer)
            return step.grant
        except BaseException:
            # Cancelled (or timed out by asyncio.timeout) during an attempt: psycopg cancelled the
            # statement and read out its result, which may have been a committed grant: settle it
            # before the cancellation goes on (a second cancellation would cut this short). So is an
            # attempt answered with an unconfirmed commit (UnconfirmedCommitError), as the sync wait
            # settles it: its grant is nobody's.
            if attempting and session is not None and not session.closed:
                try:
                    await asettle(session, key, owner)
                except Exception:
                    logger.warning("settling an interrupted acquire of %r failed", key, exc_info=True)
            raise
        finally:
            # Ending the session ends its LISTEN; no statement runs any more (psycopg has already
            # cancelled and waited out one interrupted by a cancellation).
            if session is not None:
                await session.close()


async def _poll_in_transaction(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, wait: timedelta | None
) -> Grant:
    """The caller's connection is in a transaction: the grant must belong to it, so the attempts run
    there (in its thread) and the waiter polls, as acquire() does there. An attempt in flight when
    the task is cancelled finishes in that thread. A lost connection took the transaction: raised."""
    plan = wait_plan(key, owner, wait, rejoin=False)
    step = advance(plan, None)
    while not isinstance(step, Granted):
        if isinstance(step, TryOnce):
            step = advance(plan, await sync_to_async(_attempt_on)(connection_of, key, owner, ttl))
        else:
            assert isinstance(step, PauseFor)
            await asyncio.sleep(step.seconds)
            step = advance(plan, None)
    return step.grant


def _attempt_on(connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta) -> Attempt:
    return operations.attempt(connection_of(), key, owner, ttl)


def _own_wait(connection_of: Callable[[], BaseDatabaseWrapper], owner: str) -> _OwnWait | None:
    """How an async blocking acquire waits on a connection of its own; None when the caller's is in a transaction."""
    connection = connection_of()
    # Asked without opening the caller's connection: the attempts will not run on it.
    opened = connection.connection is not None
    if not (connection.get_autocommit() if opened else connection.settings_dict["AUTOCOMMIT"]):
        return None
    # Django's own translation of the alias's settings into connect() arguments (the test
    # database's name during tests; OPTIONS["pool"] and "isolation_level" left out), as the
    # heartbeat's LeaseConnection gets through its wrapper. Django's cursor classes are sync:
    # use psycopg's async class with the same (client- or server-side) parameter binding.
    params = connection.get_connection_params()
    client_side = issubclass(params.pop("cursor_factory", psycopg.ClientCursor), psycopg.ClientCursor)
    params.update(
        autocommit=True,
        cursor_factory=psycopg.AsyncClientCursor if client_side else psycopg.AsyncCursor,
        application_name=f"pg_lease_django wait {owner}"[:63],
    )
    listen = conf.listen_enabled()
    return _OwnWait(
        schema=sql.schema_name(connection),
        connect=params,
        role=connection.settings_dict["OPTIONS"].get("assume_role"),
        listen=listen,
        errors=connection.wrap_database_errors,
    )


async def _await_release(conn: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
    # As _wait_for_release: notifications that arrived during the attempt are yielded first.
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        async with aclosing(conn.notifies(timeout=remaining, stop_after=1)) as notifies:
            async for notify in notifies:
                if notify.payload == key:
                    return
