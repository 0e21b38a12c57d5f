"""The blocking acquire's plan (`wait_plan`), driven by hand with a fake clock: no database, no waiting.

Each test sends the answers a driver would (attempt rows, an epoch) or throws its `Lost`, and checks the steps the
plan asks for and the values it computes: the pause after a refusal, the deadline, the rejoin's
back-off and its limits, the check of an attempt whose answer was lost. The real-time behaviour of
the two drivers, on a real server, is tests/db/test_blocking.py, test_async.py, test_interrupts.py and
test_failover_listen.py (one per behaviour); the timing arithmetic is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError

from pg_lease_django.exceptions import LeaseTimeoutError
from pg_lease_django.operations import Attempt, Grant
from pg_lease_django.plans import Pause, Plan
from pg_lease_django.wait.plan import (
    REJOIN_PAUSES,
    REJOIN_WITHIN,
    WAKE_BURST,
    WAKE_RATE,
    Lost,
    ReadEpoch,
    Reconnect,
    Step,
    TryOnce,
    left_of,
    pause_after_refusal,
    retry_within,
    wait_plan,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


POLL = 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seconds(step: Step | Granted) -> float:
    assert isinstance(step, Pause | Reconnect)
    return step.seconds


def refused(epoch: int = 7, expires_in: float = 10.0, holder: str = "holder") -> Attempt:
    return Attempt(False, "k", holder, epoch, NOW + timedelta(seconds=expires_in), NOW)


def granted(epoch: int = 8) -> Attempt:
    return Attempt(True, "k", "me", epoch, NOW + timedelta(seconds=30), NOW)


@dataclass(frozen=True)
class Granted:
    """Not a step: the plan's end, with the grant it returned."""

    grant: Grant


def step_with(plan: Plan[Step, Grant], answer: Any) -> Step | Granted:
    """Play the driver: send ``answer`` (None to start) or throw it in when it is `Lost`; the next step,
    or `Granted` at the plan's end."""
    try:
        return plan.throw(answer) if isinstance(answer, Lost) else plan.send(answer)
    except StopIteration as done:
        return Granted(done.value)


def start(clock: FakeClock, wait: float | None = 5.0, *, rejoin: bool = True) -> tuple[Plan[Step, Grant], Step]:
    timeout = None if wait is None else timedelta(seconds=wait)
    plan = wait_plan("k", "me", timeout, rejoin=rejoin, poll_interval=POLL, clock=clock)
    step = step_with(plan, None)
    assert not isinstance(step, Granted)
    return plan, step


def test_a_grant_at_the_first_attempt_ends_the_plan() -> None:
    plan, step = start(FakeClock())
    assert isinstance(step, TryOnce)
    done = step_with(plan, granted())
    assert isinstance(done, Granted)
    assert done.grant.epoch == 8
    assert done.grant.owner == "me"


def test_the_pause_after_a_refusal_is_the_poll_the_expiry_or_the_deadline() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=5.0)
    assert step_with(plan, refused(expires_in=10.0)) == Pause(0.5)  # the poll interval comes first
    assert isinstance(step_with(plan, None), TryOnce)
    assert seconds(step_with(plan, refused(expires_in=0.2))) == pytest.approx(0.2)  # the holder's expiry
    assert isinstance(step_with(plan, None), TryOnce)
    assert step_with(plan, refused(expires_in=-3.0)) == Pause(0.0)  # lapsed: try again at once
    clock.now += 4.9
    assert isinstance(step_with(plan, None), TryOnce)
    assert seconds(step_with(plan, refused())) == pytest.approx(0.1)  # the deadline


def test_a_refusal_at_the_deadline_raises_the_timeout() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=2.0)
    step_with(plan, refused())
    clock.now += 2.0
    step_with(plan, None)
    with pytest.raises(LeaseTimeoutError, match="still held by 'holder' after waiting 2 s") as timed_out:
        step_with(plan, refused())
    # The caller's side, then the key's (the error model of every LeaseError).
    error = timed_out.value
    assert (error.key, error.owner, error.epoch, error.holder, error.current_epoch) == ("k", "me", None, "holder", 7)


def test_no_deadline_waits_on() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=None)
    for _ in range(3):
        clock.now += 1e6
        assert step_with(plan, refused()) == Pause(0.5)
        assert isinstance(step_with(plan, None), TryOnce)


