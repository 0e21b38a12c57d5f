"""An election's decisions (`pg_lease_django.election.plan`), term and rest alike, with a fake clock.

No database and no threads: each test plays a driver, answering the plan's steps and moving the
clock on by each `Pause`. What the drivers themselves do (the hold, the callback, ``stop()`` and
cancellation) stays covered in real time by tests/chaos/test_election.py and tests/chaos/test_campaign.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Mapping
from typing import Any

import pytest

from pg_lease_django.election.plan import (
    ENDED_BY_STOP,
    Announce,
    Campaign,
    Failed,
    Lead,
    Leave,
    Left,
    ReadLeader,
    Refused,
    Stand,
    Step,
    StepDown,
    TermEnd,
    Won,
    term_end,
)
from pg_lease_django.plans import Pause

POLL = 0.5
TTL = 6.0

Steps = Generator[Step, Any, None]

#: A term whose callback returned and whose hold was released, nothing else told.
RETURNED: Mapping[type, Any] = {Lead: TermEnd.RETURNED, Leave: Left(lost=False, handoff_requested=False)}
#: The steps of a won term up to the step-down.
TERM = [Announce("me"), Lead(), Leave(), StepDown()]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def campaign() -> tuple[Campaign, FakeClock, Steps]:
    clock = FakeClock()
    plan = Campaign("me", TTL, poll_interval=lambda: POLL, clock=clock)
    steps = plan.plan()
    assert next(steps) == Stand()
    return plan, clock, steps


def answer(steps: Steps, clock: FakeClock, step: Step, value: Any = None) -> Step:
    """Answer ``step`` (a Pause moves the clock on by its seconds) and return the next step."""
    if isinstance(step, Pause):
        clock.now += step.seconds
    return steps.send(value)


def steps_after(steps: Steps, clock: FakeClock, attempt: Any, answers: Mapping[type, Any] | None = None) -> list[Step]:
    """The steps the plan takes after an attempt answered ``attempt`` until it campaigns again; each
    step is answered from ``answers`` by its type (None when not there)."""
    answers = answers or {}
    taken: list[Step] = []
    step = steps.send(attempt)
    while step != Stand():
        taken.append(step)
        step = answer(steps, clock, step, answers.get(type(step)))
    return taken


# ---- between terms --------------------------------------------------------------------------------


def test_a_refusal_announces_the_holder_then_rests_one_poll_interval() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Refused("them")) == [Announce("them"), Pause(POLL)]
    assert steps_after(steps, clock, Refused(None)) == [Pause(POLL)]


def test_failed_attempts_back_off_doubling_up_to_one_ttl_and_a_served_term_resets_it() -> None:
    _, clock, steps = campaign()
    rests = [steps_after(steps, clock, Failed()) for _ in range(6)]
    assert rests == [[Pause(0.5)], [Pause(1.0)], [Pause(2.0)], [Pause(4.0)], [Pause(TTL)], [Pause(TTL)]]
    assert steps_after(steps, clock, Won(), RETURNED) == [*TERM, Pause(POLL)]
    assert steps_after(steps, clock, Failed()) == [Pause(0.5)]


# ---- a term ---------------------------------------------------------------------------------------


def test_a_won_term_announces_this_campaigner_leads_leaves_its_hold_then_steps_down() -> None:
    """``on_stopped_leading`` comes once the hold is left (released, unless lost)."""
    _, clock, steps = campaign()
    assert steps.send(Won()) == Announce("me")
    assert answer(steps, clock, Announce("me")) == Lead()
    assert answer(steps, clock, Lead(), TermEnd.RETURNED) == Leave()
    assert answer(steps, clock, Leave(), Left(lost=False, handoff_requested=False)) == StepDown()
    assert answer(steps, clock, StepDown()) == Pause(POLL)


def test_a_term_whose_callback_failed_steps_down_and_backs_off() -> None:
    _, clock, steps = campaign()
    failed = {**RETURNED, Lead: TermEnd.FAILED}
    assert steps_after(steps, clock, Won(), failed) == [*TERM, Pause(0.5)]
    assert steps_after(steps, clock, Won(), failed) == [*TERM, Pause(1.0)]


def test_a_database_failure_leaving_the_hold_still_steps_down_and_backs_off() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Won(), {**RETURNED, Leave: Failed()}) == [*TERM, Pause(0.5)]
    assert steps_after(steps, clock, Won(), {**RETURNED, Leave: Failed()}) == [*TERM, Pause(1.0)]


@pytest.mark.parametrize(
    ("left", "rest"),
    [
        (Left(lost=True, handoff_requested=False), 0.0),
        (Left(lost=False, handoff_requested=False), POLL),
        (Failed(), 0.5),
    ],
)
def test_a_term_cut_short_before_its_callback_started_leaves_the_hold_without_stepping_down(
    left: Left | Failed, rest: float
) -> None:
    """A task cancelled while announcing (``Lead`` answered None): no ``on_stopped_leading``."""
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Won(), {Lead: None, Leave: left}) == [Announce("me"), Lead(), Leave(), Pause(rest)]


@pytest.mark.parametrize(
    ("led", "left", "rest"),
    [
        (TermEnd.RETURNED, Left(lost=False, handoff_requested=False), POLL),
        (TermEnd.RETURNED, Left(lost=True, handoff_requested=False), 0.0),
        (TermEnd.RETURNED, Left(lost=True, handoff_requested=True), 0.0),
        (TermEnd.FAILED, Left(lost=True, handoff_requested=False), 0.0),
        (TermEnd.FAILED, Left(lost=False, handoff_requested=True), 0.5),
    ],
)
def test_after_a_return_one_poll_interval_after_a_loss_no_rest(led: TermEnd, left: Left, rest: float) -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Won(), {Lead: led, Leave: left}) == [*TERM, Pause(rest)]


@pytest.mark.parametrize(
    ("led", "left"),
    list(
        itertools.product(
            [TermEnd.RETURNED, TermEnd.FAILED, None],
            [Left(lost, handoff) for lost in (False, True) for handoff in (False, True)] + [Failed()],
        )
    ),
)
def test_every_won_term_leaves_its_hold_once_and_steps_down_after_it_iff_its_callback_ran(
    led: TermEnd | None, left: Left | Failed
) -> None:
    _, clock, steps = campaign()
    taken = steps_after(steps, clock, Won(), {Lead: led, Leave: left, ReadLeader: None})
    assert taken[:3] == [Announce("me"), Lead(), Leave()]
    assert taken.count(Leave()) == 1 and taken.count(Lead()) == 1
    assert taken.count(StepDown()) == (led is not None)
    assert all(isinstance(step, StepDown | Pause | ReadLeader) for step in taken[3:])
    assert isinstance(taken[-1], Pause)


# ---- after a hand-off -----------------------------------------------------------------------------

HANDOFF: Mapping[type, Any] = {Lead: TermEnd.RETURNED, Leave: Left(lost=False, handoff_requested=True)}


def test_after_a_hand_off_the_watch_ends_when_another_leader_is_seen() -> None:
    _, clock, steps = campaign()
    started = clock.now
    step = steps.send(Won())
    for taken in TERM:
        assert step == taken
        step = answer(steps, clock, step, HANDOFF.get(type(step)))
    for holder in (None, "me", None):  # nobody yet, ourselves (a read racing the release), nobody
        assert step == Pause(POLL)
        assert answer(steps, clock, step) == ReadLeader()
        step = answer(steps, clock, ReadLeader(), holder)
    assert answer(steps, clock, answer(steps, clock, step), "them") == Announce("them")
    assert answer(steps, clock, Announce("them")) == Stand()
    assert clock.now - started == pytest.approx(4 * POLL)


def test_after_a_hand_off_the_watch_gives_up_after_one_ttl() -> None:
    _, clock, steps = campaign()
    started = clock.now
    taken = steps_after(steps, clock, Won(), HANDOFF)
    looking = taken[len(TERM) :]
    assert taken[: len(TERM)] == TERM
    assert looking.count(ReadLeader()) == TTL / POLL - 1  # none after the last rest: its end is the deadline
    assert clock.now - started == pytest.approx(TTL)
    assert all(step in (ReadLeader(), Pause(POLL)) for step in looking)


def test_a_hand_off_resets_the_back_off() -> None:
    plan, clock, steps = campaign()
    steps_after(steps, clock, Failed())
    steps_after(steps, clock, Failed())
    assert plan.failures == 2
    steps_after(steps, clock, Won(), HANDOFF)
    assert plan.failures == 0


def test_a_failed_term_with_a_hand_off_requested_backs_off_without_watching() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Won(), {**HANDOFF, Lead: TermEnd.FAILED}) == [*TERM, Pause(0.5)]


# ---- a stop ---------------------------------------------------------------------------------------


def run_until_stopped(steps: Steps, clock: FakeClock, step: Step, answers: Mapping[type, Any]) -> list[Step]:
    """Play a driver stopped before ``step``: the steps it still takes until one of `ENDED_BY_STOP`."""
    taken: list[Step] = []
    while not isinstance(step, ENDED_BY_STOP):
        taken.append(step)
        step = answer(steps, clock, step, answers.get(type(step)))
    return taken


def test_a_stop_ends_the_campaign_at_its_next_attempt_rest_or_read_never_inside_a_term() -> None:
    _, clock, steps = campaign()
    assert run_until_stopped(steps, clock, steps.send(Won()), RETURNED) == TERM  # stopped while acquiring
    _, clock, steps = campaign()
    step = steps.send(Won())
    step = answer(steps, clock, step)  # stopped once the callback runs: Lead still returns, the hold is left
    assert run_until_stopped(steps, clock, step, RETURNED) == TERM[1:]
    _, clock, steps = campaign()
    assert run_until_stopped(steps, clock, steps.send(Refused("them")), {}) == [Announce("them")]


def test_the_steps_a_stop_ends_at() -> None:
    assert set(ENDED_BY_STOP) == {Stand, Pause, ReadLeader}


# ---- how a term ended -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ended", "lost", "handoff", "expected"),
    [
        (TermEnd.RETURNED, False, False, TermEnd.RETURNED),
        (TermEnd.RETURNED, False, True, TermEnd.HANDOFF),
        (TermEnd.FAILED, False, True, TermEnd.FAILED),
        (TermEnd.FAILED, False, False, TermEnd.FAILED),
        (TermEnd.RETURNED, True, True, TermEnd.LOST),
        (TermEnd.FAILED, True, False, TermEnd.LOST),
    ],
)
def test_a_loss_outranks_everything_and_a_hand_off_only_a_return(
    ended: TermEnd, lost: bool, handoff: bool, expected: TermEnd
) -> None:
    assert term_end(ended, lost=lost, handoff_requested=handoff) == expected
