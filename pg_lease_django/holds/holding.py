"""``hold()``: acquire on a lease connection (never the job's), renew from the process's scheduler, release on exit.

`Holding` is what ``hold()`` returns (a context manager and a decorator); ``@leased`` builds on
the same pieces (`pg_lease_django.holds.jobs`). Public names are re-exported by `pg_lease_django`;
import them from there. See docs/jobs.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from contextlib import suppress
from contextvars import Token
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.db import router

from pg_lease_django import conf, metrics, sigterm
from pg_lease_django.exceptions import InvalidInputError, LeaseTimeoutError, NotAcquirableError
from pg_lease_django.operations import Grant
from pg_lease_django.owners import default_owner
from pg_lease_django.signals import lease_acquired, lease_released, lease_skipped
from pg_lease_django.validation import MAX_TTL, MIN_TTL, Seconds, check_name, check_ttl, check_wait, to_timedelta

from .context import active, current_lease
from .heartbeat import Heartbeat
from .lease import HeldLease, OnLost, Tenure, send_lease_signal, send_robust
from .lease_pool import InFlight, pool_for

# The documented logger of holds (docs/jobs.md), wherever their code lives.
logger = logging.getLogger("pg_lease_django.jobs")

P = ParamSpec("P")
R = TypeVar("R")

OnBusy = Literal["skip", "raise"]


def _skipped(func: Callable[..., Any], holding: Holding, error: Exception) -> None:
    """``@leased(on_busy="skip")`` did not run ``func``: say so where a default Django project looks
    (WARNING reaches the console through Python's last-resort handler), and send `lease_skipped`."""
    logger.warning("skipped %s(): %s", func.__qualname__, error)
    send_robust(lease_skipped, func, key=holding._key, error=error)  # noqa: SLF001 (Holding is of this module)


def report_next_acquire_to(holding: Holding, call: InFlight) -> None:
    """Let another thread interrupt the next acquire of ``holding`` through ``call`` (`pg_lease_django.election`)."""
    holding._report_next_acquire_to(call)  # noqa: SLF001 (Holding is of this module; not a public method of it)


@dataclass(frozen=True)
class HoldOptions:
    """The arguments of ``hold()`` / ``@leased`` but the key, checked once when the hold is made."""

    ttl: timedelta
    owner: str | None
    blocking: bool
    wait: timedelta | None  # the longest blocking wait; None: no bound
    renew_every: timedelta | None
    hold_at_least: timedelta | None
    on_lost: OnLost | None
    using: str | None
    on_handoff: OnLost | None = None

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
        on_handoff: OnLost | None = None,
    ) -> HoldOptions:
        ttl_delta = check_ttl(ttl)
        if owner is not None:
            check_name("owner", owner)
        wait = check_wait(blocking, timeout)
        every = None
        if renew_every is not None:
            every = to_timedelta("renew_every", renew_every, minimum=MIN_TTL, maximum=MAX_TTL)
        at_least = None
        if hold_at_least is not None:
            at_least = to_timedelta("hold_at_least", hold_at_least, minimum=timedelta(0), maximum=MAX_TTL)
        for name, callback in (("on_lost", on_lost), ("on_handoff", on_handoff)):
            if callback is not None and not callable(callback):
                raise InvalidInputError(f"{name} must be callable, not {type(callback).__name__}")
        if using is not None and not isinstance(using, str):
            raise InvalidInputError(f"using must be a database alias, not {type(using).__name__}")
        return cls(ttl_delta, owner, blocking, wait, every, at_least, on_lost, using, on_handoff)


