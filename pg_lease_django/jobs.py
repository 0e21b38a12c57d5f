"""Holding a lease for a job: ``hold()``, ``@leased``, ``current_lease()`` and the ``HeldLease`` they give.

A hold acquires the lease on a connection of its own, renews it from a heartbeat thread on that
connection, trusts itself only for a window measured on its own monotonic clock, and on exit
releases exactly its own ``(owner, epoch)``. See docs/jobs.md.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import re
import secrets
import signal
import socket
import string
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from contextlib import suppress
from contextvars import ContextVar, Token
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType, TracebackType
from typing import Any, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction
from django.db import DEFAULT_DB_ALIAS, router

from . import conf
from .exceptions import (
    InvalidInputError,
    LapsedError,
    LeaseLostError,
    LeaseTimeoutError,
    NotAcquirableError,
    NotOwnerError,
)
from .heartbeat import Heartbeat, LeaseConnection
from .managers import Grant
from .signals import lease_acquired, lease_lost, lease_released, lease_skipped
from .validation import MAX_TTL, MAX_WAIT, MIN_TTL, Seconds, check_name, check_ttl, to_timedelta

__all__ = ["HeldLease", "Holding", "current_lease", "exit_on_signals", "hold", "leased"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

OnLost = Callable[["HeldLease"], object]
OnBusy = Literal["skip", "raise"]

# The holds active in this thread / task, outermost first.
_active: ContextVar[tuple[HeldLease, ...]] = ContextVar("pg_lease_active_holds", default=())


def _default_owner() -> str:
    """``host:pid:random``: unique per hold, so two holds in one process never share an identity."""
    return f"{socket.gethostname()[:200]}:{os.getpid()}:{secrets.token_hex(4)}"


def _fresh(error: LeaseLostError) -> LeaseLostError:
    # A new instance per raise: re-raising one instance would chain every traceback onto it.
    return type(error)(str(error), key=error.key, owner=error.owner, epoch=error.epoch)


class HeldLease:
    """A lease held by ``hold()`` / ``@leased``; yielded by ``with hold(...) as lease``.

    It is also a fence: ``obj.save(fence=lease)`` (and FencedModel writes with no fence inside the
    hold use it on their own).

    Attributes:
        key: the lease key.
        owner: the owner identity it is held under (unique per hold unless you passed ``owner``).
        epoch: the fencing token of this grant; renewals keep it.
        expires_at: the server's expiry after the last successful acquire/renewal.
        ttl: the TTL every renewal asks for.
        using: the database alias the lease is held in.
    """

    def __init__(
        self,
        grant: Grant,
        *,
        ttl: timedelta,
        sent_at: float,
        trust_span: float,
        on_lost: OnLost | None,
        using: str = DEFAULT_DB_ALIAS,
    ):
        self.key: str = grant.key
        self.owner: str = grant.owner
        self.epoch: int = grant.epoch
        self.expires_at: datetime = grant.expires_at
        self.ttl = ttl
        self.using = using
        self._granted_sent_at = sent_at
        self._trust_span = trust_span
        self._trusted_until = sent_at + trust_span
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._lost_event = threading.Event()
        self._error: LeaseLostError | None = None
        self._definitive_loss = False
        self._ended_at: float | None = None
        self._cancel_hooks: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return (
            f"<HeldLease key={self.key!r} owner={self.owner!r} epoch={self.epoch} "
            f"expires_at={self.expires_at.isoformat()} lost={self.lost}>"
        )

    @property
    def lost(self) -> bool:
        """True once the lease is lost: a verdict from the server, or the trust window ran out.

        Computed on the spot from the monotonic clock, so it turns true at the end of the trust
        window even if the database cannot be reached and the heartbeat has not noticed yet. Never
        turns false again. Stays false after a normal exit.
        """
        return self._error is not None or self._trust_expired()

    @property
    def error(self) -> LeaseLostError | None:
        """Why the lease was lost (what `check` raises), or None."""
        if self._error is not None:
            return _fresh(self._error)
        return self._trust_ended_error() if self._trust_expired() else None

    @property
    def trust_remaining(self) -> float:
        """Seconds the holder still trusts itself (0 once lost or ended)."""
        if self._error is not None or self._ended_at is not None:
            return 0.0
        return max(0.0, self._trusted_until - time.monotonic())

    def check(self) -> None:
        """Raise unless the lease is still held and trusted. Call it between steps of the job.

        Costs no query: it reads what the heartbeat learned and the monotonic clock.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: the lease was lost (the server said so,
                or no renewal was confirmed within the trust window: LapsedError). Stop acting.
            NotOwnerError: the hold has ended (the lease was released).
        """
        error = self.error
        if error is not None:
            raise error
        if self._ended_at is not None:
            raise NotOwnerError(
                f"the hold of lease {self.key!r} has ended", key=self.key, owner=self.owner, epoch=self.epoch
            )

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` seconds pass; True if it was lost.

        A leader-election loop can simply wait here. Returns at once after the hold has ended.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.lost:
                return True
            if self._ended_at is not None:
                return False
            now = time.monotonic()
            pause = self._trusted_until - now
            if deadline is not None:
                if now >= deadline:
                    return False
                pause = min(pause, deadline - now)
            self._lost_event.wait(max(pause, 0.0))

    # ---- used by the heartbeat and the hold ------------------------------------------------------

    @property
    def _lost_flag(self) -> bool:
        return self._error is not None

    def _trust_expired(self) -> bool:
        now = time.monotonic() if self._ended_at is None else self._ended_at
        return now >= self._trusted_until

    def _trust_ended_error(self) -> LeaseLostError:
        return LapsedError(
            f"lease {self.key!r} (epoch {self.epoch}): no renewal was confirmed within the trust window "
            f"({self._trust_span:.3g}s after sending the last one that succeeded); it may have lapsed",
            key=self.key,
            owner=self.owner,
            epoch=self.epoch,
        )

    def _renewed(self, expires_at: datetime, sent_at: float) -> bool:
        """Record a successful renewal sent at ``sent_at``; False if it came too late to count."""
        with self._lock:
            if self._error is None and time.monotonic() < self._trusted_until:
                self.expires_at = expires_at
                self._trusted_until = max(self._trusted_until, sent_at + self._trust_span)
                return True
        # check() may already have reported the end of the trust window: loss is final.
        self._declare_lost(self._trust_ended_error(), definitive=False)
        return False

    def _declare_lost(self, error: LeaseLostError, *, definitive: bool) -> None:
        """Mark the lease lost (once) and tell everyone: log, on_lost, lease_lost, cancel async jobs."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            # A verdict from the server (not our own trust window): not ours to release any more.
            self._definitive_loss = definitive
            hooks = list(self._cancel_hooks)
        self._lost_event.set()
        logger.warning(
            "lease %r lost (owner %r, epoch %s, %s): %s", self.key, self.owner, self.epoch, error.code, error
        )
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                logger.exception("on_lost callback for lease %r failed", self.key)
        _send(lease_lost, self, error=_fresh(error))
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("cancelling the job of lease %r failed", self.key)

    def _add_cancel_hook(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if self._error is None:
                self._cancel_hooks.append(hook)
                return
        hook()

    def _remove_cancel_hook(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if hook in self._cancel_hooks:
                self._cancel_hooks.remove(hook)


def _send(signal_: Any, lease: HeldLease, **kwargs: Any) -> None:
    _send_robust(signal_, HeldLease, lease=lease, **kwargs)


def _send_robust(signal_: Any, sender: Any, **kwargs: Any) -> None:
    for receiver, result in signal_.send_robust(sender=sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of a lease signal failed", receiver, exc_info=result)


def _skipped(func: Callable[..., Any], holding: Holding, error: Exception) -> None:
    """``@leased(on_busy="skip")`` did not run ``func``: say so where a default Django project looks
    (WARNING reaches the console through Python's last-resort handler), and send `lease_skipped`."""
    logger.warning("skipped %s(): %s", func.__qualname__, error)
    _send_robust(lease_skipped, func, key=holding._key, error=error)


def current_lease(key: str | None = None) -> HeldLease | None:
    """The innermost active ``hold()``/``@leased`` lease in this thread or task, or None.

    Args:
        key: only a lease with this key (the innermost one, if holds of several keys are nested).
    """
    for lease in reversed(_active.get()):
        if key is None or lease.key == key:
            return lease
    return None


@dataclass(frozen=True)
class _Options:
    ttl: timedelta
    owner: str | None
    blocking: bool
    timeout: Seconds | None
    renew_every: timedelta | None
    hold_at_least: timedelta | None
    on_lost: OnLost | None
    using: str | None

    @classmethod
    def build(
        cls,
        ttl: Seconds,
        owner: str | None,
        blocking: bool,
        timeout: Seconds | None,
        renew_every: Seconds | None,
        hold_at_least: Seconds | None,
        on_lost: OnLost | None,
        using: str | None,
    ) -> _Options:
        ttl_delta = check_ttl(ttl)
        if owner is not None:
            check_name("owner", owner)
        if not isinstance(blocking, bool):
            raise InvalidInputError(f"blocking must be a bool, not {type(blocking).__name__}")
        if timeout is not None:
            if not blocking:
                raise InvalidInputError("timeout only applies with blocking=True")
            to_timedelta("timeout", timeout, minimum=timedelta(0), maximum=MAX_WAIT)
        every = None
        if renew_every is not None:
            every = to_timedelta("renew_every", renew_every, minimum=MIN_TTL, maximum=MAX_TTL)
        at_least = None
        if hold_at_least is not None:
            at_least = to_timedelta("hold_at_least", hold_at_least, minimum=timedelta(0), maximum=MAX_TTL)
        if on_lost is not None and not callable(on_lost):
            raise InvalidInputError(f"on_lost must be callable, not {type(on_lost).__name__}")
        if using is not None and not isinstance(using, str):
            raise InvalidInputError(f"using must be a database alias, not {type(using).__name__}")
        return cls(ttl_delta, owner, blocking, timeout, every, at_least, on_lost, using)


class _Session:
    """One acquisition: its connection, its heartbeat thread and its HeldLease."""

    def __init__(self, options: _Options, key: str) -> None:
        self.options = options
        self.key = check_name("key", key)
        self.lease: HeldLease | None = None
        self.heartbeat: Heartbeat | None = None

    def start(self) -> HeldLease:
        from .models import Lease

        options = self.options
        alias = options.using or router.db_for_write(Lease)
        owner = options.owner or _default_owner()
        ttl = options.ttl.total_seconds()
        trust_span = ttl * (1 - conf.safety_margin())
        interval = options.renew_every.total_seconds() if options.renew_every is not None else ttl / 3
        if interval >= trust_span:
            raise InvalidInputError(
                f"renew_every ({interval}s) must be shorter than the trust window ({trust_span:.3g}s: the ttl minus "
                "PG_LEASE_SAFETY_MARGIN), or the holder would stop trusting itself before its first renewal",
                key=self.key,
                owner=owner,
            )
        connection = LeaseConnection(alias, owner=owner, io_timeout=interval)
        grant: Grant | None = None
        heartbeat: Heartbeat | None = None
        try:
            grant = connection.acquire(self.key, owner, options.ttl, blocking=options.blocking, timeout=options.timeout)
            lease = HeldLease(
                grant,
                ttl=options.ttl,
                sent_at=connection.sent_at,
                trust_span=trust_span,
                on_lost=options.on_lost,
                using=alias,
            )
            heartbeat = Heartbeat(lease, connection, ttl=options.ttl, interval=interval)
            heartbeat.start()
            logger.debug("acquired lease %r as %r at epoch %s", lease.key, lease.owner, lease.epoch)
            # Inside the try: an interrupt here must stop the heartbeat, not leave it renewing.
            _send(lease_acquired, lease)
        except BaseException:
            # Busy, timed out, or interrupted (a signal, a cancellation) before the hold was set up.
            if heartbeat is not None and heartbeat.is_alive():
                heartbeat.stop()
                heartbeat.join()
            else:
                if grant is not None:
                    try:
                        connection.release(grant.key, grant.owner, grant.epoch, timeout=max(interval, 1.0))
                    except Exception:
                        logger.warning("releasing lease %r after a failed start failed", self.key, exc_info=True)
                connection.close()
            raise
        self.lease, self.heartbeat = lease, heartbeat
        return lease

    def finish(self) -> None:
        """Stop renewing; release (or keep until ``hold_at_least``); close the connection."""
        lease, heartbeat = self.lease, self.heartbeat
        if lease is None or heartbeat is None:
            return
        lease._ended_at = time.monotonic()
        if lease._trust_expired() and lease._error is None:
            lease._declare_lost(lease._trust_ended_error(), definitive=False)
        keep_until = None
        if self.options.hold_at_least is not None:
            keep_until = lease._granted_sent_at + self.options.hold_at_least.total_seconds()
        heartbeat.stop(keep_until=keep_until)
        heartbeat.join()
        if lease._error is None:
            logger.debug("ended the hold of lease %r (%s)", lease.key, heartbeat.outcome)
            _send(lease_released, lease, freed=heartbeat.outcome == "freed")


def _abandoned_start(session: _Session, starting: asyncio.Future[HeldLease]) -> None:
    # The awaiting task was cancelled while the lease was being acquired in a worker thread.
    if starting.cancelled() or starting.exception() is not None:
        return
    threading.Thread(target=session.finish, name="pg_lease abandoned hold", daemon=True).start()


class Holding:
    """What ``hold()`` returns: a context manager (``with``/``async with``) and a decorator.

    One instance can be entered once at a time; used as a decorator it makes a fresh hold per call.
    """

    def __init__(self, key: str, options: _Options) -> None:
        self._key = key
        self._options = options
        self._session: _Session | None = None
        self._token: Token[tuple[HeldLease, ...]] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled_by_us = False
        self._hook: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<Holding key={self._key!r} ttl={self._options.ttl}>"

    def _new_session(self) -> _Session:
        if self._session is not None:
            raise RuntimeError("this hold() is already active: create one hold() per use")
        self._session = _Session(self._options, self._key)
        return self._session

    def _push(self, session: _Session, lease: HeldLease) -> None:
        self._session = session
        self._token = _active.set((*_active.get(), lease))

    def _pop(self) -> _Session:
        session, self._session = self._session, None
        if session is None:
            raise RuntimeError("this hold() is not active")
        if self._token is not None:
            _active.reset(self._token)
            self._token = None
        return session

    def __enter__(self) -> HeldLease:
        session = self._new_session()
        try:
            lease = session.start()
        except BaseException:
            self._session = None
            raise
        self._push(session, lease)
        return lease

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pop().finish()

    async def __aenter__(self) -> HeldLease:
        session = self._new_session()
        loop = asyncio.get_running_loop()
        # Database calls block: acquire in a worker thread (the lease's connection is its own).
        starting = asyncio.ensure_future(asyncio.to_thread(session.start))
        try:
            lease = await asyncio.shield(starting)
        except asyncio.CancelledError:
            self._session = None
            starting.add_done_callback(functools.partial(_abandoned_start, session))
            raise
        except BaseException:
            self._session = None
            raise
        task = asyncio.current_task()
        self._push(session, lease)
        if task is not None:
            self._task, self._cancelling, self._cancelled_by_us = task, task.cancelling(), False

            def on_loss() -> None:  # heartbeat thread
                with suppress(RuntimeError):  # the loop is closed: nothing left to cancel
                    loop.call_soon_threadsafe(self._cancel_task)

            self._hook = on_loss
            lease._add_cancel_hook(on_loss)
        return lease

    def _cancel_task(self) -> None:  # event loop thread
        task = self._task
        if task is not None and not task.done() and not self._cancelled_by_us:
            self._cancelled_by_us = True
            task.cancel(f"lease {self._key!r} was lost")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        task, self._task = self._task, None  # from here on, a loss no longer cancels the task
        session = self._pop()
        if self._hook is not None and session.lease is not None:
            session.lease._remove_cancel_hook(self._hook)
            self._hook = None
        await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(session.finish)))
        if task is not None and self._cancelled_by_us:
            self._cancelled_by_us = False
            # As asyncio.timeout() does: our own cancellation becomes the precise error.
            if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError and session.lease:
                error = session.lease.error
                if error is not None:
                    raise error from exc

    @overload
    def __call__(self, func: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R]: ...

    def __call__(self, func: Callable[P, Any]) -> Callable[P, Any]:
        """Decorate ``func``: each call runs inside a fresh hold of this key (busy: NotAcquirableError)."""
        key, options = self._key, self._options
        return _wrap(func, lambda args, kwargs: Holding(key, options), "raise")


def hold(
    key: str,
    ttl: Seconds,
    *,
    owner: str | None = None,
    blocking: bool = False,
    timeout: Seconds | None = None,
    renew_every: Seconds | None = None,
    hold_at_least: Seconds | None = None,
    on_lost: OnLost | None = None,
    using: str | None = None,
) -> Holding:
    """Hold the lease ``key`` for the duration of a block or a call, renewing it in the background.

    ``with hold("nightly-billing", ttl=30) as lease: ...`` (also ``async with``, and as a decorator).
    Entering acquires the lease on a connection of its own (never the job's: it does not join your
    transaction), then a heartbeat thread renews it on that connection. Leaving releases exactly
    this ``(owner, epoch)``; it never frees a lease someone else holds now. The current lease is
    also what FencedModel writes without a fence use, and what `current_lease` returns.

    Args:
        key: the lease key.
        ttl: seconds or timedelta each grant and renewal lasts on the server clock.
        owner: the owner identity; default ``host:pid:random``, unique per hold.
        blocking: wait for the lease instead of raising NotAcquirableError.
        timeout: with ``blocking=True``, the longest wait (then LeaseTimeoutError).
        renew_every: seconds between renewals; default ``ttl / 3``. Must be shorter than the trust
            window, ``ttl * (1 - PG_LEASE_SAFETY_MARGIN)``.
        hold_at_least: on exit, keep the lease until this long after the grant instead of releasing
            it (a job that finishes fast still blocks others for that long); scoped to this epoch.
        on_lost: called once with the HeldLease when the lease is lost, from the heartbeat thread.
        using: the database alias; default the router's write database for Lease.

    Returns:
        A `Holding`; entering it gives the `HeldLease`.

    Raises:
        InvalidInputError: a bad argument (now, or on entering for checks that read settings).
        NotAcquirableError: on entering, the key is held by another owner (non-blocking).
        LeaseTimeoutError: on entering, ``blocking=True`` and ``timeout`` passed.
    """
    options = _Options.build(ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using)
    return Holding(check_name("key", key), options)


class SkippingDecorator(Protocol):
    """What ``leased(..., on_busy="skip")`` returns: the wrapped call returns None when busy."""

    @overload
    def __call__(self, func: Callable[P, Coroutine[Any, Any, R]], /) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, func: Callable[P, R], /) -> Callable[P, R | None]: ...


