"""The blocking acquire on the caller's Django connection: `wait.plan` driven there (``acquire(blocking=True)``).

Nothing here is public API: ``acquire(blocking=True)`` and ``hold(blocking=True)`` are (see
docs/blocking.md). What to do next and when to give up is the plan's, written once; here is only
how each step is done on a Django connection. An attempt is one statement (``pg_lease_acquire_within``,
or ``pg_lease_acquire_or_register`` when the waiter LISTENs for releases), whose lock waits end by
the deadline; a pause waits for a
notification or the time; a lost connection is dropped and opened again. Between attempts no
transaction or snapshot is held (outside ``atomic()``), and a refused attempt takes no lock. An
attempt interrupted in flight is settled (`wait.settling.settle`) before the interruption goes on.
The same plan on the event loop is `wait.async_driver`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import conf, operations
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.operations import Grant
from pg_lease_django.sql import run, statements

from .plan import Granted, Lost, PauseFor, ReadEpoch, Reconnect, Step, TryOnce, advance, wait_plan
from .settling import InFlight, abandon_statement, attempt_in_flight, commits_on_its_own, settle

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
        except BaseException as exc:
            # An attempt whose answer never came (interrupted, cancelled) may have committed a grant,
            # and a grant answered but not returned (interrupted while leaving LISTEN) is nobody's:
            # settle either before the exception goes on. A grant answered with an unconfirmed commit
            # (UnconfirmedCommitError leaves in_flight set) is settled too. Inside a transaction the
            # attempt went with it; a lost connection is the plan's to report, and an attempt the
            # server refused (out of scope, no grant) granted nothing: nothing to settle.
            in_flight = waiter.in_flight is not None and not run.refused_by_server(exc)
            if own_commit and (in_flight or waiter.granted is not None):
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
        self.in_flight: InFlight | None = None  # the attempt sent, until answered
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
            self.in_flight = in_flight = attempt_in_flight(self.connection)
            self.sent = True
            if self.listen:
                tried = operations.attempt_or_register(
                    self.connection, self.key, self.owner, self.ttl, step.register_for, in_flight.marker
                )
            else:
                tried = operations.attempt_within(
                    self.connection, self.key, self.owner, self.ttl, step.within, in_flight.marker
                )
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
