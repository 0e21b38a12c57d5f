"""The wait of a blocking acquire: attempt, and after a refusal wait for a release, the holder's expiry or a poll.

Nothing here is public API: ``acquire(blocking=True)``, ``aacquire(blocking=True)`` and
``hold(blocking=True)`` are (see docs/blocking.md). Between attempts no transaction or snapshot is
held (outside ``atomic()``), and a refused attempt takes no lock.

A waiter outside a transaction that loses its connection (the server crashed, a failover) reconnects
and goes on waiting: through a multi-host ``HOST`` with ``target_session_attrs=read-write`` that is
the promoted server, where it LISTENs and registers again with its next attempt. It keeps trying for
`REJOIN_WITHIN` seconds of lost connection at most, never past its deadline, then raises the
connection error (``django.db.OperationalError``). When the connection was lost during an attempt,
that attempt may have been granted unseen: the waiter first reads the key on its new connection
(`_nothing_granted`), goes on only if the key's epoch is still the one its last refused attempt
saw (no grant since, its own included), and otherwise raises ``OperationalError``: outcome unknown,
as for any lost call. So a call returns at most one grant, the one it was told of.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseErrorWrapper
from psycopg.sql import SQL, Identifier

from . import conf, operations, sql
from .exceptions import LeaseLostError, LeaseTimeoutError
from .operations import Attempt, Grant
from .validation import MAX_WAIT, describe_seconds

# The logger these warnings were always logged under: the manager's, whose calls they are part of.
logger = logging.getLogger("pg_lease_django.managers")

#: Seconds a waiter whose connection was lost keeps trying to get one back (never past its own
#: deadline) before it raises the connection error: time for a failover manager to promote a standby.
REJOIN_WITHIN = 60.0
#: Pauses before the successive reconnection attempts of a waiter: the first at once, then backing off.
REJOIN_PAUSES = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)


class _Rejoin:
    """How a waiter outside a transaction gets back a lost connection: when it tries, when it gives up."""

    def __init__(self, key: str, deadline: float | None) -> None:
        self.key = key
        self.deadline = deadline
        self.since: float | None = None  # time.monotonic() when the connection was lost; None: not lost
        self.tries = 0
        self.answered_once = False

    def pause(self, error: BaseException) -> float | None:
        """Seconds to wait before reconnecting after ``error``; None: give up (raise it).

        Only a connection that answered an attempt of this wait is rejoined: one that never could
        (a server down, wrong settings) fails the call at once, as any other call.
        """
        if not self.answered_once:
            return None
        now = time.monotonic()
        if self.since is None:
            self.since = now
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            logger.warning("blocking acquire of %r lost its connection (%s): reconnecting", self.key, cause)
        limit = self.since + REJOIN_WITHIN
        if self.deadline is not None:
            limit = min(limit, self.deadline)
        if now >= limit:
            return None
        pause = REJOIN_PAUSES[min(self.tries, len(REJOIN_PAUSES) - 1)]
        self.tries += 1
        return min(pause, limit - now)

    def answered(self) -> None:
        """An attempt got its answer: the connection is back (or was never lost)."""
        self.answered_once = True
        if self.since is not None:
            logger.info(
                "blocking acquire of %r reconnected after %.1f s: waiting on", self.key, time.monotonic() - self.since
            )
            self.since, self.tries = None, 0


@dataclass
class _Session:
    """One connection's stretch of a wait; ``lost``: it ended because the connection was lost;
    ``attempting``: an attempt was in flight then (its outcome unknown)."""

    lost: bool = False
    attempting: bool = False


def _nothing_granted(key: str, refused: Attempt, epoch: int, lost: BaseException) -> None:
    """Go on after losing the connection during an attempt only if ``key`` is still at the epoch of
    the last refused attempt: every grant raises the epoch, so the lost attempt granted nothing.
    Otherwise raise OperationalError: the lost attempt's outcome is unknown."""
    if epoch == refused.epoch:
        return
    raise OperationalError(
        f"blocking acquire of {key!r}: the connection was lost during an attempt, and the lease has changed "
        f"since (epoch {refused.epoch} -> {epoch}): the attempt's outcome is unknown ({lost})"
    ) from lost