def test_a_waiter_registers_for_the_poll_or_what_is_left_of_its_wait() -> None:
    clock = FakeClock()
    plan, first = start(clock, wait=5.0)
    assert first == TryOnce(timedelta(seconds=0.5), timedelta(seconds=5))
    step_with(plan, refused())
    clock.now += 4.8
    step = step_with(plan, None)
    assert isinstance(step, TryOnce)
    assert step.register_for.total_seconds() == pytest.approx(0.2)
    assert retry_within(clock.now - 1.0, POLL, clock) == timedelta(0)  # never negative past the deadline
    assert retry_within(None, POLL, clock) == timedelta(seconds=0.5)


def test_each_attempt_may_wait_for_a_lock_what_is_left_of_the_deadline_at_most() -> None:
    """A polling waiter's attempt (pg_lease_acquire_within) waits for a lock no longer than the
    deadline allows: what is left of it when the attempt is sent, none past it, no bound without one."""
    clock = FakeClock()
    plan, first = start(clock, wait=3.0)
    assert isinstance(first, TryOnce) and first.within == timedelta(seconds=3)
    step_with(plan, refused())
    clock.now += 2.25
    step = step_with(plan, None)
    assert isinstance(step, TryOnce) and step.within is not None
    assert step.within.total_seconds() == pytest.approx(0.75)
    assert left_of(clock.now - 1.0, clock) == timedelta(0)
    assert left_of(None, clock) is None
    _, first = start(FakeClock(), wait=None)
    assert isinstance(first, TryOnce) and first.within is None


def test_pause_after_refusal_reads_the_server_clock_not_the_clients() -> None:
    clock = FakeClock()
    # The holder's expiry is 0.3 s ahead on the server's clock, whatever the client's says.
    answer = Attempt(False, "k", "holder", 3, NOW + timedelta(days=1, seconds=0.3), NOW + timedelta(days=1))
    assert pause_after_refusal("k", "me", answer, None, None, POLL, clock) == pytest.approx(0.3)


def test_a_connection_lost_before_any_answer_fails_the_call_at_once() -> None:
    plan, _ = start(FakeClock())
    error = OperationalError("server closed the connection")
    with pytest.raises(OperationalError) as raised:
        step_with(plan, Lost(error))
    assert raised.value is error


def test_inside_a_transaction_a_lost_connection_is_never_rejoined() -> None:
    plan, _ = start(FakeClock(), rejoin=False)
    step_with(plan, refused())
    step_with(plan, None)
    error = OperationalError("lost")
    with pytest.raises(OperationalError) as raised:
        step_with(plan, Lost(error))
    assert raised.value is error


def test_a_lost_connection_is_rejoined_backing_off_then_given_up_after_rejoin_within() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=None)
    step_with(plan, refused())  # an answer: the connection worked once
    pauses = []
    step = step_with(plan, Lost(OperationalError("lost"), sent=False))  # lost during the pause
    while isinstance(step, Reconnect):
        pauses.append(step.seconds)
        clock.now += step.seconds
        step = step_with(plan, None)
        assert isinstance(step, TryOnce)  # nothing to check: the pause had no statement in flight
        if len(pauses) == 8:
            clock.now += REJOIN_WITHIN  # the server stays away
        if clock.now - 1000.0 >= REJOIN_WITHIN:
            with pytest.raises(OperationalError, match="still down"):
                step_with(plan, Lost(OperationalError("still down"), sent=False))
            break
        step = step_with(plan, Lost(OperationalError("still down"), sent=False))
    else:
        pytest.fail(f"the plan did not give up: {step}")
    assert pauses[: len(REJOIN_PAUSES)] == list(REJOIN_PAUSES)
    assert pauses[len(REJOIN_PAUSES) :] == [REJOIN_PAUSES[-1]] * (len(pauses) - len(REJOIN_PAUSES))
    assert clock.now - 1000.0 >= REJOIN_WITHIN


def test_a_rejoin_never_pauses_past_the_deadline() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=3.0)
    step_with(plan, refused())
    step_with(plan, None)
    clock.now += 2.99
    step = step_with(plan, Lost(OperationalError("lost"), sent=False))
    assert isinstance(step, Reconnect)
    assert step.seconds == pytest.approx(0.0)  # the first pause: at once
    step_with(plan, None)
    clock.now += 0.005
    step = step_with(plan, Lost(OperationalError("lost"), sent=False))
    assert isinstance(step, Reconnect)
    assert step.seconds == pytest.approx(0.005)  # 0.05 backed off, cut at the deadline
    step_with(plan, None)
    clock.now += 0.01
    with pytest.raises(OperationalError, match="lost"):
        step_with(plan, Lost(OperationalError("lost"), sent=False))


