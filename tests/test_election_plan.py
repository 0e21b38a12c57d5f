"""The campaign's decisions between terms (`pg_lease_django.election.plan`), with a fake clock.

No database and no threads: each test plays a driver, answering the plan's steps and moving the
clock on by each `Rest`. What the drivers themselves do (the hold, the callback, ``stop()`` and
cancellation) stays covered in real time by tests/test_election.py and tests/test_campaign.py.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from pg_lease_django.election.plan import (
    Announce,
    Campaign,
    CampaignFailed,
    ReadLeader,
    Refused,
    Rest,
    RunTerm,
    Served,
    Step,
    StepDown,
    TermEnd,
    term_end,
)

POLL = 0.5
TTL = 6.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def campaign() -> tuple[Campaign, FakeClock, Generator[Step, Any, None]]:
    clock = FakeClock()
    plan = Campaign("me", TTL, poll_interval=lambda: POLL, clock=clock)
    steps = plan.plan()
    assert next(steps) == RunTerm()
    return plan, clock, steps


def answer(steps: Generator[Step, Any, None], clock: FakeClock, step: Step, value: Any = None) -> Step:
    """Answer ``step`` (a Rest moves the clock on by its seconds) and return the next step."""
    if isinstance(step, Rest):
        clock.now += step.seconds
    return steps.send(value)


def steps_after(steps: Generator[Step, Any, None], clock: FakeClock, outcome: Any) -> list[Step]:
    """The steps the plan takes after a term's ``outcome`` until it campaigns again (None answers)."""
    taken: list[Step] = []
    step = steps.send(outcome)
    while step != RunTerm():
        taken.append(step)
        step = answer(steps, clock, step)
    return taken


def test_a_refusal_announces_the_holder_then_rests_one_poll_interval() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Refused("them")) == [Announce("them"), Rest(POLL)]
    assert steps_after(steps, clock, Refused(None)) == [Rest(POLL)]


def test_failed_attempts_back_off_doubling_up_to_one_ttl_and_a_served_term_resets_it() -> None:
    _, clock, steps = campaign()
    rests = [steps_after(steps, clock, CampaignFailed(led=False)) for _ in range(6)]
    assert rests == [[Rest(0.5)], [Rest(1.0)], [Rest(2.0)], [Rest(4.0)], [Rest(TTL)], [Rest(TTL)]]
    assert steps_after(steps, clock, Served(TermEnd.RETURNED)) == [StepDown(), Rest(POLL)]
    assert steps_after(steps, clock, CampaignFailed(led=False)) == [Rest(0.5)]


def test_a_term_whose_callback_failed_steps_down_and_backs_off() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, Served(TermEnd.FAILED)) == [StepDown(), Rest(0.5)]
    assert steps_after(steps, clock, Served(TermEnd.FAILED)) == [StepDown(), Rest(1.0)]


def test_a_database_failure_after_the_callback_started_still_steps_down() -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, CampaignFailed(led=True)) == [StepDown(), Rest(0.5)]


@pytest.mark.parametrize(
    ("outcome", "after"),
    [
        (Served(TermEnd.RETURNED), [StepDown(), Rest(POLL)]),
        (Served(TermEnd.STOPPED), [StepDown(), Rest(0.0)]),
        (Served(TermEnd.LOST), [StepDown(), Rest(0.0)]),
        (Served(TermEnd.LOST, led=False), [Rest(0.0)]),
    ],
)
def test_after_a_return_one_poll_interval_after_a_loss_no_rest(outcome: Served, after: list[Step]) -> None:
    _, clock, steps = campaign()
    assert steps_after(steps, clock, outcome) == after


def test_after_a_hand_off_the_watch_ends_when_another_leader_is_seen() -> None:
    _, clock, steps = campaign()
    started = clock.now
    assert steps.send(Served(TermEnd.HANDOFF)) == StepDown()
    step = answer(steps, clock, StepDown())
    for holder in (None, "me", None):  # nobody yet, ourselves (a read racing the release), nobody
        assert step == Rest(POLL)
        assert answer(steps, clock, step) == ReadLeader()
        step = answer(steps, clock, ReadLeader(), holder)
    assert answer(steps, clock, answer(steps, clock, step), "them") == Announce("them")
    assert answer(steps, clock, Announce("them")) == RunTerm()
    assert clock.now - started == pytest.approx(4 * POLL)


def test_after_a_hand_off_the_watch_gives_up_after_one_ttl() -> None:
    _, clock, steps = campaign()
    started = clock.now
    taken = steps_after(steps, clock, Served(TermEnd.HANDOFF))
    reads = taken.count(ReadLeader())
    assert taken[0] == StepDown()
    assert reads == TTL / POLL - 1  # none after the last rest: its end is the deadline
    assert clock.now - started == pytest.approx(TTL)
    assert all(step in (StepDown(), ReadLeader(), Rest(POLL)) for step in taken)


def test_a_hand_off_resets_the_back_off() -> None:
    plan, clock, steps = campaign()
    steps_after(steps, clock, CampaignFailed(led=False))
    steps_after(steps, clock, CampaignFailed(led=False))
    assert plan.failures == 2
    steps_after(steps, clock, Served(TermEnd.HANDOFF))
    assert plan.failures == 0


@pytest.mark.parametrize(
    ("ended", "lost", "handoff", "expected"),
    [
        (TermEnd.RETURNED, False, False, TermEnd.RETURNED),
        (TermEnd.RETURNED, False, True, TermEnd.HANDOFF),
        (TermEnd.FAILED, False, True, TermEnd.FAILED),
        (TermEnd.STOPPED, False, True, TermEnd.STOPPED),
        (TermEnd.RETURNED, True, True, TermEnd.LOST),
        (TermEnd.FAILED, True, False, TermEnd.LOST),
    ],
)
def test_a_loss_outranks_everything_and_a_hand_off_only_a_return(
    ended: TermEnd, lost: bool, handoff: bool, expected: TermEnd
) -> None:
    assert term_end(ended, lost=lost, handoff_requested=handoff) == expected
