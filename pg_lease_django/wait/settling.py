"""Calls interrupted in flight are settled here, whether by a signal, an exit or a cancelled task.

An acquire whose answer never came may have committed a grant nobody received. A release cut
short may not have committed, and then the lease stays held by an owner that is leaving. Outside
a transaction both are settled before the interruption goes on: the statement still running is
cancelled on the server and waited out, a grant found in the owner's name is released, and a
release is sent again. `settle` and `complete_release` run `to_the_end` even when interrupted
again. Inside the caller's transaction, that transaction owns them. The manager's one-shot calls in
`manager_calls`, the blocking wait's drivers and the hold's connection all follow these rules.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import conf, operations
from pg_lease_django.exceptions import LeaseLostError
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.plans import Pause, Plan, adrive, drive
from pg_lease_django.sql import run, statements
from pg_lease_django.sql.arun import Session

logger = logging.getLogger(__name__)

#: Seconds `settle` waits for an interrupted attempt's statement to end on the server.
SETTLE_WITHIN = 5.0
#: What becomes of the lease when an interrupted attempt could not be waited out.
UNSETTLED = "if it is granted, nobody holds the lease and it lapses at its expiry (its TTL after the grant)"
# The interrupted attempt is cancelled from another session while it still runs (its own client may
# no longer be able to: a shut socket, a cancel request that reached the server before the statement
# did), until none runs. It is found by a marker of its own, never by what another statement could
# quote (key, owner), nor by pid alone (behind PgBouncer, the pooler's): CANCEL_ATTEMPT. Directly
# connected, the attempt's own server process is waited out too (`InFlight.own_process`).


class InFlight(NamedTuple):
    """An attempt about to be sent: its server process as the client sees it, and its marker for `sql.run.first`.

    ``own_process`` says that ``backend_pid`` is the server process of the attempt's own session,
    directly connected. The settling closes that session first and then waits its process out, so
    that an attempt it had not read yet when the settling first looked cannot grant after. Behind a
    pooler, with ``PG_LEASE_LISTEN = False``, the pid is the pooler's and the marker alone finds the attempt.
    A named tuple: one is made for every acquire, and a tuple is made in a third of a frozen
    dataclass's time.
    """

    backend_pid: int
    marker: str
    own_process: bool = False


def attempt_in_flight(connection: BaseDatabaseWrapper) -> InFlight:
    """The identity of the next attempt on ``connection`` (connected if need be): `settle` finds it, nothing else."""
    if connection.connection is None:
        connection.ensure_connection()
    # The pid through libpq, not `info` (a new ConnectionInfo per read); 128 random bits as 32 hex
    # digits, as uuid4().hex spells them, without building a UUID: ~3 µs less each.
    return InFlight(
        int(connection.connection.pgconn.backend_pid),
        f"pg_lease_django attempt {os.urandom(16).hex()}",
        own_process=conf.listen_enabled(),
    )


def commits_on_its_own(connection: BaseDatabaseWrapper) -> bool:
    """Whether a call's statements commit on their own: then an interrupted one is settled here;
    inside the caller's transaction, that transaction owns it. ``autocommit`` is read once
    connected, as ``get_autocommit`` would, without its second look at the connection."""
    if connection.connection is None:
        connection.ensure_connection()
    return connection.autocommit and not connection.in_atomic_block


#: The longest a cancelled task waits for its settling when cancelled again meanwhile: waiting out
#: the statement (`SETTLE_WITHIN`), then a row lock for the release (`SETTLE_WITHIN`), and slack.
SETTLE_BOUND = 3 * SETTLE_WITHIN


async def settled_anyway(settling: Coroutine[Any, Any, None], what: str) -> None:
    """Await ``settling`` to its end although the task is cancelled again meanwhile.

    A second ``task.cancel()`` or an ``asyncio.timeout`` expiring must not leave a grant nobody
    received to lapse at its TTL. It waits `SETTLE_BOUND` s at most: past it ``settling`` is
    cancelled and what it settles is left to lapse, logged at ERROR. Its Exceptions are logged, and
    the cancellation that brought the caller here goes on. A cancellation received meanwhile has
    been delivered, and the caller raises its own."""
    task = asyncio.ensure_future(settling)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_BOUND
    while not task.done():
        try:
            await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            continue  # cancelled again: the settling goes on (asyncio.wait never cancels it)
        if not task.done():
            task.cancel()
            logger.error("settling %s took over %s s: left to lapse at its TTL", what, SETTLE_BOUND)
            return
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.warning("settling %s failed", what, exc_info=error)


def complete_release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """Send an interrupted release of ``owner`` at ``epoch`` again, on a fresh session of ``connection``.

    A signal, KeyboardInterrupt or SystemExit interrupted the release, and this runs before the
    interruption goes on. It is the rule for every interrupted release, whether by
    `Lease.objects.release` or at the exit of ``hold()``: the owner is leaving, and its lease must
    not wait for its TTL. A statement still running is cancelled and the connection closed. Django
    reconnects, and the release is sent in a transaction of its own whose ``lock_timeout`` waits
    `SETTLE_WITHIN` s at most for a row lock. A release that had committed answers not_owner, which
    is fine. ``connection`` is left closed or in autocommit, outside a transaction. It never raises
    an Exception: a failure is logged, and the lease then lapses at its TTL. A second interruption
    starts it over through `to_the_end`.
    """
    to_the_end(
        functools.partial(_complete_release, connection, key, owner, epoch),
        f"the interrupted release of {key!r} by {owner!r} (epoch {epoch})",
    )


def _complete_release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    try:
        abandon_statement(connection)
        connection.close()
        _release_within(connection, key, owner, epoch)  # released by the interrupted call, or lapsed: fine
    except Exception:
        logger.warning("completing an interrupted release of %r failed; it lapses at its TTL", key, exc_info=True)
        _drop(connection)
    except BaseException:
        _drop(connection)  # interrupted again: no transaction left open (Django reconnects in autocommit)
        raise


def _release_within(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> bool:
    """Release ``owner`` at ``epoch`` in a transaction of its own on ``connection``; False for a lease no longer held.

    Its ``lock_timeout`` waits `SETTLE_WITHIN` s at most for a row lock. The transaction is on this
    very connection, not `transaction.atomic`, which takes the alias's connection of this thread:
    for a lease connection of hold() that is another one."""
    connection.set_autocommit(False)
    run.run(connection, statements.LOCK_TIMEOUT_LOCAL, timeout=f"{SETTLE_WITHIN}s")
    released = True
    try:
        operations.release(connection, key, owner, epoch)
    except LeaseLostError:
        released = False
    connection.commit()
    connection.set_autocommit(True)
    return released


def _drop(connection: BaseDatabaseWrapper) -> None:
    with suppress(Exception):
        connection.close()


def settle(connection: BaseDatabaseWrapper, key: str, owner: str, in_flight: InFlight | None) -> None:
    """After an attempt of ``owner`` was interrupted in flight: make sure it granted nothing that stays.

    The one rule for every interruption, whether a signal, KeyboardInterrupt, SystemExit, a
    cancelled task or ``Election.stop``. The attempt's statement is cancelled on the server and
    waited out for `SETTLE_WITHIN` s at most. Then, if it committed a grant nobody received, that
    grant is released. A lost connection is not settled: a waiter reports it, as `_nothing_granted`
    says. ``in_flight`` is the attempt's identity from `attempt_in_flight`; None means nothing to
    wait out. ``connection`` must be in autocommit; it is closed first, so the settling runs in a
    fresh session that Django reconnects. It never raises an Exception: a failure is logged, a grant
    then lapses after its TTL, and the interruption goes on. A second interruption starts it over
    through `to_the_end`.
    """
    to_the_end(
        functools.partial(_settle_on_fresh_session, connection, key, owner, in_flight),
        f"the interrupted acquire of {key!r} by {owner!r}",
    )


#: How many times a second interruption (and a third, ...) starts the settling over before it goes on.
SETTLE_RESTARTS = 3


def to_the_end(settling: Callable[[], None], what: str) -> None:
    """Run ``settling`` to its end although interrupted again.

    ``settling`` is `settle` or `complete_release`, each of which starts by abandoning what runs, so
    it can start over. The interruption may be a second signal whose handler raises, or a second
    KeyboardInterrupt, whose statement psycopg cancels. Each interruption of the settling starts it
    over, up to `SETTLE_RESTARTS` times. The last one is raised once the settling has ended, with the
    first interruption, which the caller would have raised, as its context. After `SETTLE_RESTARTS`
    restarts it is raised at once: ``what`` was settling is then left to lapse at its TTL, logged at
    ERROR. Each run is bounded by `SETTLE_WITHIN` s for the statement to end and as long for a row
    lock, so interruptions end it within their number times that.
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
                logger.error(
                    "interrupted %d times while settling %s: giving up, it is left to lapse at its TTL",
                    SETTLE_RESTARTS + 1,
                    what,
                )
                break
            logger.warning("interrupted again while settling an interrupted lease call: starting over")
            continue
        break
    if again is not None:
        raise again


