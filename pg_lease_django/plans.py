"""The one plan protocol: a plan is a generator that does no I/O, yields steps and is sent their answers.

Every algorithm with a sync and an async caller is written once as a `Plan`: the blocking wait in
`wait.plan`, the settling of an interrupted attempt in `wait.settling`, an election in
`election.plan` and a ``@leased`` call in `holds.holding`. `drive` runs a plan with a function
that performs a step, and `adrive` with a coroutine function. A step's error, an interrupt too, is
thrown into the plan at that step, so the plan decides whether it is passed by, handled or raised.
A plan takes its settings as arguments and raises only the package's errors or the ones thrown in.
The one step every plan shares is `Pause`. This is psycopg's ``PQGen``, one generator type run by
a blocking and an async waiter, one level up: the steps are statements, callbacks and pauses.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

S = TypeVar("S")
R = TypeVar("R")

#: A plan that yields steps of type ``S`` and returns ``R``; each step's answer is sent back.
Plan: TypeAlias = Generator[S, Any, R]


@dataclass(frozen=True)
class Pause:
    """Wait ``seconds``; answer: None.

    A waiter that listens for releases ends a ``wakeable`` pause early when one is notified, and a
    pause that is not wakeable runs its full time. A stop or a cancellation ends any pause, and the
    plan with it.
    """

    seconds: float
    wakeable: bool = True


def drive(plan: Plan[S, R], do: Callable[[S], Any]) -> R:
    """Run ``plan`` to its end, each step performed by ``do``; what it returns."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.send(answer) if error is None else plan.throw(error)
        except StopIteration as done:
            result: R = done.value
            return result
        try:
            answer, error = do(step), None
        except BaseException as exc:
            answer, error = None, exc


async def adrive(plan: Plan[S, R], do: Callable[[S], Awaitable[Any]]) -> R:
    """`drive` on the event loop: each step awaited."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.send(answer) if error is None else plan.throw(error)
        except StopIteration as done:
            result: R = done.value
            return result
        try:
            answer, error = await do(step), None
        except BaseException as exc:
            answer, error = None, exc