# ---- an attempt interrupted in flight: its outcome is unknown until settled ------------------------

#: Seconds `settle` waits for an interrupted attempt's statement to end on the server.
SETTLE_WITHIN = 5.0
# Cancels the interrupted attempt from another session while it still runs (its own client may no
# longer be able to: a shut socket, a cancel request that arrived before the statement did), and
# says whether it still does. Only a lease statement: behind PgBouncer the pid is not a server's.
_CANCEL_ATTEMPT = (
    "SELECT pg_catalog.pg_cancel_backend(pid) FROM pg_catalog.pg_stat_activity"
    " WHERE pid = %s AND state = 'active' AND query LIKE '%%pg_lease_acquire%%'"
)


def attempt_backend(connection: BaseDatabaseWrapper) -> int:
    """The server process the next attempt on ``connection`` runs in (connecting it if need be)."""
    connection.ensure_connection()
    return int(connection.connection.info.backend_pid)


def _autocommit(connection: BaseDatabaseWrapper) -> bool:
    """Whether a call's statements commit on their own: then an interrupted one is settled here;
    inside the caller's transaction, that transaction owns it."""
    return connection.get_autocommit() and not connection.in_atomic_block


def acquire_once(connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta) -> Grant | None:
    """One non-blocking attempt (`Lease.objects.acquire`); interrupted in flight, it is settled.

    A signal, ``SystemExit`` or any other interruption that is not an error of the call leaves a
    statement that may still run on the server (psycopg cancels only on its own interrupts):
    outside a transaction it is cancelled and a grant it made is released, as for every attempt
    (`settle`). Inside one, the caller's transaction owns the attempt.
    """
    own = _autocommit(connection)
    backend = attempt_backend(connection) if own else None
    try:
        return operations.acquire(connection, key, owner, ttl)
    except Exception:
        raise  # the server answered (a refusal, a bad argument) or the connection is lost: reported
    except BaseException:
        if backend is not None:
            settle(connection, key, owner, backend)
        raise


async def aacquire_once(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta
) -> Grant | None:
    """`acquire_once` for the event loop (`Lease.objects.aacquire` without ``blocking``).

    The statement runs in Django's thread for sync code (``sync_to_async``), on the caller's
    connection, as Django's async ORM runs its own. A thread cannot be cancelled: when the task is
    cancelled (``asyncio.timeout`` too) while the statement runs outside a transaction, the statement
    is cancelled on the server (psycopg's ``cancel_safe``, again until its thread has returned), and
    a grant it had committed is released, before the cancellation goes on. A second cancellation
    cuts that short. Inside a transaction the attempt is the transaction's: it finishes in its thread.
    """
    started: list[Any] = []  # the psycopg connection the attempt runs on; None: in a transaction
    abandoned = False

    def attempt() -> Grant | None:
        if abandoned:
            return None  # cancelled before it was sent
        connection = connection_of()
        if not _autocommit(connection):
            started.append(None)
            return operations.acquire(connection, key, owner, ttl)
        attempt_backend(connection)
        started.append(connection.connection)
        return acquire_once(connection, key, owner, ttl)

    running = asyncio.ensure_future(sync_to_async(attempt)())
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        abandoned = True
        loop = asyncio.get_running_loop()
        while not running.done() and None not in started:
            if started:
                await loop.run_in_executor(None, _cancel_statement, started[0])
            await asyncio.wait({running}, timeout=0.05)
        if running.done() and not running.cancelled() and running.exception() is None:
            grant = running.result()
            if grant is not None:
                await sync_to_async(_give_back)(connection_of, grant)
        raise


def _cancel_statement(raw: Any) -> None:
    # A cancel request that arrives while the session is idle is ignored by the server.
    with suppress(Exception):
        raw.cancel_safe(timeout=SETTLE_WITHIN)


