"""``hold()``: acquire on a lease connection, renew from the process's scheduler, release on exit.

The lease connection is never the job's. `Holding` is what ``hold()`` returns: a context manager,
sync and async, and a decorator. It runs one `HoldSession` per block, which does the acquire and
the release; see `pg_lease_django.holds.session`. It keeps its lease in this thread's or task's
active holds, and copes with interrupts and cancellations around it. ``@leased`` builds on the
same pieces in `pg_lease_django.holds.jobs`. Public names are re-exported by `pg_lease_django`;
import them from there. See docs/jobs.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from contextlib import suppress
from contextvars import Token
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar, overload

from asgiref.sync import iscoroutinefunction

from pg_lease_django import sigterm
from pg_lease_django.exceptions import LeaseTimeoutError, NotAcquirableError
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.plans import Plan, adrive, drive
from pg_lease_django.signals import lease_skipped
from pg_lease_django.validation import Seconds, check_name

from .context import active
from .lease import HeldLease, OnLost, send_robust
from .lease_calls import in_thread
from .lease_connection import InFlight
from .session import HoldOptions, HoldSession

# The documented logger of holds (docs/jobs.md), wherever their code lives.
logger = logging.getLogger("pg_lease_django.jobs")

P = ParamSpec("P")
R = TypeVar("R")

OnBusy = Literal["skip", "raise", "exit"]


def _skipped(func: Callable[..., Any], holding: Holding, error: Exception, on_busy: OnBusy) -> None:
    """``@leased(on_busy="skip")`` or ``"exit"`` did not run ``func``: say so, and send `lease_skipped`.

    It logs where a default Django project looks: a WARNING reaches the console through Python's
    last-resort handler. With ``"exit"``, it then ends the process with ``leases run``'s status for the
    same outcome, so that cron or systemd can tell a skipped run from one that ran. That status is
    `ExitCode.BUSY`, or ``TIMED_OUT`` for a blocking wait that ran out.
    """
    status = ExitCode.TIMED_OUT if isinstance(error, LeaseTimeoutError) else ExitCode.BUSY
    if on_busy == "exit":
        logger.warning("skipped %s(): %s; exiting with status %d", func.__qualname__, error, status)
    else:
        logger.warning("skipped %s(): %s", func.__qualname__, error)
    send_robust(lease_skipped, func, key=holding._key, error=error)  # noqa: SLF001 (Holding is of this module)
    if on_busy == "exit":
        raise SystemExit(int(status)) from None


def report_next_acquire_to(holding: Holding, call: InFlight) -> None:
    """Let another thread interrupt the next acquire of ``holding`` through ``call`` (`pg_lease_django.election`)."""
    holding._report_next_acquire_to(call)  # noqa: SLF001 (Holding is of this module; not a public method of it)


#: Seconds between the cancel request of an acquire abandoned by a cancelled task and shutting its socket.
_INTERRUPT_GRACE = 1.0


def _in_own_thread(fn: Callable[[], R], name: str) -> asyncio.Future[R]:
    """``fn()`` on a thread of its own, in a copy of this context; its outcome as a future of this loop.

    Never in asyncio's default executor: it is shared by the whole application and small
    (``cpus + 4`` threads), and a blocking hold would occupy one of its threads for as long as it
    waits, leaving none for other ``to_thread`` calls, a holder's own exit included.
    """
    return in_thread(fn, lambda run: threading.Thread(target=run, name=name[:100], daemon=True).start())


def _forget(lease: HeldLease) -> None:
    """Take ``lease`` out of this context's active holds, pushed or not (an interrupted enter or exit)."""
    stack = active.get()
    if lease in stack:
        active.set(tuple(other for other in stack if other is not lease))


class _Start:
    """``session.start()`` for an ``async with``, which the awaiting task may abandon while it runs.

    `run` runs it on the hold's own thread. `abandon` says the awaiting task was cancelled. An
    abandoned start whose interrupt came too late, once the hold was set up, leaves the hold at once.
    Whichever of the two threads comes second does it, not the event loop, which may have closed by
    then because ``asyncio.run`` or ``async_to_sync`` ended with the cancelled task. So the grant is
    never left to lapse at its TTL with nobody to release it.
    """

    def __init__(self, session: HoldSession) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._abandoned = False
        self._started = False

    def run(self) -> HeldLease:  # the hold's own thread
        lease = self._session.start()
        with self._lock:
            self._started, abandoned = True, self._abandoned
        if abandoned:
            self._session.finish()
        return lease

    def abandon(self) -> None:  # the event loop's thread
        with self._lock:
            self._abandoned, started = True, self._started
        if started:
            threading.Thread(target=self._session.finish, name="pg_lease abandoned hold", daemon=True).start()