def _settle_on_fresh_session(connection: BaseDatabaseWrapper, key: str, owner: str, in_flight: InFlight | None) -> None:
    try:
        abandon_statement(connection)
        connection.close()
        _settle(connection, key, owner, in_flight)
    except Exception:
        logger.warning("settling an interrupted acquire of %r failed", key, exc_info=True)
        _drop(connection)  # no transaction left open (Django reconnects in autocommit)
    except BaseException:
        _drop(connection)  # interrupted again: no statement left running on it
        raise


def _settle(connection: BaseDatabaseWrapper, key: str, owner: str, in_flight: InFlight | None) -> None:
    drive(settling_plan(key, owner, in_flight), functools.partial(_do, connection))


def _do(connection: BaseDatabaseWrapper, step: SettlingStep) -> Any:
    if isinstance(step, CancelAttempt):
        return run.first(connection, statements.CANCEL_ATTEMPT, **cancel_attempt_params(step.in_flight)) is not None
    if isinstance(step, Pause):
        time.sleep(step.seconds)
        return None
    if isinstance(step, Inspect):
        return operations.inspect(connection, step.key)
    return _release_within(connection, step.key, step.owner, step.epoch)


async def asettle(session: Session, key: str, owner: str) -> None:
    """`settle` on an async waiter's own session, after psycopg has cancelled and read out the
    attempt (nothing left to wait out): the same plan, each step awaited."""

    async def do(step: SettlingStep) -> Any:
        if isinstance(step, Inspect):
            return await session.one(statements.INSPECT, key=step.key)
        assert isinstance(step, ReleaseWithin), step  # no backend to cancel, so no pause
        return await _arelease_within(session, step.key, step.owner, step.epoch)

    await adrive(settling_plan(key, owner, None), do)


