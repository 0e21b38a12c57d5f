"""An election written once: what a campaign does, term after term, as a generator that does no I/O.

`Campaign.plan` decides; a driver does. The plan yields the next step and is sent the step's
answer. Two drivers run it with `pg_lease_django.plans.drive` and `adrive`. `Election`'s thread,
behind ``elect()``, makes blocking calls, and ``stop()`` cuts a `Pause` short. `AsyncElection`'s
task, behind ``aelect()``, awaits, and a cancellation cuts a `Pause` short.

The decisions are all here. A campaign stands once at a time. After winning, the campaigner
announces itself, leads, leaves the hold, then calls ``on_stopped_leading``, but only if the leader
callback ran. `term_end` decides how the term ended. The plan also decides how long to rest and
the look for a new leader after a hand-off. `ENDED_BY_STOP` lists the steps a stopped campaign no
longer takes. What stays each driver's own is how a step is done. A thread's leader callback
returns when told through ``wait_stop``, while a task's is cancelled. A stop is an event for one
and a cancellation for the other. As in `pg_lease_django.wait.plan`, this is psycopg's habit:
generators that yield what to wait for, run by a blocking and an async waiter. It lets every
decision be tested with a fake clock, in tests/unit/test_election_plan.py.

Resting before the next campaign keeps a leader from taking its lease straight back. After a
hand-off it rests until another leader is seen or one TTL has passed. After the callback raised,
or the term was failed by `pg_lease_django.election.fail_term`, it backs off, doubling from the poll
interval up to one TTL. After the callback returned, it rests one poll interval, and the others try
in the meantime. After a loss there is no rest: the lease is someone else's, or nobody's.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from pg_lease_django.plans import Pause, Plan

Clock = Callable[[], float]


class TermEnd(enum.Enum):
    """Why a term ended: it decides the rest before the next campaign."""

    RETURNED = "returned"
    FAILED = "failed"
    HANDOFF = "hand-off"
    LOST = "lost"


def term_end(ended: TermEnd, *, lost: bool, handoff_requested: bool) -> TermEnd:
    """What ended a term once its hold is left: a loss or a hand-off outrank a return."""
    if lost:
        return TermEnd.LOST
    if ended == TermEnd.RETURNED and handoff_requested:
        return TermEnd.HANDOFF
    return ended


# ---- the steps ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stand:
    """Stand once for leader: enter a hold of the key without waiting; answer: `Won`, `Refused` or `Failed`."""


@dataclass(frozen=True)
class Announce:
    """``identity`` was seen leading: record it and call ``on_new_leader`` if it is a change; answer: None."""

    identity: str


@dataclass(frozen=True)
class Lead:
    """Call ``on_started_leading`` with the term's lease and wait until the term must end.

    The answer is `TermEnd.RETURNED`. It is `TermEnd.FAILED` when the callback raised, which the
    driver logged, or when `fail_term` failed the term. It is None when the term was cut short before
    the callback could start, as for a task cancelled while announcing.
    """


@dataclass(frozen=True)
class Leave:
    """Leave the term's hold: release, unless the lease was lost; answer: `Left` or `Failed`."""


@dataclass(frozen=True)
class StepDown:
    """Call ``on_stopped_leading``: the term's hold has been left; answer: None."""


@dataclass(frozen=True)
class ReadLeader:
    """Read who holds the key with ``inspect``.

    The answer is the holder, or None when nobody holds it or the read failed. The driver logs the
    failure.
    """


Step = Stand | Announce | Lead | Leave | StepDown | Pause | ReadLeader

#: The steps a stopped campaign does not take: once stopped, a driver throws its stop into the plan
#: at the next of them, which ends the plan; a thread then returns and a task raises its CancelledError.
#: A term in progress still ends as a term does (`Lead` returns, `Leave`, `StepDown`), and an
#: announcement is still made.
ENDED_BY_STOP = (Stand, Pause, ReadLeader)


# ---- the answers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Won:
    """The attempt won the lease: the term's hold is entered (the driver keeps it until `Leave`)."""


@dataclass(frozen=True)
class Refused:
    """The attempt was refused; ``holder`` is the leader it named (None: not named)."""

    holder: str | None


@dataclass(frozen=True)
class Failed:
    """The database failed the attempt or the leaving of the hold (logged by the driver, unless stopped)."""


@dataclass(frozen=True)
class Left:
    """The term's hold was left; what its lease said then."""

    lost: bool
    handoff_requested: bool


class Campaign:
    """The decisions of one election (its back-off is the only state kept).

    ``poll_interval`` returns the pause between two attempts, read before each rest, so that the
    caller decides where the setting comes from.
    """

    def __init__(
        self,
        owner: str,
        ttl: float,
        *,
        poll_interval: Callable[[], float],
        clock: Clock = time.monotonic,
    ) -> None:
        self.owner = owner
        self.ttl = ttl
        self.poll_interval = poll_interval
        self.clock = clock
        self.failures = 0  # terms (or attempts) in a row that failed: the back-off

    def plan(self) -> Plan[Step, None]:
        """Campaign for ever: a driver stops at a step of `ENDED_BY_STOP` once stopped (or cancelled)."""
        while True:
            stood = yield Stand()
            if isinstance(stood, Won):
                yield from self.term()
            elif isinstance(stood, Refused):
                if stood.holder is not None:
                    yield Announce(stood.holder)
                yield Pause(self.poll_interval())
            else:
                yield Pause(self.rest(TermEnd.FAILED))

    def term(self) -> Plan[Step, None]:
        """A term won: announce this campaigner, lead, leave the hold, step down if the callback ran, rest."""
        yield Announce(self.owner)
        led: TermEnd | None = yield Lead()
        left = yield Leave()
        if led is not None:
            yield StepDown()
        if isinstance(left, Left):
            returned = TermEnd.RETURNED if led is None else led
            ended = term_end(returned, lost=left.lost, handoff_requested=left.handoff_requested)
        else:
            ended = TermEnd.FAILED
        if ended == TermEnd.HANDOFF:
            yield from self.look_for_leader(self.rest(ended))
        else:
            yield Pause(self.rest(ended))

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

    def look_for_leader(self, seconds: float) -> Plan[Step, None]:
        """After a hand-off: rest until another leader is seen (announced) or ``seconds`` pass."""
        deadline = self.clock() + seconds
        while (remaining := deadline - self.clock()) > 0:
            yield Pause(min(self.poll_interval(), remaining))
            if self.clock() >= deadline:
                return
            holder = yield ReadLeader()
            if holder is not None and holder != self.owner:
                yield Announce(holder)
                return
