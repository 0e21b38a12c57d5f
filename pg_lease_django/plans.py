"""Running a plan: a generator that does no I/O, yields steps and is sent each step's answer.

An algorithm with a sync and an async caller is written once as a plan (the settling of an
interrupted attempt, a ``@leased`` call; the blocking wait and the election have drivers of their
own, which also reconnect); `drive` runs one with a function that performs a step, `adrive` with a
coroutine function. An error of a step (an interrupt too) is thrown into the plan at that step: the
plan decides whether it is passed by, handled or raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

S = TypeVar("S")
R = TypeVar("R")


def drive(plan: Generator[S, Any, R], do: Callable[[S], Any]) -> R:
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


async def adrive(plan: Generator[S, Any, R], do: Callable[[S], Awaitable[Any]]) -> R:
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