def test_an_answer_after_rejoining_resets_the_back_off() -> None:
    clock = FakeClock()
    plan, _ = start(clock, wait=None)
    step_with(plan, refused())
    for _ in range(4):
        step_with(plan, None)
        step_with(plan, Lost(OperationalError("lost"), sent=False))
    step_with(plan, None)
    step_with(plan, refused())  # answered: back
    step = step_with(plan, Lost(OperationalError("lost again"), sent=False))
    assert step == Reconnect(REJOIN_PAUSES[0])


def test_an_attempt_lost_in_flight_is_checked_and_the_wait_goes_on_when_nothing_was_granted() -> None:
    plan, _ = start(FakeClock())
    step_with(plan, refused(epoch=7))
    step_with(plan, None)
    assert isinstance(step_with(plan, Lost(OperationalError("lost"), sent=True)), Reconnect)
    assert isinstance(step_with(plan, None), ReadEpoch)
    assert isinstance(step_with(plan, 7), TryOnce)  # still the refused attempt's epoch: nothing granted
    assert isinstance(step_with(plan, granted()), Granted)


def test_an_attempt_lost_in_flight_when_the_lease_changed_has_an_unknown_outcome() -> None:
    plan, _ = start(FakeClock())
    step_with(plan, refused(epoch=7))
    step_with(plan, None)
    step_with(plan, Lost(OperationalError("lost"), sent=True))
    step_with(plan, None)
    with pytest.raises(OperationalError, match=r"epoch 7 -> 8\): the attempt's outcome is unknown") as raised:
        step_with(plan, 8)
    assert str(raised.value.__cause__) == "lost"


def test_the_check_survives_a_second_loss() -> None:
    plan, _ = start(FakeClock())
    step_with(plan, refused(epoch=7))
    step_with(plan, None)
    step_with(plan, Lost(OperationalError("lost"), sent=True))
    step_with(plan, None)
    assert isinstance(step_with(plan, Lost(OperationalError("lost while reading"))), Reconnect)
    assert isinstance(step_with(plan, None), ReadEpoch)  # still to check before the next attempt
    with pytest.raises(OperationalError, match="outcome is unknown"):
        step_with(plan, 9)


def test_an_attempt_lost_before_it_was_sent_needs_no_check() -> None:
    plan, _ = start(FakeClock())
    step_with(plan, refused(epoch=7))
    step_with(plan, None)
    step_with(plan, Lost(OperationalError("lost while connecting"), sent=False))
    assert isinstance(step_with(plan, None), TryOnce)


def test_forged_notifications_cost_a_bounded_number_of_attempts_a_second() -> None:
    """Issue 42 finding 5: any role may NOTIFY the channel, and 5,000 notifications made a waiter try
    1,238 extra acquires. Woken early, a waiter attempts at once WAKE_BURST times in a row, then at
    WAKE_RATE a second: past its budget it sleeps through notifications (a pause that is not wakeable)."""
    clock = FakeClock()
    plan, first = start(clock, wait=60.0)
    step: Step | Granted = first
    attempts = 0
    woken_at = clock.now
    while clock.now < woken_at + 10.0:
        assert isinstance(step, TryOnce)
        attempts += 1
        step = step_with(plan, refused(expires_in=30.0))
        assert isinstance(step, Pause) and step.wakeable
        clock.now += 0.001  # a notification arrives at once, every time
        step = step_with(plan, None)
        if isinstance(step, Pause):  # over budget: a pause no notification ends
            assert not step.wakeable and 0 < step.seconds <= 1 / WAKE_RATE + 1e-9
            clock.now += step.seconds
            step = step_with(plan, None)
    # 10 s of a flood: the first attempt, the burst, then WAKE_RATE a second (1 ms per wake-up aside).
    assert attempts <= 1 + WAKE_BURST + 10.0 * WAKE_RATE + 1
    assert attempts >= 10.0 * WAKE_RATE  # and no fewer: a real release still wakes the waiter promptly


def test_a_wake_after_a_quiet_pause_is_never_delayed() -> None:
    """A waiter whose pauses end by their time (no notification) keeps its whole burst for a release."""
    clock = FakeClock()
    plan, first = start(clock, wait=60.0)
    step: Step | Granted = first
    for _ in range(20):
        step = step_with(plan, refused(expires_in=30.0))
        assert isinstance(step, Pause)
        clock.now += step.seconds  # the poll interval passed: not woken
        step = step_with(plan, None)
        assert isinstance(step, TryOnce)
    for _ in range(WAKE_BURST):  # then a burst of wake-ups: each attempts at once
        step = step_with(plan, refused(expires_in=30.0))
        clock.now += 0.001
        step = step_with(plan, None)
        assert isinstance(step, TryOnce)