class Holding:
    """What ``hold()`` returns: a context manager (``with``/``async with``) and a decorator.

    One instance can be entered once at a time; used as a decorator it makes a fresh hold per call.
    """

    def __init__(self, key: str, options: HoldOptions) -> None:
        self._key = key
        self._options = options
        self._session: HoldSession | None = None
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

    def _new_session(self) -> HoldSession:
        if self._session is not None:
            raise RuntimeError("this hold() is already active: create one hold() per use")
        self._session = HoldSession(self._options, self._key, self._acquiring)
        self._acquiring = None
        return self._session

    def _push(self, session: HoldSession, lease: HeldLease) -> None:
        self._session = session
        self._token = active.set((*active.get(), lease))

    def _pop(self) -> HoldSession:
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
        start = _Start(session)
        starting = _in_own_thread(start.run, f"pg_lease hold {self._key}")
        try:
            lease = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled (asyncio.timeout too): stop the acquire now, on the server; an attempt in
            # flight is settled (a grant it committed is released) in the acquiring thread.
            self._session = None
            interrupt = functools.partial(session.acquiring.interrupt, grace=_INTERRUPT_GRACE)
            threading.Thread(target=interrupt, name="pg_lease hold cancelled", daemon=True).start()
            start.abandon()
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

    Write ``with hold("nightly-billing", ttl=30) as lease: ...``; ``async with`` and a decorator work
    too. Entering acquires the lease on a lease connection. That connection is never the job's, so it
    does not join your transaction; the holds of a process share a small pool of them. Then the
    process's heartbeat scheduler renews the lease, each renewal on a connection of its own. Leaving
    releases exactly this ``(owner, epoch)``; it never frees a lease someone else holds now. The
    current lease is also what FencedModel writes without a fence use, and what `current_lease`
    returns.

    Args:
        key: the lease key.
        ttl: seconds or timedelta each grant and renewal lasts on the server clock.
        owner: the owner identity; default ``host:pid:random``, unique per hold.
        blocking: wait for the lease instead of raising NotAcquirableError.
        timeout: with ``blocking=True``, the longest wait, after which LeaseTimeoutError is raised.
        renew_every: seconds between renewals; default ``ttl / 3``. Must be shorter than the trust
            window, ``ttl * (1 - PG_LEASE_SAFETY_MARGIN)``.
        hold_at_least: on exit, keep the lease until this long after the grant instead of releasing
            it, scoped to this epoch. A job that finishes fast still blocks others for that long.
        on_lost: called once with the HeldLease when the lease is lost. It is called from a heartbeat
            worker thread, or from the thread that leaves the hold if that is where the loss is found.
        using: the database alias; default the router's write database for Lease.
        on_handoff: called once with the HeldLease, from a thread of its own, when a renewal learns
            that someone asked this holder to step down with ``Lease.objects.request_handoff``.
            ``lease.handoff_requested`` and ``lease.wait_stop()`` tell the job without a callback.

    Returns:
        A `Holding`; entering it gives the `HeldLease`.

    Raises:
        InvalidInputError: a bad argument, now or, for checks that read settings, on entering.
        NotAcquirableError: on entering, the key is held by another owner, when not blocking.
        LeaseTimeoutError: on entering, ``blocking=True`` and ``timeout`` passed.
    """
    options = HoldOptions.build(ttl, owner, blocking, timeout, renew_every, hold_at_least, on_lost, using, on_handoff)
    return Holding(check_name("key", key), options)


_BUSY = (NotAcquirableError, LeaseTimeoutError)


def wrap(func: Callable[P, Any], holding_for: Callable[[Any, Any], Holding], on_busy: OnBusy) -> Callable[P, Any]:
    """``func``, sync or async, with each call run inside the `Holding` that ``holding_for(args, kwargs)`` makes.

    When the lease cannot be had, the call raises with ``on_busy="raise"``. With ``"skip"`` it is
    skipped and returns None; with ``"exit"`` it raises ``SystemExit``. What a call does is
    `_held_call`, written once; each wrapper only performs its steps.
    """
    if iscoroutinefunction(func):

        @functools.wraps(func)
        async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            holding = holding_for(args, kwargs)

            async def do(step: _Step) -> Any:
                if step is _ENTER:
                    return await holding.__aenter__()
                if step is _CALL:
                    return await func(*args, **kwargs)
                return await holding.__aexit__(*step)  # type: ignore[misc]  # an exit step: __exit__'s arguments

            return await adrive(_held_call(func, holding, on_busy), do)

        return run_async

    @functools.wraps(func)
    def run(*args: P.args, **kwargs: P.kwargs) -> Any:
        holding = holding_for(args, kwargs)

        def do(step: _Step) -> Any:
            if step is _ENTER:
                return holding.__enter__()
            if step is _CALL:
                return func(*args, **kwargs)
            return holding.__exit__(*step)  # type: ignore[misc]  # an exit step: __exit__'s arguments

        return drive(_held_call(func, holding, on_busy), do)

    return run


#: The steps of `_held_call`: enter the hold, call the function, or exit the hold with these
#: ``__exit__`` arguments.
_ENTER, _CALL = object(), object()
_Step = object


def _held_call(func: Callable[..., Any], holding: Holding, on_busy: OnBusy) -> Plan[_Step, Any]:
    """One call of a ``@leased`` function: enter, call, exit with the call's exception (if any)."""
    try:
        yield _ENTER
    except _BUSY as exc:
        if on_busy == "raise":
            raise
        _skipped(func, holding, exc, on_busy)
        return None
    try:
        result = yield _CALL
    except BaseException as exc:
        yield (type(exc), exc, exc.__traceback__)
        raise
    yield (None, None, None)
    return result
