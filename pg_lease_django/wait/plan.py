"""The blocking acquire's wait, written once: what to do next, as a generator that does no I/O.

`wait_plan` decides; a driver does. It is a `pg_lease_django.plans.Plan`. It yields the next step,
one of `TryOnce`, `ReadEpoch`, `Pause` and `Reconnect`. It is sent the step's answer: the
attempt's row, the key's epoch or None. A driver that lost its connection while a step ran throws
`Lost` in instead. The plan returns the grant or raises. It raises `LeaseTimeoutError` on timeout,
`OutcomeUnknownError` when a lost attempt may have been granted unseen, or the driver's error of a
lost connection it gives up on.

Two drivers run it with `drive` and `adrive`: `sync_driver.wait_and_acquire` on the caller's
Django connection and `async_driver.await_and_acquire` on a psycopg async connection. What they
share lives here only and is tested with a fake clock in tests/unit/test_wait_plan.py: the deadline,
the pause after a refusal, the rejoin after a lost connection and the check of an attempt whose
answer was lost. The poll interval is an argument, which the drivers read from the settings when
the wait starts.

A waiter outside a transaction may lose its connection, because the server crashed or failed
over. It then reconnects and goes on waiting. Through a multi-host ``HOST`` with
``target_session_attrs=read-write``, that is the promoted server. It keeps trying for
`REJOIN_WITHIN` seconds of lost connection at most, never past its deadline, then raises the
connection error. When the connection was lost during an attempt, that attempt may have been
granted unseen. So the plan first reads the key on the new connection. It goes on only if the
key's epoch is still the one the last refused attempt saw, meaning no grant since, its own
included. Otherwise it raises `OutcomeUnknownError`, an ``OperationalError``: the outcome is
unknown, as for any lost call. So a call returns at most one grant, the one it was told of.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pg_lease_django.exceptions import LeaseTimeoutError, OutcomeUnknownError
from pg_lease_django.operations import Attempt, Grant
from pg_lease_django.plans import Pause, Plan
from pg_lease_django.validation import MAX_WAIT, describe_seconds

logger = logging.getLogger(__name__)

#: Seconds a waiter whose connection was lost keeps trying to get one back (never past its own
#: deadline) before it raises the connection error: time for a failover manager to promote a standby.
REJOIN_WITHIN = 60.0
#: Pauses before the successive reconnection attempts of a waiter: the first at once, then backing off.
REJOIN_PAUSES = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
#: A waiter woken early by a notification attempts at once, WAKE_BURST times in a row at most, and
#: WAKE_RATE times a second beyond that; past it, it sleeps through notifications until its budget
#: allows the next attempt (or its pause ends). Any role that can connect may NOTIFY the channel, so a
#: flood of forged notifications costs a waiter at most WAKE_BURST + WAKE_RATE attempts a second
#: beyond its polls (each refused with one unlocked look), and a release at most 1 / WAKE_RATE s of latency.
WAKE_BURST = 4
WAKE_RATE = 10.0

Clock = Callable[[], float]


@dataclass(frozen=True)
class TryOnce:
    """Send one attempt; the answer is its `Attempt` row.

    A driver that LISTENs registers as a waiter until ``register_for`` from now, through
    ``pg_lease_acquire_or_register``. That is the longest it will pause, and the longest its attempt
    waits for a lock. A driver that polls waits for a lock at most ``within``, through
    ``pg_lease_acquire_within``. That is what is left of the deadline, or None for no deadline.
    """

    register_for: timedelta
    within: timedelta | None = None


@dataclass(frozen=True)
class ReadEpoch:
    """Read the key's epoch (``pg_lease_inspect``); answer: the epoch."""


@dataclass(frozen=True)
class Reconnect:
    """Drop the lost connection and open a new one after ``seconds``; answer: None."""

    seconds: float


Step = TryOnce | ReadEpoch | Pause | Reconnect


class Lost(Exception):
    """What a driver throws into the plan when the connection was lost while a step ran.

    ``error`` is the driver's error, raised again if the wait gives up. ``sent`` says the step's
    statement had been sent: an attempt lost before that granted nothing.
    """

    def __init__(self, error: BaseException, sent: bool = True) -> None:
        super().__init__(error)
        self.error = error
        self.sent = sent


def wait_plan(
    key: str,
    owner: str,
    wait: timedelta | None,
    *,
    rejoin: bool,
    poll_interval: float,
    clock: Clock = time.monotonic,
    since: float | None = None,
) -> Plan[Step, Grant]:
    """Attempt until granted, pausing after each refusal. With ``wait`` None there is no deadline.

    ``poll_interval`` is the longest pause between two attempts, ``PG_LEASE_POLL_INTERVAL``.

    ``since`` is when the wait began on ``clock``, or None for now. The async wait's first try is made
    before the plan starts, and counts.

    ``rejoin`` says a lost connection is reconnected. That is only outside a transaction: inside one
    the transaction is gone, and so is the wait. Only a connection that answered an attempt of this
    wait is rejoined. One that never could, with the server down or wrong settings, fails the call at
    once, as any other call.
    """
    deadline = None if wait is None else (clock() if since is None else since) + wait.total_seconds()
    rejoining = _Rejoin(key, deadline, clock) if rejoin else None
    wakes = _WakeBudget(clock())
    refused: Attempt | None = None  # the last refused attempt
    unsure: BaseException | None = None  # the loss of the connection during an attempt, until checked
    while True:
        if unsure is not None and refused is not None:
            answer = yield from _answer(ReadEpoch())
            if isinstance(answer, Lost):
                yield Reconnect(_rejoin_after(rejoining, answer.error))
                continue
            _nothing_granted(key, refused, answer, unsure)
            unsure = None
        answer = yield from _answer(TryOnce(retry_within(deadline, poll_interval, clock), left_of(deadline, clock)))
        if isinstance(answer, Lost):
            if answer.sent:
                unsure = answer.error
            yield Reconnect(_rejoin_after(rejoining, answer.error))
            continue
        if rejoining is not None:
            rejoining.answered()
        tried: Attempt = answer
        grant = tried.grant(key)
        if grant is not None:
            return grant
        refused = tried
        pause = pause_after_refusal(key, owner, refused, wait, deadline, poll_interval, clock)
        paused_at = clock()
        answer = yield from _answer(Pause(pause))
        if isinstance(answer, Lost):
            yield Reconnect(_rejoin_after(rejoining, answer.error))
            continue
        woken_at = clock()
        if woken_at - paused_at < pause:  # woken by a notification: a release, or a forged one
            rest = min(wakes.spend(woken_at), paused_at + pause - woken_at)
            if rest > 0:
                answer = yield from _answer(Pause(rest, wakeable=False))
                if isinstance(answer, Lost):
                    yield Reconnect(_rejoin_after(rejoining, answer.error))


