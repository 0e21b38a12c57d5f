"""The settling of an interrupted attempt (`settling_plan`), driven by hand with a fake clock: no database.

Both drivers run this plan (`settling.settle` on Django's connection, `settling.asettle` on the async
wait's own session); their behaviour on a real server is tests/db/test_interrupts.py, test_async.py and
test_unconfirmed_commit.py. Here: which statements the plan asks for, in which order, and when it
stops waiting for the attempt to end.
"""

from __future__ import annotations

from collections.abc import Generator
from datetime import UTC, datetime
from typing import Any, Literal

import pytest

from pg_lease_django.operations import LeaseState
from pg_lease_django.plans import Pause
from pg_lease_django.wait.settling import (
    SETTLE_WITHIN,
    CancelAttempt,
    InFlight,
    Inspect,
    ReleaseWithin,
    SettlingStep,
    settling_plan,
)

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
SENT = InFlight(4242, "pg_lease_django attempt 0123")


def state(status: Literal["free", "held", "lapsed"], owner: str | None, epoch: int = 7) -> LeaseState:
    return LeaseState("k", status, owner, epoch, NOW if owner else None, NOW)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def steps(plan: Generator[SettlingStep, Any, None], answers: list[Any], clock: Clock | None = None) -> list[Any]:
    """Drive ``plan`` with ``answers`` (an exception is thrown in); every step it asked for."""
    asked: list[Any] = []
    answer: Any = None
    try:
        step = plan.send(None)
        while True:
            asked.append(step)
            if isinstance(step, Pause) and clock is not None:
                clock.now += step.seconds
            answer = answers.pop(0)
            step = plan.throw(answer) if isinstance(answer, Exception) else plan.send(answer)
    except StopIteration:
        pass
    assert not answers, f"answers left over: {answers}"
    return asked


def test_a_grant_in_the_owners_name_is_released_at_the_epoch_read() -> None:
    asked = steps(settling_plan("k", "me", None), [state("held", "me", 7), True])
    assert asked == [Inspect("k"), ReleaseWithin("k", "me", 7)]


@pytest.mark.parametrize("found", [state("held", "other"), state("free", None), state("lapsed", "me")])
def test_nothing_is_released_that_is_not_the_owners_live_grant(found: LeaseState) -> None:
    assert steps(settling_plan("k", "me", None), [found]) == [Inspect("k")]


def test_the_attempt_is_cancelled_until_it_no_longer_runs_then_the_lease_is_read() -> None:
    clock = Clock()
    asked = steps(settling_plan("k", "me", SENT, clock), [True, None, True, None, False, state("free", None)], clock)
    assert asked == [
        CancelAttempt(SENT),
        Pause(0.01),
        CancelAttempt(SENT),
        Pause(0.01),
        CancelAttempt(SENT),
        Inspect("k"),
    ]


def test_an_attempt_that_runs_on_is_waited_for_settle_within_seconds_then_the_lease_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past SETTLE_WITHIN the settling says so once, and what becomes of a grant the attempt may make."""
    clock = Clock()
    plan = settling_plan("k", "me", SENT, clock)
    step = plan.send(None)
    cancels = 0
    while isinstance(step, CancelAttempt | Pause):
        cancels += isinstance(step, CancelAttempt)
        if isinstance(step, Pause):
            clock.now += step.seconds
        step = plan.send(True)  # still running, whatever is sent
    assert step == Inspect("k")
    assert cancels == pytest.approx(SETTLE_WITHIN / 0.01, abs=2)
    assert clock.now >= 100.0 + SETTLE_WITHIN
    [said] = [r.getMessage() for r in caplog.records if "still runs" in r.getMessage()]
    assert "nobody holds the lease and it lapses at its expiry" in said


def test_a_cancel_refused_by_the_server_is_passed_by_and_the_lease_read_all_the_same(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = PermissionError("must be a member of the role whose process is being terminated")
    asked = steps(settling_plan("k", "me", SENT, Clock()), [refused, state("held", "me", 3), False])
    assert asked == [CancelAttempt(SENT), Inspect("k"), ReleaseWithin("k", "me", 3)]
    [said] = [r.getMessage() for r in caplog.records if "lapses at its expiry" in r.getMessage()]
    assert "could not be looked for" in said  # once, with the lease's fate
    assert "lapsed or taken meanwhile" in caplog.text  # the release found nothing to give back


def test_an_error_reading_the_lease_goes_to_the_driver() -> None:
    plan = settling_plan("k", "me", None)
    assert plan.send(None) == Inspect("k")
    with pytest.raises(ConnectionError):
        plan.throw(ConnectionError("lost"))