def _give_back(connection_of: Callable[[], BaseDatabaseWrapper], grant: Grant) -> None:
    try:
        release_once(connection_of(), grant.key, grant.owner, grant.epoch)
    except Exception:
        logger.warning("releasing the grant of a cancelled acquire of %r failed", grant.key, exc_info=True)
    else:
        logger.warning("a cancelled acquire of %r had been granted (epoch %s): released it", grant.key, grant.epoch)


def release_once(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """A release (`Lease.objects.release`); interrupted before it took effect, it is completed.

    An interruption landing before the release commits would leave the lease held, for up to its
    TTL, by an owner that is leaving. Outside a transaction it is completed (`complete_release`)
    before the interruption goes on. Inside one, the caller's transaction owns it.
    """
    own = _autocommit(connection)
    try:
        operations.release(connection, key, owner, epoch)
    except Exception:
        raise  # the server answered (a refusal) or the connection is lost: reported
    except BaseException:
        if own:
            complete_release(connection, key, owner, epoch)
        raise


def complete_release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """After a release of ``(owner, epoch)`` was interrupted (a signal, KeyboardInterrupt, SystemExit):
    send it again on a fresh session of ``connection``, before the interruption goes on.

    The rule for every interrupted release (`Lease.objects.release`, the exit of ``hold()``): the
    owner is leaving, its lease must not wait for its TTL. A statement still running is cancelled
    and the connection closed; the release is sent on a new session (Django reconnects) in a
    transaction of its own that waits `SETTLE_WITHIN` s at most for a row lock (``lock_timeout``).
    A release that had committed answers not_owner, which is fine. ``connection`` is left closed
    or in autocommit, outside a transaction. Never raises an Exception: a failure is logged (the
    lease then lapses at its TTL). A second interruption starts it over (`to_the_end`).
    """
    to_the_end(functools.partial(_complete_release, connection, key, owner, epoch))


def _complete_release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    try:
        _abandon_statement(connection)
        connection.close()
        _release_within(connection, key, owner, epoch)  # released by the interrupted call, or lapsed: fine
    except Exception:
        logger.warning("completing an interrupted release of %r failed; it lapses at its TTL", key, exc_info=True)
        _drop(connection)
    except BaseException:
        _drop(connection)  # interrupted again: no transaction left open (Django reconnects in autocommit)
        raise


def _release_within(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """Release ``(owner, epoch)`` in a transaction of its own on ``connection`` that waits
    `SETTLE_WITHIN` s at most for a row lock (``lock_timeout``); a lease no longer held is no error.
    A transaction on this very connection (not `transaction.atomic`, which takes the alias's
    connection of this thread: for a lease connection of hold() that is another one)."""
    connection.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_catalog.set_config('lock_timeout', %s, true)", [f"{SETTLE_WITHIN}s"])
    with suppress(LeaseLostError):
        operations.release(connection, key, owner, epoch)
    connection.commit()
    connection.set_autocommit(True)


def _drop(connection: BaseDatabaseWrapper) -> None:
    with suppress(Exception):
        connection.close()


def settle(connection: BaseDatabaseWrapper, key: str, owner: str, backend_pid: int | None) -> None:
    """After an attempt of ``owner`` was interrupted in flight: make sure it granted nothing that stays.

    The one rule for every interruption (a signal, KeyboardInterrupt, SystemExit, a cancelled task,
    ``Election.stop``): the attempt's statement is cancelled on the server and waited out (up to
    `SETTLE_WITHIN` s), then, if it committed a grant nobody received, that grant is released. (A
    lost connection is not settled: a waiter reports it, see `_nothing_granted`.)
    ``backend_pid``: the server process the attempt ran in (None: nothing to wait out).
    ``connection`` must be in autocommit; it is closed first, so the settling runs in a fresh
    session (Django reconnects). Never raises an Exception: a failure is logged (the grant, if
    any, then lapses after its TTL), and the interruption goes on. A second interruption starts it
    over (`to_the_end`).
    """
    to_the_end(functools.partial(_settle_on_fresh_session, connection, key, owner, backend_pid))


#: How many times a second interruption (and a third, ...) starts the settling over before it goes on.
SETTLE_RESTARTS = 3


def to_the_end(settling: Callable[[], None]) -> None:
    """Run ``settling`` (`settle`, `complete_release`: each starts by abandoning what runs, so it can
    start over) to its end although interrupted again: a second signal whose handler raises, a
    second KeyboardInterrupt (psycopg cancels the statement it cuts short).

    Each interruption of the settling starts it over, up to `SETTLE_RESTARTS` times; the last one is
    raised once the settling has ended (its context is the first interruption, which the caller
    would have raised), or at once after `SETTLE_RESTARTS` restarts (what was settling is then left
    to lapse at its TTL).
    """
    again: BaseException | None = None
    for restart in range(SETTLE_RESTARTS + 1):
        try:
            settling()
        except Exception:
            raise  # pragma: no cover - the settlings catch and log their errors
        except BaseException as exc:
            again = exc
            if restart == SETTLE_RESTARTS:
                break
            logger.warning("interrupted again while settling an interrupted lease call: starting over")
            continue
        break
    if again is not None:
        raise again


def _settle_on_fresh_session(connection: BaseDatabaseWrapper, key: str, owner: str, backend_pid: int | None) -> None:
    try:
        _abandon_statement(connection)
        connection.close()
        _settle(connection, key, owner, backend_pid)
    except Exception:
        logger.warning("settling an interrupted acquire of %r failed", key, exc_info=True)
        _drop(connection)  # no transaction left open (Django reconnects in autocommit)
    except BaseException:
        _drop(connection)  # interrupted again: no statement left running on it
        raise


def _settle(connection: BaseDatabaseWrapper, key: str, owner: str, backend_pid: int | None) -> None:
    if backend_pid is not None:
        deadline = time.monotonic() + SETTLE_WITHIN
        try:
            with connection.cursor() as cursor:
                while time.monotonic() < deadline:
                    cursor.execute(_CANCEL_ATTEMPT, [backend_pid])
                    if cursor.fetchone() is None:
                        break
                    time.sleep(0.01)
        except Exception:  # not allowed to signal it (another role): read the key all the same
            logger.warning("cancelling an interrupted acquire of %r on the server failed", key, exc_info=True)
    state = operations.inspect(connection, key)
    if _granted_unseen(state.status, state.owner, owner):
        _release_within(connection, key, owner, state.epoch)  # lapsed or taken meanwhile: nothing to give back
        logger.warning("an interrupted acquire of %r had been granted (epoch %s): released it", key, state.epoch)


def _granted_unseen(status: str, holder: str | None, owner: str) -> bool:
    # Owners are unique among concurrent clients (hold()'s default is unique per hold): a lease
    # held by this owner after an interrupted attempt is that attempt's grant.
    return status == "held" and holder == owner


async def asettle(conn: psycopg.AsyncConnection[Any], own: _OwnWait, key: str, owner: str) -> None:
    """`settle` on an async waiter's own connection, after psycopg has cancelled and read out the attempt."""
    row = await (await conn.execute(own.inspect, [key])).fetchone()
    assert row is not None
    _key, status, holder, epoch, _expires_at, _server_time = row
    if _granted_unseen(status, holder, owner):
        outcome = (await (await conn.execute(own.release, [key, owner, epoch])).fetchone() or ("?",))[0]
        logger.warning("an interrupted acquire of %r had been granted (epoch %s): release %s", key, epoch, outcome)


def pause_after_refusal(
    key: str, owner: str, refused: Attempt, wait: timedelta | None, deadline: float | None
) -> float:
    """Seconds a waiter sleeps after the refused attempt; LeaseTimeoutError once past ``deadline``.

    Until the holder's expiry (server clock), a poll interval, or the deadline (``time.monotonic()``).
    """
    now = time.monotonic()
    if deadline is not None and now >= deadline:
        waited = describe_seconds(wait) if wait is not None else "the wait"
        raise LeaseTimeoutError(
            f"lease {key!r} still held by {refused.owner!r} after waiting {waited}", key=key, owner=owner
        )
    pause: float = min(max((refused.expires_at - refused.server_time).total_seconds(), 0.0), conf.poll_interval())
    if deadline is not None:
        pause = min(pause, deadline - now)
    return pause


def retry_within(deadline: float | None) -> timedelta:
    """The longest a waiter sleeps before its next attempt (unless woken): what it registers for.

    The poll interval, or less when the deadline (``time.monotonic()``) comes sooner; the holder's
    expiry, the other bound, the server knows from the attempt itself.
    """
    seconds = conf.poll_interval()
    if deadline is not None:
        seconds = min(seconds, deadline - time.monotonic())
    return min(timedelta(seconds=max(seconds, 0.0)), MAX_WAIT)


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
    reopened (`_Rejoin`), LISTEN included.
    """
    deadline = None if wait is None else time.monotonic() + wait.total_seconds()
    # LISTEN inside a transaction takes effect only at its commit: inside atomic() (or with
    # autocommit off) a waiter could never hear a release, so it polls.
    autocommit = _autocommit(connection)
    listen = conf.listen_enabled() and autocommit
    # Outside a transaction a lost connection loses nothing but the attempt in flight: reconnect
    # (Django's next cursor does) and go on, once sure that attempt granted nothing. Inside one,
    # the transaction is gone: raise.
    rejoin = _Rejoin(key, deadline) if autocommit else None
    pending: list[int] = []  # the server process of the attempt in flight, until it is answered
    granted: list[Grant] = []  # a grant answered but not yet returned (UNLISTEN still to send)
    try:
        return _wait_and_acquire(
            connection, key, owner, ttl, wait, deadline, listen, rejoin, before_attempt, interrupted, pending, granted
        )
    except BaseException:
        # An attempt whose answer never came (interrupted, cancelled) may have committed a grant,
        # and a grant answered but not returned (interrupted while leaving LISTEN) is nobody's:
        # settle either before the exception goes on. Inside a transaction the attempt went with
        # it; a lost connection is the rejoin's to report (`_nothing_granted`): nothing to settle.
        if autocommit and (pending or granted):
            settle(connection, key, owner, pending[-1] if pending else None)
        raise


def _wait_and_acquire(
    connection: BaseDatabaseWrapper,
    key: str,
    owner: str,
    ttl: timedelta,
    wait: timedelta | None,
    deadline: float | None,
    listen: bool,
    rejoin: _Rejoin | None,
    before_attempt: Callable[[], object] | None,
    interrupted: Callable[[], bool] | None,
    pending: list[int],
    granted: list[Grant],
) -> Grant:
    refused: Attempt | None = None  # the last refused attempt
    unsure: BaseException | None = None  # the loss of the connection during an attempt, until checked
    while True:
        session = _Session()
        try:
            with _listening(connection, listen, session):
                if unsure is not None and refused is not None:
                    epoch = operations.inspect(connection, key).epoch
                    if epoch != refused.epoch:
                        pending.clear()  # the lost attempt's outcome is reported (raised), not settled
                    _nothing_granted(key, refused, epoch, unsure)
                    unsure = None
                while True:
                    if before_attempt is not None:
                        before_attempt()
                    pending[:] = [attempt_backend(connection)]
                    session.attempting = True
                    if listen:
                        tried = operations.attempt_or_register(connection, key, owner, ttl, retry_within(deadline))
                    else:
                        tried = operations.attempt(connection, key, owner, ttl)
                    session.attempting = False
                    pending.clear()
                    if rejoin is not None:
                        rejoin.answered()
                    grant = tried.grant(key)
                    if grant is not None:
                        granted.append(grant)
                        return grant
                    refused = tried
                    pause = pause_after_refusal(key, owner, tried, wait, deadline)
                    if listen:
                        _wait_for_release(connection, key, pause)
                    else:
                        time.sleep(pause)
        except (OperationalError, InterfaceError) as exc:
            if rejoin is None or not session.lost:
                raise
            rejoining = rejoin.pause(exc)
            if rejoining is None:
                # A connection that stays lost: no server to settle on; its last attempt's outcome
                # is unknown, as for any lost call (OperationalError). Unless an interrupt shut it.
                if interrupted is None or not interrupted():
                    pending.clear()
                raise
            if session.attempting:
                unsure = exc
        with suppress(Exception):
            connection.close()  # already closed by _listening; makes sure the next cursor reconnects
        time.sleep(rejoining)


@contextmanager
def _listening(connection: BaseDatabaseWrapper, listen: bool, session: _Session) -> Iterator[None]:
    """LISTEN for the wait (if ``listen``); on every way out leave no LISTEN and no running statement.

    Cleanup never replaces the exception in flight (the timeout, a database error, or an
    interrupt such as KeyboardInterrupt, an exception from a signal handler, a cancellation).
    An exception with no open connection left (lost, or never opened) sets ``session.lost``.
    """
    try:
        if listen:
            with connection.cursor() as cursor:
                cursor.execute(sql.LISTEN)
        yield
    except BaseException:
        raw = connection.connection
        session.lost = raw is None or raw.closed
        _abandon_statement(connection)
        if listen:
            _unlisten(connection)
        raise
    if listen:
        _unlisten(connection)


def _abandon_statement(connection: BaseDatabaseWrapper) -> None:
    # psycopg cancels the running statement on KeyboardInterrupt only (3.3: SystemExit too). Any
    # other exception raised while an attempt runs (say from a signal handler, while the attempt
    # waits for a row lock) leaves the attempt running on the server: it could still commit a
    # grant that nobody receives, and the connection cannot send anything else. Cancel it and
    # drop the connection (Django reconnects on next use; inside atomic() the transaction is
    # lost); `settle` then makes sure nothing it granted stays.
    raw = connection.connection
    if raw is None or raw.info.transaction_status != psycopg.pq.TransactionStatus.ACTIVE:
        return
    logger.warning("an acquire interrupted mid-statement: cancelling it and closing the connection")
    with suppress(Exception):
        raw.cancel_safe(timeout=5.0)
    with suppress(Exception):
        connection.close()


def _unlisten(connection: BaseDatabaseWrapper) -> None:
    raw = connection.connection
    if raw is None:  # closed: the server dropped the LISTEN with the session
        return
    if raw.closed:  # lost: so is the LISTEN; let Django's wrapper know the connection is gone
        with suppress(Exception):
            connection.close()
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql.UNLISTEN)
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


# ---- the same wait for the event loop: LeaseManager.aacquire(blocking=True) ----------------------


@dataclass(frozen=True)
class _OwnWait:
    """What an async blocking acquire takes from the caller's connection to wait on one of its own."""

    statement: str  # sql.ACQUIRE_OR_REGISTER when it listens, else sql.ACQUIRE, rendered for that database
    inspect: str  # sql.INSPECT, rendered: after losing the connection during an attempt
    release: str  # sql.RELEASE, rendered: settling an attempt interrupted in flight
    connect: dict[str, Any]  # psycopg.AsyncConnection.connect() arguments
    role: str | None  # OPTIONS["assume_role"], set as Django's backend sets it on its connections
    listen: bool
    errors: DatabaseErrorWrapper  # Django's mapping of psycopg's errors, as for every other call


async def await_and_acquire(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, wait: timedelta | None
) -> Grant:
    """`wait_and_acquire` for the event loop: the same attempts and pauses, and no thread held while waiting.

    ``connection_of`` returns the caller's connection; it is called in Django's thread for sync code
    (``sync_to_async``), where that is the connection the caller's other ORM calls use.
    """
    deadline = None if wait is None else time.monotonic() + wait.total_seconds()
    own = await sync_to_async(_own_wait)(connection_of, owner)
    if own is None:
        # The caller's connection is in a transaction: the grant must belong to it, so the
        # attempts run there (in its thread) and the waiter polls, as acquire() does there. An
        # attempt in flight when the task is cancelled finishes in that thread.
        while True:
            tried = await sync_to_async(_attempt_on)(connection_of, key, owner, ttl)
            grant = tried.grant(key)
            if grant is not None:
                return grant
            await asyncio.sleep(pause_after_refusal(key, owner, tried, wait, deadline))
    # Each attempt is one statement (ACQUIRE, or ACQUIRE_OR_REGISTER when it listens) on the
    # waiter's own connection rather than an attempt in a thread: a thread cannot be interrupted,
    # so an attempt stuck behind a row lock when the task is cancelled would run on and could
    # commit a grant nobody receives, while psycopg cancels a statement in flight on cancellation
    # and waits for it to end. No thread is taken even for the attempts, and, as in acquire(),
    # LISTEN and attempts share one session: a release committed while an attempt is in flight
    # is queued there, not missed.
    # A lost connection (the server crashed, a failover) is reconnected, as in wait_and_acquire.
    rejoin = _Rejoin(key, deadline)
    refused: Attempt | None = None  # the last refused attempt
    unsure: BaseException | None = None  # the loss of the connection during an attempt, until checked
    attempting = False
    with own.errors:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                attempting = False
                try:
                    if conn is None:
                        conn = await psycopg.AsyncConnection.connect(**own.connect)
                        if own.role:
                            await conn.execute(SQL("SET ROLE {}").format(Identifier(own.role)))
                        if own.listen:
                            await conn.execute(sql.LISTEN)
                    if unsure is not None and refused is not None:
                        seen = await (await conn.execute(own.inspect, [key])).fetchone()
                        assert seen is not None
                        _nothing_granted(key, refused, seen[3], unsure)
                        unsure = None
                    params: list[Any] = [key, owner, ttl]
                    if own.listen:
                        params.append(retry_within(deadline))
                    attempting = True
                    row = await (await conn.execute(own.statement, params)).fetchone()
                    attempting = False
                    assert row is not None
                    rejoin.answered()
                    tried = Attempt(*row)
                    grant = tried.grant(key)
                    if grant is not None:
                        return grant
                    refused = tried
                    pause = pause_after_refusal(key, owner, tried, wait, deadline)
                    if own.listen:
                        await _await_release(conn, key, pause)
                    else:
                        await asyncio.sleep(pause)
                except psycopg.Error as exc:
                    if not (conn is None or conn.closed):
                        raise  # an error of the statement, the connection is fine
                    rejoining = rejoin.pause(exc)
                    if rejoining is None:
                        raise
                    if attempting:
                        unsure = exc
                    if conn is not None:
                        await conn.close()
                        conn = None
                    await asyncio.sleep(rejoining)
        except BaseException:
            # Cancelled (or timed out by asyncio.timeout) during an attempt: psycopg cancelled the
            # statement and read out its result, which may have been a committed grant: settle it
            # before the cancellation goes on (a second cancellation would cut this short).
            if attempting and conn is not None and not conn.closed:
                try:
                    await asettle(conn, own, key, owner)
                except Exception:
                    logger.warning("settling an interrupted acquire of %r failed", key, exc_info=True)
            raise
        finally:
            # Ending the session ends its LISTEN; no statement runs any more (psycopg has already
            # cancelled and waited out one interrupted by a cancellation).
            if conn is not None:
                await conn.close()


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
        statement=sql.render(connection, sql.ACQUIRE_OR_REGISTER if listen else sql.ACQUIRE),
        inspect=sql.render(connection, sql.INSPECT),
        release=sql.render(connection, sql.RELEASE),
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