def _answer(step: Step) -> Plan[Step, Any]:
    """Yield ``step``: its answer, or the `Lost` a driver threw in at it."""
    try:
        return (yield step)
    except Lost as lost:
        return lost


def _rejoin_after(rejoining: _Rejoin | None, error: BaseException) -> float:
    """Seconds before reconnecting after ``error``; raise ``error`` when the wait gives up."""
    pause = None if rejoining is None else rejoining.pause(error)
    if pause is None:
        raise error
    return pause


def pause_after_refusal(
    key: str,
    owner: str,
    refused: Attempt,
    wait: timedelta | None,
    deadline: float | None,
    poll_interval: float,
    clock: Clock = time.monotonic,
) -> float:
    """Seconds a waiter pauses after the refused attempt; LeaseTimeoutError once past ``deadline``.

    Until the holder's expiry on the server clock, ``poll_interval``, or the deadline on ``clock``.
    """
    now = clock()
    if deadline is not None and now >= deadline:
        waited = describe_seconds(wait) if wait is not None else "the wait"
        holder = "busy (a lock it needs was held)" if refused.owner is None else f"held by {refused.owner!r}"
        message = f"lease {key!r} still {holder} after waiting {waited}"
        raise LeaseTimeoutError(message, key=key, owner=owner, holder=refused.owner, current_epoch=refused.epoch)
    pause: float = min(max((refused.expires_at - refused.server_time).total_seconds(), 0.0), poll_interval)
    if deadline is not None:
        pause = min(pause, deadline - now)
    return pause


def left_of(deadline: float | None, clock: Clock = time.monotonic) -> timedelta | None:
    """What is left of ``deadline`` on ``clock``, none past it; None for no deadline.

    It is the longest a polling waiter's attempt may wait for a lock. The server counts it from the
    attempt's start, so no lock wait outlasts the deadline. When one would, the attempt is refused and
    changes nothing.
    """
    if deadline is None:
        return None
    return min(timedelta(seconds=max(deadline - clock(), 0.0)), MAX_WAIT)


def retry_within(deadline: float | None, poll_interval: float, clock: Clock = time.monotonic) -> timedelta:
    """The longest a waiter pauses before its next attempt unless woken: what it registers for.

    It is ``poll_interval``, or less when the deadline on ``clock`` comes sooner. The other bound is
    the holder's expiry, which the server knows from the attempt itself.
    """
    seconds = poll_interval
    if deadline is not None:
        seconds = min(seconds, deadline - clock())
    return min(timedelta(seconds=max(seconds, 0.0)), MAX_WAIT)


class _WakeBudget:
    """A token bucket of early wake-ups (`WAKE_BURST`, refilled at `WAKE_RATE` a second)."""

    def __init__(self, now: float) -> None:
        self.tokens = float(WAKE_BURST)
        self.at = now

    def spend(self, now: float) -> float:
        """Take one wake-up: 0 when there was one, else the seconds until there is one (taken then)."""
        self.tokens = min(float(WAKE_BURST), self.tokens + (now - self.at) * WAKE_RATE)
        self.at = now
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / WAKE_RATE


class _Rejoin:
    """How a waiter gets back a lost connection: when it tries, when it gives up."""

    def __init__(self, key: str, deadline: float | None, clock: Clock) -> None:
        self.key = key
        self.deadline = deadline
        self.clock = clock
        self.since: float | None = None  # clock() when the connection was lost; None: not lost
        self.tries = 0
        self.answered_once = False

    def pause(self, error: BaseException) -> float | None:
        """Seconds to wait before reconnecting after ``error``; None: give up."""
        if not self.answered_once:
            return None
        now = self.clock()
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
                "blocking acquire of %r reconnected after %.1f s: waiting on", self.key, self.clock() - self.since
            )
            self.since, self.tries = None, 0


def _nothing_granted(key: str, refused: Attempt, epoch: int, lost: BaseException) -> None:
    """Go on after losing the connection during an attempt only if ``key`` is still at the epoch of
    the last refused attempt: every grant raises the epoch, so the lost attempt granted nothing.
    Otherwise raise `OutcomeUnknownError`: the lost attempt's outcome is unknown."""
    if epoch == refused.epoch:
        return
    raise OutcomeUnknownError(
        f"blocking acquire of {key!r}: the connection was lost during an attempt, and the lease has changed "
        f"since (epoch {refused.epoch} -> {epoch}): the attempt's outcome is unknown ({lost})",
        key=key,
    ) from lost