class RaisingDecorator(Protocol):
    """What ``leased(..., on_busy="raise")`` returns: the wrapped call raises when busy."""

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
    on_busy: Literal["raise"],
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
    """Run each call of the decorated function (sync or async) while holding a lease.

    ``@leased("invoice:{invoice_id}", ttl=60)``: the key is a template filled from the call's
    arguments by name (defaults included; ``{obj.pk}`` works), or a callable taking the same
    arguments and returning the key. Signatures and typing are preserved. Async functions are
    cancelled when the lease is lost; the call then raises the LeaseLostError subclass. Put
    Django's ``@task`` outermost: ``@task`` over ``@leased(...)``.

    Args:
        key: a ``str.format`` template naming the function's parameters, or a callable.
        ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using: as for `hold`.
        on_busy: ``"skip"`` (default): when the lease cannot be had (held elsewhere, or the
            blocking wait timed out), the call does not run and returns None. ``"raise"``: it
            raises NotAcquirableError / LeaseTimeoutError.

    Raises:
        InvalidInputError: a bad argument, or a template field that names no parameter.
    """
    options = _Options.build(ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using)
    if on_busy not in ("skip", "raise"):
        raise InvalidInputError(f"on_busy must be 'skip' or 'raise', not {on_busy!r}")
    if not isinstance(key, str) and not callable(key):
        raise InvalidInputError(f"key must be a str template or a callable, not {type(key).__name__}")

    def decorate(func: Callable[P, Any]) -> Callable[P, Any]:
        key_for = _key_function(key, func)
        return _wrap(func, lambda args, kwargs: Holding(key_for(args, kwargs), options), on_busy)

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