class _Session:
    """One acquisition: its heartbeat (renewals by the process's scheduler) and its HeldLease."""

    def __init__(self, options: HoldOptions, key: str, acquiring: InFlight | None = None) -> None:
        self.options = options
        self.key = check_name("key", key)
        self.lease: HeldLease | None = None
        self.heartbeat: Heartbeat | None = None
        #: The acquire, which another thread may interrupt (a cancelled task, ``Election.stop``).
        self.acquiring = acquiring or InFlight()
        self.told = False  # lease_released sent (or the hold ended lost): finish() has nothing left to do

    def start(self) -> HeldLease:
        from pg_lease_django.models import Lease

        options = self.options
        alias = options.using or router.db_for_write(Lease)
        owner = options.owner or default_owner()
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
        if options.owner is None:
            check_name("owner", owner)  # the generated identity (a given one was checked with the options)
        enclosing = current_lease(self.key)
        if enclosing is not None and enclosing.using == alias and not enclosing.lost:
            # Not reentrant: the acquire would be refused by our own hold (or wait on it, blocking).
            raise NotAcquirableError(
                f"lease {self.key!r} is already held by an enclosing hold() in this thread or task (owner "
                f"{enclosing.owner!r}, epoch {enclosing.epoch}): a hold is not reentrant; use that hold, "
                f"e.g. current_lease({self.key!r})",
                key=self.key,
                owner=owner,
                holder=enclosing.owner,
                holder_epoch=enclosing.epoch,
            )
        pool = pool_for(alias, io_timeout=interval)
        grant: Grant | None = None
        heartbeat: Heartbeat | None = None
        try:
            with metrics.acquiring(self.key, options.blocking) as measured:
                grant, sent_at = pool.acquire(
                    self.key, owner, options.ttl, blocking=options.blocking, wait=options.wait, call=self.acquiring
                )
                measured.granted(grant.epoch)
            tenure = Tenure(
                grant,
                ttl=options.ttl,
                sent_at=sent_at,
                trust_span=trust_span,
                on_lost=options.on_lost,
                on_handoff=options.on_handoff,
                using=alias,
            )
            lease = tenure.lease
            heartbeat = Heartbeat(tenure, pool, ttl=options.ttl, interval=interval)
            heartbeat.start()
            self.lease, self.heartbeat = lease, heartbeat  # from here finish() stops it, whatever interrupts
            logger.debug("acquired lease %r as %r at epoch %s", lease.key, lease.owner, lease.epoch)
            # Inside the try: an interrupt here must stop the heartbeat, not leave it renewing.
            send_lease_signal(lease_acquired, lease)
            return lease  # also inside: an interrupt at any instruction before it is handled below
        except BaseException as exc:
            # Busy, timed out, or interrupted (a signal, a cancellation) before the hold was set up.
            self.lease = self.heartbeat = None
            if heartbeat is not None:
                heartbeat.finish()
            elif grant is not None:
                try:
                    pool.release(grant.key, grant.owner, grant.epoch, timeout=max(interval, 1.0))
                except Exception:
                    logger.warning("releasing lease %r after a failed start failed", self.key, exc_info=True)
            elif not isinstance(exc, Exception):
                # Interrupted (a signal) in or after the acquire, before its grant reached this frame
                # (an attempt cut short is settled by the acquire itself): settle here too.
                pool.settle(self.key, owner)
            raise

    def finish(self) -> None:
        """Stop renewing; release (or keep until ``hold_at_least``) on a pooled lease connection.

        Called again after an interrupt cut it short (`Holding.__exit__`), it completes what is left.
        """
        lease, heartbeat = self.lease, self.heartbeat
        if lease is None or heartbeat is None:
            return
        if self.told:
            heartbeat.finish()  # ended: only makes sure it is no longer registered with the scheduler
            return
        if heartbeat.pool.pid != os.getpid():
            # A hold entered before a fork, left in the child: the lease is the parent's, which
            # still renews and will release it. Nothing to release here, and nothing lost (the
            # child's copy of the trust window was never renewed: no on_lost, lease_lost or log).
            heartbeat.finish()
            return
        heartbeat.tenure.end()
        keep_until = None
        if self.options.hold_at_least is not None:
            keep_until = heartbeat.tenure.granted_at + self.options.hold_at_least.total_seconds()
        try:
            heartbeat.finish(keep_until=keep_until)
        finally:  # also when an interrupt goes on once the release is completed: the hold has ended
            if heartbeat.ended and not self.told:
                self.told = True
                if not lease.lost:
                    logger.debug("ended the hold of lease %r (%s)", lease.key, heartbeat.outcome)
                    send_lease_signal(lease_released, lease, freed=heartbeat.outcome == "freed")


