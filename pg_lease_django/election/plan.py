"""An election's campaign, written once: what to do between terms, as a generator that does no I/O.

`Campaign.plan` decides; a driver does. It yields the next step (`RunTerm`, `Rest`, `ReadLeader`,
`Announce`, `StepDown`) and is sent the step's answer. Two drivers run it: `Election`'s thread
(``elect()``, blocking, a `Rest` cut short by ``stop()``) and its coroutine (``aelect()``, a `Rest`
cut short by cancellation). A term itself (the hold, the leader callback, ending it on a loss or a
hand-off) is each driver's own, because a thread and a task are stopped differently; how a term
ended is sent back as a `TermOutcome`, and everything after it is decided here: whom to announce,
when to call ``on_stopped_leading``, how long to rest, the watch for a new leader after a hand-off.
As in `wait_plan`, this is psycopg's habit (generators that yield what to wait for, run by a
blocking and an async waiter), and it lets the rest and the watch be tested with a fake clock
(tests/test_election_plan.py).

Resting before the next campaign keeps a leader from taking its lease straight back: after a
hand-off, until another leader is seen or one TTL has passed; after the callback raised (or the
term was failed by `pg_lease_django.election.fail_term`), a back-off doubling from the poll interval
up to one TTL; after the callback returned, one poll interval (the others try in the meantime).
After a loss there is no rest: the lease is someone else's, or nobody's.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from pg_lease_django import conf

Clock = Callable[[], float]


class TermEnd(enum.Enum):
    """Why a term ended: it decides the rest before the next campaign."""

    RETURNED = "returned"
    FAILED = "failed"
    HANDOFF = "hand-off"
    LOST = "lost"
    STOPPED = "stopped"


def term_end(ended: TermEnd, *, lost: bool, handoff_requested: bool) -> TermEnd:
    """What ended a term once its callback is done: a loss or a hand-off outrank a return."""
    if lost:
        return TermEnd.LOST
    if ended == TermEnd.RETURNED and handoff_requested:
        return TermEnd.HANDOFF
    return ended


# ---- what the drivers report about one campaign attempt -------------------------------------------


@dataclass(frozen=True)
class Refused:
    """The attempt was refused; ``holder`` is the leader it named (None: not named)."""

    holder: str | None


@dataclass(frozen=True)
class CampaignFailed:
    """The database failed the attempt (or the hold around a term); ``led``: a term had started."""

    led: bool


@dataclass(frozen=True)
class Served:
    """A term was won and its hold left; ``ended``: why (`term_end`). ``led``: its callback was
    started (a lease lost before that ends the term with no ``on_stopped_leading``)."""

    ended: TermEnd
    led: bool = True


TermOutcome = Refused | CampaignFailed | Served


# ---- the steps ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunTerm:
    """Campaign once and, when elected, serve the term; answer: its `TermOutcome`."""


@dataclass(frozen=True)
class Rest:
    """Wait ``seconds`` (a blocking driver wakes on ``stop()`` and ends); answer: None."""

    seconds: float


@dataclass(frozen=True)
class ReadLeader:
    """Read who holds the key (``inspect``); answer: the holder, None when nobody holds it or the
    read failed (the driver logs the failure)."""


@dataclass(frozen=True)
class Announce:
    """``identity`` was seen leading: record it and call ``on_new_leader`` if it is a change; answer: None."""

    identity: str


@dataclass(frozen=True)
class StepDown:
    """Call ``on_stopped_leading``: the term's hold has been left; answer: None."""


Step = RunTerm | Rest | ReadLeader | Announce | StepDown


class Campaign:
    """The decisions of one election between its terms (its back-off is the only state kept)."""

    def __init__(
        self,
        owner: str,
        ttl: float,
        *,
        poll_interval: Callable[[], float] = conf.poll_interval,
        clock: Clock = time.monotonic,
    ) -> None:
        self.owner = owner
        self.ttl = ttl
        self.poll_interval = poll_interval
        self.clock = clock
        self.failures = 0  # terms (or attempts) in a row that failed: the back-off

    def plan(self) -> Generator[Step, Any, None]:
        """Campaign for ever: the driver stops sending when stopped (or cancelled)."""
        while True:
            outcome = yield RunTerm()
            if isinstance(outcome, Refused):
                if outcome.holder is not None:
                    yield Announce(outcome.holder)
                yield Rest(self.poll_interval())
            elif isinstance(outcome, CampaignFailed):
                if outcome.led:
                    yield StepDown()
                yield Rest(self.rest(TermEnd.FAILED))
            else:
                if outcome.led:
                    yield StepDown()
                if outcome.ended == TermEnd.HANDOFF:
                    yield from self.watch(self.rest(TermEnd.HANDOFF))
                else:
                    yield Rest(self.rest(outcome.ended))

    def rest(self, ended: TermEnd) -> float:
        """Seconds to wait before campaigning again after a term that ended so (module docstring)."""
        poll = self.poll_interval()
        if ended == TermEnd.FAILED:
            self.failures += 1
            return float(min(self.ttl, poll * 2 ** min(self.failures - 1, 16)))
        self.failures = 0
        if ended == TermEnd.HANDOFF:
            return self.ttl
        return poll if ended == TermEnd.RETURNED else 0.0

    def watch(self, seconds: float) -> Generator[Step, Any, None]:
        """After a hand-off: rest until another leader is seen (announced) or ``seconds`` pass."""
        deadline = self.clock() + seconds
        while (remaining := deadline - self.clock()) > 0:
            yield Rest(min(self.poll_interval(), remaining))
            if self.clock() >= deadline:
                return
            holder = yield ReadLeader()
            if holder is not None and holder != self.owner:
                yield Announce(holder)
                return
