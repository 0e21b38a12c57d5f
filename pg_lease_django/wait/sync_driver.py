"""The blocking acquire on the caller's Django connection: `wait.plan` driven there for ``acquire(blocking=True)``.

Nothing here is public API: ``acquire(blocking=True)`` and ``hold(blocking=True)`` are; see
docs/blocking.md. What to do next and when to give up is the plan's, written once. Here is only
how each step is done on a Django connection, with `plans.drive` running the plan.

An attempt is one statement whose lock waits end by the deadline: ``pg_lease_acquire_within``, or
``pg_lease_acquire_or_register`` when the waiter LISTENs for releases. A pause waits for a
notification or the time. A lost connection is dropped and opened again. Outside ``atomic()``, no
transaction or snapshot is held between attempts, and a refused attempt takes no lock. An attempt
interrupted in flight is settled by `wait.settling.settle` before the interruption goes on. The
same plan on the event loop is `wait.async_driver`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import conf, operations
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.operations import Grant
from pg_lease_django.plans import Pause, Plan, drive
from pg_lease_django.sql import run, statements

from .plan import Lost, ReadEpoch, Reconnect, Step, TryOnce, wait_plan
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

    ``before_attempt`` is called just before each attempt is sent; the heartbeat's trust window starts
    there. ``interrupted`` says whether another thread interrupted the wait. If so, an attempt cut off
    by a shut socket is settled too, not reported as lost. Inside ``atomic()`` LISTEN would only start
    at commit, so it polls. A waiter that LISTENs registers with each refused attempt, through
    ``ACQUIRE_OR_REGISTER``, since releases notify only then. Outside a transaction a lost connection
    is reopened, LISTEN included.
    """
    # LISTEN inside a transaction takes effect only at its commit: inside atomic() (or with
    # autocommit off) a waiter could never hear a release, so it polls. Outside a transaction a
    # lost connection loses nothing but the attempt in flight: reconnect (Django's next cursor
    # does) and go on, once sure that attempt granted nothing. Inside one, the transaction is gone.
    own_commit = commits_on_its_own(connection)
    waiter = _Waiter(connection, key, owner, ttl, listen=conf.listen_enabled() and own_commit, interrupted=interrupted)
    with metrics.waiting(key):
        try:
            plan = wait_plan(key, owner, wait, rejoin=own_commit, poll_interval=conf.poll_interval())
            return waiter.run(plan, before_attempt)
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
    """Runs a `wait_plan` on a Django connection, one LISTEN per connection."""

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
        self.connected = False  # this connection's stretch of the wait began: LISTEN sent if listening
        self.raised: BaseException | None = None  # what the last step raised, `Lost` for a lost connection

    def run(self, plan: Plan[Step, Grant], before_attempt: Callable[[], object] | None) -> Grant:
        try:
            grant = drive(plan, functools.partial(self._perform, before_attempt=before_attempt))
        except BaseException as exc:
            # Raised by the plan, not passed on from a step: the timeout, a lost connection given up, or
            # a lost attempt whose outcome is unknown. A lost attempt is reported, not settled, unless an
            # interrupt shut its socket.
            shut = isinstance(self.raised, Lost) and self.interrupted is not None and self.interrupted()
            if exc is not self.raised and not shut:
                self.in_flight = None
            self._disconnect(failed=True)
            raise
        self.granted = grant
        self._disconnect(failed=False)
        return grant

    def _perform(self, step: Step, before_attempt: Callable[[], object] | None) -> Any:
        """Perform ``step``; what the plan raises is told from what a step raised by `raised`."""
        try:
            answer = self._perform_on_connection(step, before_attempt)
        except BaseException as exc:
            self.raised = exc
            raise
        self.raised = None
        return answer

    def _perform_on_connection(self, step: Step, before_attempt: Callable[[], object] | None) -> Any:
        if isinstance(step, Reconnect):
            with suppress(Exception):
                self.connection.close()  # already closed by _disconnect; the next cursor reconnects
            time.sleep(step.seconds)
            return None
        try:
            if not self.connected:
                self.connected = True
                if self.listen:
                    run.run(self.connection, statements.LISTEN)
            return self._do(step, before_attempt)
        except (OperationalError, InterfaceError) as exc:
            if self._disconnect(failed=True):
                raise Lost(exc, sent=self.sent) from None
            raise
        except BaseException:
            self._disconnect(failed=True)
            raise

    def _disconnect(self, *, failed: bool) -> bool:
        """End this connection's stretch of the wait; answer whether the connection was lost or never opened.

        It leaves no LISTEN and, when it ``failed``, no running statement. Cleanup never replaces the
        exception in flight: the timeout, a database error, or an interrupt such as KeyboardInterrupt, an
        exception from a signal handler or a cancellation.
        """
        if not self.connected:
            return False
        self.connected = False
        lost = False
        if failed:
            raw = self.connection.connection
            lost = raw is None or raw.closed
            abandon_statement(self.connection)
        if self.listen:
            _unlisten(self.connection)
        return lost

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
        assert isinstance(step, Pause)
        if self.listen and step.wakeable:
            _wait_for_release(self.connection, self.key, step.seconds)
        else:
            time.sleep(step.seconds)
        return None


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