#: Seconds between the cancel request of an acquire abandoned by a cancelled task and shutting its socket.
_INTERRUPT_GRACE = 1.0


def _in_own_thread(fn: Callable[[], R], name: str) -> asyncio.Future[R]:
    """``fn()`` on a thread of its own, in a copy of this context; its outcome as a future of this loop.

    Never in asyncio's default executor: it is shared by the whole application and small
    (``cpus + 4`` threads), and a blocking hold would occupy one of its threads for as long as it
    waits, leaving none for other ``to_thread`` calls, a holder's own exit included.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None]) -> None:  # the event loop's thread
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = context.run(fn)
        except BaseException as exc:
            outcome = functools.partial(future.set_exception, exc)
        else:
            outcome = functools.partial(future.set_result, result)
        with suppress(RuntimeError):  # the loop is closed: nobody awaits the outcome any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=name[:100], daemon=True).start()
    return future


def _forget(lease: HeldLease) -> None:
    """Take ``lease`` out of this context's active holds, pushed or not (an interrupted enter or exit)."""
    stack = active.get()
    if lease in stack:
        active.set(tuple(other for other in stack if other is not lease))


def _abandoned_start(session: _Session, starting: asyncio.Future[HeldLease]) -> None:
    # The awaiting task was cancelled while the lease was being acquired, and the interrupt came
    # too late: the hold was set up. Leave it (release) at once.
    if starting.cancelled() or starting.exception() is not None:
        return
    threading.Thread(target=session.finish, name="pg_lease abandoned hold", daemon=True).start()