async def _arelease_within(session: Session, key: str, owner: str, epoch: int) -> bool:
    """`_release_within` on a `Session`: its own transaction, a row lock waited for `SETTLE_WITHIN` s at most."""
    try:
        async with session.conn.transaction():
            await session.run(statements.LOCK_TIMEOUT_LOCAL, timeout=f"{SETTLE_WITHIN}s")
            await session.one(statements.RELEASE, key=key, owner=owner, epoch=epoch)
    except LeaseLostError:
        return False
    metrics.release_confirmed(key)  # counted where the sync one is: operations.release
    return True


# ---- the settling of an interrupted attempt, written once: what to send, not how ---------------


@dataclass(frozen=True)
class CancelAttempt:
    """Cancel the attempt ``in_flight`` still running, found by its marker.

    Answered: whether one still runs or, directly connected, whether the attempt's own server process
    still lives, as `InFlight.own_process` says."""

    in_flight: InFlight


def cancel_attempt_params(in_flight: InFlight) -> dict[str, Any]:
    """``cancel_attempt``'s parameters: the attempt's own process is waited out only when it is one (`InFlight`)."""
    return {
        "attempt_marker": in_flight.marker,
        "pid": in_flight.backend_pid,
        "closed": in_flight.backend_pid if in_flight.own_process else None,
    }


@dataclass(frozen=True)
class Inspect:
    """Read the lease (`LeaseState`)."""

    key: str


@dataclass(frozen=True)
class ReleaseWithin:
    """Release ``(owner, epoch)`` waiting `SETTLE_WITHIN` s at most for the row lock; answered:
    whether it released (False: lapsed or taken meanwhile, nothing to give back)."""

    key: str
    owner: str
    epoch: int


SettlingStep = CancelAttempt | Pause | Inspect | ReleaseWithin


def settling_plan(
    key: str, owner: str, in_flight: InFlight | None, clock: Callable[[], float] = time.monotonic
) -> Plan[SettlingStep, None]:
    """What settling an interrupted attempt of ``owner`` does, for both drivers.

    `_settle` drives it on Django's connection and `asettle` on an async `Session`. It cancels the
    attempt still running, found by its marker, and waits it out for `SETTLE_WITHIN` s at most, then
    releases a grant found in the owner's name. ``in_flight`` is None when its statement has ended.
    An attempt still running past `SETTLE_WITHIN` is reported once, with what becomes of a grant it
    may still make."""
    if in_flight is not None:
        deadline = clock() + SETTLE_WITHIN
        running, failed = True, None
        try:
            while (running := (yield CancelAttempt(in_flight))) and clock() < deadline:
                yield Pause(0.01)
        except Exception as exc:
            failed = exc
        if running:  # said once, with the lease's fate
            why = "could not be looked for" if failed else f"still runs on the server after {SETTLE_WITHIN} s"
            logger.warning("an interrupted acquire of %r by %r %s: %s", key, owner, why, UNSETTLED, exc_info=failed)
    state = yield Inspect(key)
    if granted_unseen(state.status, state.owner, owner):
        released = yield ReleaseWithin(key, owner, state.epoch)
        logger.warning(
            "an interrupted acquire of %r had been granted (epoch %s): %s",
            key,
            state.epoch,
            "released it" if released else "lapsed or taken meanwhile",
        )


def granted_unseen(status: str, holder: str | None, owner: str) -> bool:
    # Owners are unique among concurrent clients (hold()'s default is unique per hold): a lease
    # held by this owner after an interrupted attempt is that attempt's grant.
    return status == "held" and holder == owner


def abandon_statement(connection: BaseDatabaseWrapper) -> None:
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
