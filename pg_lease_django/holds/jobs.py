"""``@leased`` and ``exit_on_signals``: a job run inside a hold, and a process that unwinds its holds on SIGTERM.

A hold acquires the lease on a lease connection (never the job's; the holds of a process share a
small pool of them), is renewed by the process's heartbeat scheduler, trusts itself only for a
window measured on its own monotonic clock, and on exit releases exactly its own
``(owner, epoch)``. See docs/jobs.md. ``hold()`` is `pg_lease_django.holds.holding`, the
`HeldLease` `pg_lease_django.holds.lease`; import every public name from `pg_lease_django`.
"""

from __future__ import annotations

import inspect
import re
import signal
import string
from collections.abc import Callable, Coroutine, Iterable
from types import FrameType
from typing import Any, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from pg_lease_django.exceptions import InvalidInputError
from pg_lease_django.validation import Seconds, check_name

from .holding import Holding, OnBusy, wrap
from .lease import OnLost
from .session import HoldOptions

__all__ = ["exit_on_signals", "leased"]

P = ParamSpec("P")
R = TypeVar("R")


class SkippingDecorator(Protocol):
    """What ``leased(..., on_busy="skip")`` returns: the wrapped call returns None when busy."""

    @overload
    def __call__(self, func: Callable[P, Coroutine[Any, Any, R]], /) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, func: Callable[P, R], /) -> Callable[P, R | None]: ...


class RaisingDecorator(Protocol):
    """What ``leased(..., on_busy="raise")`` and ``on_busy="exit"`` return: the wrapped call raises when
    busy (the lease's error, or ``SystemExit``), so it returns only what the function returns."""

    @overload
    def __call__(self, func: Callable[P, Coroutine[Any, Any, R]], /) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, func: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def leased(
    key: str | Callable[..., str],
    ttl: Seconds,
    *,
    owner: str | None = ...,
    blocking: bool = ...,
    timeout: Seconds | None = ...,
    renew_every: Seconds | None = ...,
    hold_at_least: Seconds | None = ...,
    on_lost: OnLost | None = ...,
    using: str | None = ...,
    on_busy: Literal["skip"] = ...,
) -> SkippingDecorator: ...
@overload
def leased(
    key: str | Callable[..., str],
    ttl: Seconds,
    *,
    owner: str | None = ...,
    blocking: bool = ...,
    timeout: Seconds | None = ...,
    renew_every: Seconds | None = ...,
    hold_at_least: Seconds | None = ...,
    on_lost: OnLost | None = ...,
    using: str | None = ...,
    on_busy: Literal["raise", "exit"],
) -> RaisingDecorator: ...


def leased(
    key: str | Callable[..., str],
    ttl: Seconds,
    *,
    owner: str | None = None,
    blocking: bool = False,
    timeout: Seconds | None = None,
    renew_every: Seconds | None = None,
    hold_at_least: Seconds | None = None,
    on_lost: OnLost | None = None,
    using: str | None = None,
    on_busy: OnBusy = "skip",
) -> SkippingDecorator | RaisingDecorator:
    """Run each call of the decorated function, sync or async, while holding a lease.

    Write ``@leased("invoice:{invoice_id}", ttl=60)``. The key is a template filled from the call's
    arguments by name, defaults included, and ``{obj.pk}`` works. It may instead be a callable taking
    the same arguments and returning the key. Signatures and typing are preserved. Async functions are
    cancelled when the lease is lost; the call then raises the LeaseLostError subclass. Put Django's
    ``@task`` outermost: ``@task`` over ``@leased(...)``.

    Args:
        key: a ``str.format`` template naming the function's parameters, or a callable.
        ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using: as for `hold`.
        on_busy: what a call does when the lease cannot be had, because it is held elsewhere or the
            blocking wait timed out. ``"skip"``, the default: the call does not run and returns None.
            ``"raise"``: it raises NotAcquirableError or LeaseTimeoutError. ``"exit"``: it is skipped
            as with ``"skip"``, logged and with `lease_skipped` sent. It then raises ``SystemExit``
            with the status ``manage.py leases run`` exits with for the same outcome: 75 when busy,
            77 when the wait timed out. This is for a process's main function, such as a management
            command's ``handle()`` or a script's ``main()``, so that cron or systemd can tell a
            skipped run from one that ran.

    Raises:
        InvalidInputError: a bad argument, or a template field that names no parameter.
        SystemExit: ``on_busy="exit"`` and the lease could not be had, when the call is made.
    """
    options = HoldOptions.build(ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using)
    if on_busy not in ("skip", "raise", "exit"):
        raise InvalidInputError(f"on_busy must be 'skip', 'raise' or 'exit', not {on_busy!r}")
    if not isinstance(key, str) and not callable(key):
        raise InvalidInputError(f"key must be a str template or a callable, not {type(key).__name__}")

    def decorate(func: Callable[P, Any]) -> Callable[P, Any]:
        key_for = _key_function(key, func)
        return wrap(func, lambda args, kwargs: Holding(key_for(args, kwargs), options), on_busy)

    return cast(SkippingDecorator | RaisingDecorator, decorate)


def _key_function(key: str | Callable[..., str], func: Callable[..., Any]) -> Callable[[Any, Any], str]:
    if not isinstance(key, str):
        return lambda args, kwargs: key(*args, **kwargs)
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(key) if field is not None]
    except ValueError as exc:
        raise InvalidInputError(f"key template {key!r} is malformed: {exc}") from None
    if not fields:
        check_name("key", key)
        return lambda args, kwargs: key
    signature = inspect.signature(func)
    for field in fields:
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if name not in signature.parameters:
            raise InvalidInputError(
                f"key template {key!r} names {{{field}}}, but {func.__qualname__}() has no parameter {name!r} "
                "(fields name parameters; write {{ and }} for literal braces)"
            )

    def key_for(args: Any, kwargs: Any) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return key.format_map(bound.arguments)

    return key_for


def exit_on_signals(signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Make ``signals`` end the process cleanly with ``SystemExit(128 + signum)``; default SIGTERM.

    Python already turns SIGINT into KeyboardInterrupt. SIGTERM kills the process at once, so
    ``with hold()`` blocks never run their exit and the lease is left to lapse. After this call a
    SIGTERM raises SystemExit in the main thread. That unwinds every ``with hold()``, releasing its
    lease, and exits with status 143. Call it once, from the main thread, at worker start-up.

    Raises:
        ValueError: not called from the main thread, which is Python's rule for signal handlers.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for signum in signals:
        signal.signal(signum, handler)