class Holding:
    """What ``hold()`` returns: a context manager (``with``/``async with``) and a decorator.

    One instance can be entered once at a time; used as a decorator it makes a fresh hold per call.
    """

    def __init__(self, key: str, options: HoldOptions) -> None:
        self._key = key
        self._options = options
        self._session: _Session | None = None
        self._token: Token[tuple[HeldLease, ...]] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled_by_us = False
        self._hook: Callable[[], None] | None = None
        self._sigterm = False  # this sync hold counted in sigterm.enter()
        #: The next acquire's handle for an interrupt from another thread (`pg_lease_django.election`).
        self._acquiring: InFlight | None = None

    def __repr__(self) -> str:
        return f"<Holding key={self._key!r} ttl={self._options.ttl}>"

    def _report_next_acquire_to(self, call: InFlight) -> None:
        self._acquiring = call

    def _new_session(self) -> _Session:
        if self._session is not None:
            raise RuntimeError("this hold() is already active: create one hold() per use")
        self._session = _Session(self._options, self._key, self._acquiring)
        self._acquiring = None
        return self._session

    def _push(self, session: _Session, lease: HeldLease) -> None:
        self._session = session
        self._token = active.set((*active.get(), lease))

    def _pop(self) -> _Session:
        session, self._session = self._session, None
        if session is None:
            raise RuntimeError("this hold() is not active")
        if self._token is not None:
            active.reset(self._token)
            self._token = None
        return session

    def __enter__(self) -> HeldLease:
        session = self._new_session()
        counted = sigterm.enter()  # a SIGTERM from here on releases the lease (see sigterm.py)
        try:
            lease = session.start()
            self._sigterm = counted
            self._push(session, lease)
            return lease  # inside the try: an interrupt at any instruction before it is handled below
        except BaseException:
            # Also an interrupt (KeyboardInterrupt, a signal) landing after start() returned: the
            # hold is left, not a heartbeat renewing with nothing to stop it.
            self._session, self._token, self._sigterm = None, None, False
            if session.lease is not None:
                _forget(session.lease)
            try:
                session.finish()
            finally:
                sigterm.leave(counted)
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            session = self._session  # kept until the exit has ended: an interrupt may need it below
            if session is None:
                raise RuntimeError("this hold() is not active")
            if self._token is not None:
                active.reset(self._token)
                self._token = None
            session.finish()
        except BaseException:
            # An interrupt (a signal) landing before the hold was left: leave it now (a no-op if it
            # was), then go on. Only the first instruction of __exit__ is out of reach (CPython
            # checks for signals there, before any handler of ours: gh-74174).
            session = self._session
            if session is not None:
                if session.lease is not None:
                    _forget(session.lease)
                session.finish()
            raise
        finally:
            self._session = None
            counted, self._sigterm = self._sigterm, False
            sigterm.leave(counted)  # the outermost scope re-sends a SIGTERM that arrived meanwhile

    async def __aenter__(self) -> HeldLease:
        session = self._new_session()
        loop = asyncio.get_running_loop()
        # Database calls block: acquire in a thread of its own (on a lease connection, never the job's).
        starting = _in_own_thread(session.start, f"pg_lease hold {self._key}")
        try:
            lease = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled (asyncio.timeout too): stop the acquire now, on the server; an attempt in
            # flight is settled (a grant it committed is released) in the acquiring thread.
            self._session = None
            interrupt = functools.partial(session.acquiring.interrupt, grace=_INTERRUPT_GRACE)
            threading.Thread(target=interrupt, name="pg_lease hold cancelled", daemon=True).start()
            starting.add_done_callback(functools.partial(_abandoned_start, session))
            raise
        except BaseException:
            self._session = None
            raise
        task = asyncio.current_task()
        self._push(session, lease)
        if task is not None and session.heartbeat is not None:
            self._task, self._cancelling, self._cancelled_by_us = task, task.cancelling(), False

            def on_loss() -> None:  # a heartbeat worker thread
                with suppress(RuntimeError):  # the loop is closed: nothing left to cancel
                    loop.call_soon_threadsafe(self._cancel_task)

            self._hook = on_loss
            session.heartbeat.tenure.add_cancel_hook(on_loss)
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
        if self._hook is not None and session.heartbeat is not None:
            session.heartbeat.tenure.remove_cancel_hook(self._hook)
            self._hook = None
        await asyncio.shield(_in_own_thread(session.finish, f"pg_lease hold {self._key} exit"))
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
        return wrap(func, lambda args, kwargs: Holding(key, options), "raise")


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
    on_handoff: OnLost | None = None,
) -> Holding:
    """Hold the lease ``key`` for the duration of a block or a call, renewing it in the background.

    ``with hold("nightly-billing", ttl=30) as lease: ...`` (also ``async with``, and as a decorator).
    Entering acquires the lease on a lease connection (never the job's: it does not join your
    transaction; the holds of a process share a small pool of them), then the process's heartbeat
    scheduler renews it, each renewal on a connection of its own. Leaving releases exactly
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
        on_lost: called once with the HeldLease when the lease is lost, from a heartbeat worker thread
            (or from the thread that leaves the hold, if that is where the loss is found).
        using: the database alias; default the router's write database for Lease.
        on_handoff: called once with the HeldLease when a renewal learns that someone asked this
            holder to step down (``Lease.objects.request_handoff``), from a thread of its own.
            ``lease.handoff_requested`` and ``lease.wait_stop()`` tell the job without a callback.

    Returns:
        A `Holding`; entering it gives the `HeldLease`.

    Raises:
        InvalidInputError: a bad argument (now, or on entering for checks that read settings).
        NotAcquirableError: on entering, the key is held by another owner (non-blocking).
        LeaseTimeoutError: on entering, ``blocking=True`` and ``timeout`` passed.
    """
    options = HoldOptions.build(ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using, on_handoff)
    return Holding(check_name("key", key), options)


_BUSY = (NotAcquirableError, LeaseTimeoutError)


def wrap(func: Callable[P, Any], holding_for: Callable[[Any, Any], Holding], on_busy: OnBusy) -> Callable[P, Any]:
    """``func`` (sync or async), each call run inside the `Holding` that ``holding_for(args, kwargs)`` makes.

    When the lease cannot be had, the call raises (``on_busy="raise"``) or is skipped and returns None.
    """
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
