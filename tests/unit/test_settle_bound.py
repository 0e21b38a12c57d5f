"""The async settling bound (`SETTLE_BOUND`): a task cancelled again while it settles an interrupted
call waits for the settling at most that long, then gives it up (cancelled, logged at ERROR).

Without the bound a settling that never ends (a server that stopped answering) would hold the
cancelled task forever. Timing is the event loop's own clock, made virtual (`VirtualClockLoop`):
when nothing is ready the loop jumps to its next timer instead of waiting, so 15 s of loop time
pass at once and the assertions are on loop time, never on the wall clock. A loop with nothing
left to wait for but the settling, or that runs past `HORIZON` s of loop time, fails the test:
that is what removing the bound looks like.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
from typing import Any

import pytest

from pg_lease_django.wait.settling import SETTLE_BOUND, settled_anyway

#: Loop time past which the test calls the settling unbounded (far past any bound it could have).
HORIZON = 3600.0


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; where the loop would block for ``timeout``, moves its clock by it."""

    def __init__(self, loop_clock: list[float]) -> None:
        super().__init__()
        self.clock = loop_clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise AssertionError("the loop would wait forever: nothing bounds what it awaits")
        self.clock[0] += timeout
        if self.clock[0] > HORIZON:
            raise AssertionError(f"still waiting after {HORIZON:.0f} s of loop time")
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: it jumps to the next timer when nothing is ready."""

    def __init__(self) -> None:
        self.clock = [0.0]
        super().__init__(_JumpingSelector(self.clock))

    def time(self) -> float:
        return self.clock[0]


def run_on_virtual_clock(main: Any) -> Any:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_settling_that_never_ends_is_given_up_at_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    """Cancelled again one second in, the task still waits for the settling, until `SETTLE_BOUND`
    s of loop time: then the settling is cancelled, an ERROR says so, and the task goes on."""
    given_up_at: list[float] = []

    async def never_ending_settling() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            given_up_at.append(asyncio.get_running_loop().time())
            raise

    async def cancelled_task() -> float:
        await settled_anyway(never_ending_settling(), "a settling that never ends")
        return asyncio.get_running_loop().time()

    async def main() -> float:
        task = asyncio.ensure_future(cancelled_task())
        await asyncio.sleep(1.0)
        task.cancel()  # the second cancellation: the settling goes on
        return await task

    with caplog.at_level(logging.ERROR, logger="pg_lease_django.wait.settling"):
        went_on_at = run_on_virtual_clock(main)
    assert given_up_at == [pytest.approx(SETTLE_BOUND)]
    assert went_on_at == pytest.approx(SETTLE_BOUND)
    assert [r.getMessage() for r in caplog.records] == [
        f"settling a settling that never ends took over {SETTLE_BOUND} s: left to lapse at its TTL"
    ]


def test_a_settling_within_the_bound_is_waited_for_to_its_end(caplog: pytest.LogCaptureFixture) -> None:
    """A settling that takes less than the bound (here 80 % of it) ends on its own although the task
    was cancelled again: nothing is cancelled, nothing logged at ERROR."""
    ended_at: list[float] = []

    async def slow_settling() -> None:
        await asyncio.sleep(0.8 * SETTLE_BOUND)
        ended_at.append(asyncio.get_running_loop().time())

    async def main() -> None:
        task = asyncio.ensure_future(settled_anyway(slow_settling(), "a slow settling"))
        await asyncio.sleep(1.0)
        task.cancel()
        await task

    with caplog.at_level(logging.ERROR, logger="pg_lease_django.wait.settling"):
        run_on_virtual_clock(main)
    assert ended_at == [pytest.approx(0.8 * SETTLE_BOUND)]
    assert caplog.records == []