_BUSY = (NotAcquirableError, LeaseTimeoutError)


def _wrap(func: Callable[P, Any], holding_for: Callable[[Any, Any], Holding], on_busy: OnBusy) -> Callable[P, Any]:
    if iscoroutinefunction(func):

        @functools.wraps(func)
        async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            holding = holding_for(args, kwargs)
            try:
                await holding.__aenter__()
            except _BUSY as exc:
                if on_busy == "raise":
                    raise
                _skipped(func, holding, exc)
                return None
            try:
                result = await func(*args, **kwargs)
            except BaseException as exc:
                await holding.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            await holding.__aexit__(None, None, None)
            return result

        return run_async

    @functools.wraps(func)
    def run(*args: P.args, **kwargs: P.kwargs) -> Any:
        holding = holding_for(args, kwargs)
        try:
            holding.__enter__()
        except _BUSY as exc:
            if on_busy == "raise":
                raise
            _skipped(func, holding, exc)
            return None
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            holding.__exit__(type(exc), exc, exc.__traceback__)
            raise
        holding.__exit__(None, None, None)
        return result

    return run


def exit_on_signals(signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Make ``signals`` (default SIGTERM) end the process cleanly: ``SystemExit(128 + signum)``.

    Python already turns SIGINT into KeyboardInterrupt; SIGTERM kills the process at once, so
    ``with hold()`` blocks never run their exit and the lease is left to lapse. After this call a
    SIGTERM raises SystemExit in the main thread, which unwinds every ``with hold()`` (releasing
    its lease) and exits with status 143. Call it once, from the main thread, at worker start-up.

    Raises:
        ValueError: not called from the main thread (Python's rule for signal handlers).
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for signum in signals:
        signal.signal(signum, handler)
