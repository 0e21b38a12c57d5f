"""Leader election on ``hold()``: campaign for a key, lead while the hold lasts, step down, campaign again.

``elect()`` runs the loop in a thread of its own and returns an `Election` handle; ``aelect()`` is
the same loop as a coroutine. See docs/leader-election.md.

- **Campaigning** is a non-blocking ``hold()`` attempt every ``PG_LEASE_POLL_INTERVAL`` (0.5 s),
  sleeping on an event in between: a refused attempt is one cheap statement (no write, no lock)
  that names the holder (``on_new_leader``), and ``stop()`` ends the sleep at once. Not
  ``hold(blocking=True)``: its wait cannot be interrupted from another thread, and a wait that
  times out closes its connection, so waiting in short slices would reconnect every slice.
- **Leading** is the callback running inside the hold. A term ends when the callback returns or
  raises, the lease is lost, a hand-off is requested, or the election is stopped; then the hold
  is left (released, unless lost) and ``on_stopped_leading()`` is called.
- **Resting** before the next campaign keeps a leader from taking its lease straight back: after
  a hand-off, until another leader is seen or one TTL has passed; after the callback raised, a
  back-off doubling from the poll interval up to one TTL; after the callback returned, one poll
  interval (the others try in the meantime). After a loss there is no rest: the lease is
  someone else's, or nobody's.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.db import connections

from . import conf, metrics, sigterm
from .exceptions import InvalidInputError, LeaseLostError, NotAcquirableError
from .holds.holding import Holding, hold, report_next_acquire_to
from .holds.lease import HeldLease
from .holds.lease_connection import InFlight
from .owners import default_owner
from .validation import Seconds, check_name, check_ttl

__all__ = ["Election", "aelect", "current_election", "elect"]

logger = logging.getLogger(__name__)

#: Seconds between the cancel request of a campaign attempt interrupted by `Election.stop` and
#: shutting its socket (the attempt is settled on the server either way: `settling.settle`).
_INTERRUPT_GRACE = 1.0

_current: ContextVar[Election | None] = ContextVar("pg_lease_current_election", default=None)


class _End(enum.Enum):
    """Why a term ended: it decides the rest before the next campaign."""

    RETURNED = "returned"
    FAILED = "failed"
    HANDOFF = "hand-off"
    LOST = "lost"
    STOPPED = "stopped"


def current_election() -> Election | None:
    """The `Election` whose ``on_started_leading`` runs in this thread, or None (also under ``aelect``).

    A sync leader callback uses it to watch ``stop()`` as well as its lease::

        def lead(lease):
            election = current_election()
            while not election.wait_stop(timeout=5):
                do_one_step(lease)
    """
    return _current.get()


class Election:
    """A campaign for ``key``: the handle ``elect()`` returns (also used as a context manager).

    Attributes:
        key: the lease key campaigned for.
        owner: this campaigner's identity, the same for every term (``host:pid:random`` by default).
    """

    def __init__(
        self,
        key: str,
        *,
        ttl: Seconds,
        on_started_leading: Callable[[HeldLease], Any],
        on_stopped_leading: Callable[[], Any],
        on_new_leader: Callable[[str], Any] | None = None,
        owner: str | None = None,
        using: str | None = None,
    ) -> None:
        self.key = check_name("key", key)
        self._ttl = check_ttl(ttl)
        self.owner = check_name("owner", owner if owner is not None else default_owner())
        for name, callback in (
            ("on_started_leading", on_started_leading),
            ("on_stopped_leading", on_stopped_leading),
            ("on_new_leader", on_new_leader),
        ):
            if callback is not None and not callable(callback):
                raise InvalidInputError(f"{name} must be callable, not {type(callback).__name__}")
        if using is not None and not isinstance(using, str):
            raise InvalidInputError(f"using must be a database alias, not {type(using).__name__}")
        self._on_started_leading = on_started_leading
        self._on_stopped_leading = on_stopped_leading
        self._on_new_leader = on_new_leader
        self._using = using
        self._stop = threading.Event()
        self._term_ends = threading.Event()  # set when the current term must end: lost, hand-off, stop
        self._lease: HeldLease | None = None
        self._leader: str | None = None
        self._failures = 0  # terms in a row whose callback raised: the back-off
        #: Set by a callback of this package (`pg_lease_django.supervisor`) to end its term as failed
        #: (back off) without raising: a COMMAND that exited with an error is no traceback.
        self._term_failed = False
        self._thread: threading.Thread | None = None
        self._sigterm = False  # `with` in the main thread counted in sigterm.enter()
        self._done = threading.Event()  # set when the election's thread ends (`join` waits on it)
        #: Called (from any thread) when a term must end; `pg_lease_django.supervisor` wakes its select with it.
        self._wakers: list[Callable[[], None]] = []
        self._acquiring: InFlight | None = None  # the campaign attempt of the election's thread, for stop()

    def __repr__(self) -> str:
        return f"<Election key={self.key!r} owner={self.owner!r} leading={self.leading} leader={self.leader!r}>"

    # ---- the handle ------------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """True while this campaigner leads: its ``on_started_leading`` runs under a lease not lost.

        False from the instant the lease is lost (the holder's trust window, a verdict), even before
        the callback returns: two campaigners never both say True at one instant of the holder's clock.
        """
        lease = self._lease
        return lease is not None and not lease.lost

    @property
    def leader(self) -> str | None:
        """The last leader identity observed (``owner`` when this campaigner won), or None."""
        return self._leader

    @property
    def lease(self) -> HeldLease | None:
        """The `HeldLease` of the current term, or None when not leading."""
        return self._lease

    @property
    def stopping(self) -> bool:
        """True once `stop` was called."""
        return self._stop.is_set()

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Block until the current term must end (lease lost, hand-off requested, `stop` called) or ``timeout``.

        True if it must end. What a sync leader callback waits on between steps (``lease.wait_stop()``
        does not wake on `stop`).
        """
        lease = self._lease
        if self._stop.is_set() or lease is None or lease.lost or lease.handoff_requested:
            return True
        return self._term_ends.wait(timeout)

    def stop(self) -> None:
        """Stop campaigning; a leader steps down once its callback returns (see `wait_stop`). Does not wait.

        A campaign attempt in flight is cancelled on the server (and a grant it committed released):
        ``join`` then returns at once, even while the lease row is locked by another session.
        """
        self._stop.set()
        self._end_term()
        acquiring = self._acquiring
        if acquiring is not None:
            # On a thread of its own: stop() may run in a signal handler, and a cancel request waits.
            interrupt = functools.partial(acquiring.interrupt, grace=_INTERRUPT_GRACE)
            threading.Thread(target=interrupt, name="pg_lease election stop", daemon=True).start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the election's thread to end (after `stop`); True if it has."""
        if self._thread is not None:
            # The thread's own event, not Thread.join() alone: an exception from a signal handler
            # (SIGTERM, Ctrl-C) that interrupts Thread.join() can leave the thread marked stopped
            # while it runs (CPython before 3.13, bpo-45274), and a second join() returns at once.
            if not self._done.wait(timeout):
                return False
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def __enter__(self) -> Election:
        # In the main thread: a SIGTERM unwinds this block, which steps down (see sigterm.py).
        self._sigterm = sigterm.enter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        counted, self._sigterm = self._sigterm, False
        try:
            self.stop()
            self.join()
        finally:
            sigterm.leave(counted)

    # ---- shared by both loops --------------------------------------------------------------------

    def _end_term(self, ends: threading.Event | None = None) -> None:
        # on_lost / on_handoff of a term's hold (a heartbeat worker thread; ``ends``: that term's
        # event, so a late call about an earlier term ends nothing), and stop().
        (ends or self._term_ends).set()
        for wake in list(self._wakers):
            try:
                wake()
            except Exception:
                logger.exception("waking the leader of election %r failed", self.key)

    def _seen(self, identity: str) -> bool:
        """Record ``identity`` as the leader; True when it is a change (then on_new_leader is due)."""
        if identity == self._leader:
            return False
        self._leader = identity
        return True

    def _start_term(self, lease: HeldLease) -> None:
        self._term_failed = False
        self._lease = lease
        metrics.leading(lease)
        if self._stop.is_set():  # stop() came while acquiring: the callback must see it at once
            self._term_ends.set()

    def _end_of(self, lease: HeldLease, ended: _End) -> _End:
        """What ends the term once the callback is done: a loss or a hand-off outrank a return."""
        if lease.lost:
            return _End.LOST
        if ended == _End.RETURNED and lease.handoff_requested:
            return _End.HANDOFF
        return ended

    def _rest(self, ended: _End) -> float:
        """Seconds to wait before campaigning again after a term that ended so (module docstring)."""
        ttl, poll = self._ttl.total_seconds(), conf.poll_interval()
        if ended == _End.FAILED:
            self._failures += 1
            return float(min(ttl, poll * 2 ** min(self._failures - 1, 16)))
        self._failures = 0
        if ended == _End.HANDOFF:
            return ttl
        return poll if ended == _End.RETURNED else 0.0

    def _log_failure(self, what: str, exc: BaseException) -> None:
        logger.error("election %r (%s): %s failed: %r", self.key, self.owner, what, exc, exc_info=exc)

    def _hold(self, on_lost: Callable[[HeldLease], Any] | None, on_handoff: Callable[[HeldLease], Any]) -> Holding:
        return hold(self.key, self._ttl, owner=self.owner, on_lost=on_lost, on_handoff=on_handoff, using=self._using)

    # ---- the thread of elect() -------------------------------------------------------------------

    def _start(self) -> Election:
        self._thread = threading.Thread(target=self._run, name=f"pg_lease election {self.key}"[:100], daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        _current.set(self)
        metrics.campaigning(self.key, 1)
        try:
            while not self._stop.is_set():
                ended = self._term()
                if ended is None:
                    continue
                if ended == _End.HANDOFF:
                    self._watch_for(self._rest(ended))
                else:
                    self._stop.wait(self._rest(ended))
        except BaseException:
            logger.exception("election %r (%s) crashed; it no longer campaigns", self.key, self.owner)
        finally:
            metrics.campaigning(self.key, -1)
            connections.close_all()  # this thread's own (callbacks', and the watch after a hand-off)
            self._done.set()

    def _term(self) -> _End | None:
        """One campaign attempt, and the term it wins; None when refused (after the pause)."""
        ends = self._term_ends = threading.Event()  # this term's: set by its hold's callbacks and by stop()

        def end_term(lease: HeldLease) -> None:
            self._end_term(ends)

        holding = self._hold(end_term, end_term)
        self._acquiring = InFlight()
        report_next_acquire_to(holding, self._acquiring)
        if self._stop.is_set():  # stop() may have read the previous attempt's handle
            self._acquiring.interrupt(grace=_INTERRUPT_GRACE)
        try:
            with holding as lease:
                self._start_term(lease)
                self._call(self._on_new_leader, self.owner, seen=self._seen(self.owner))
                try:
                    self._on_started_leading(lease)
                    ended = _End.STOPPED if self._stop.is_set() else _End.RETURNED
                    if self._term_failed and ended == _End.RETURNED:
                        ended = _End.FAILED
                except Exception as exc:
                    self._log_failure("on_started_leading", exc)
                    ended = _End.FAILED
                finally:
                    self._lease = None
        except NotAcquirableError as busy:
            if busy.holder is not None:
                self._call(self._on_new_leader, busy.holder, seen=self._seen(busy.holder))
            self._stop.wait(conf.poll_interval())
            return None
        except Exception as exc:  # the database, while acquiring: keep campaigning, backing off
            if not self._stop.is_set():  # else: the attempt was interrupted by stop(), and settled
                logger.warning("election %r (%s): campaigning failed: %r", self.key, self.owner, exc)
            self._stop.wait(self._rest(_End.FAILED))
            return None
        finally:
            self._acquiring = None
        ended = self._end_of(lease, ended)
        self._call(self._on_stopped_leading)
        return ended

    def _call(self, callback: Callable[..., Any] | None, *args: Any, seen: bool = True) -> None:
        if callback is None or not seen:
            return
        try:
            callback(*args)
        except Exception as exc:
            self._log_failure(getattr(callback, "__name__", "a callback"), exc)

    def _watch_for(self, seconds: float) -> None:
        """After a hand-off: rest until another leader is seen (on_new_leader) or ``seconds`` pass."""
        from .models import Lease

        deadline = time.monotonic() + seconds
        while not self._stop.wait(min(conf.poll_interval(), max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline:
                return
            try:
                state = Lease.objects.db_manager(self._using).inspect(self.key)
            except Exception as exc:
                logger.warning("election %r: reading the lease failed: %r", self.key, exc)
                continue
            if state.held and state.owner and state.owner != self.owner:
                self._call(self._on_new_leader, state.owner, seen=self._seen(state.owner))
                return

    # ---- the coroutine of aelect() ---------------------------------------------------------------

    async def _acampaign(self) -> None:
        """`_run` for the event loop: campaign until cancelled."""
        metrics.campaigning(self.key, 1)
        try:
            while True:
                ended = await self._aterm()
                if ended is None:
                    continue
                if ended == _End.HANDOFF:
                    await self._awatch_for(self._rest(ended))
                else:
                    await asyncio.sleep(self._rest(ended))
        finally:
            metrics.campaigning(self.key, -1)

    async def _aterm(self) -> _End | None:
        """`_term` for the event loop; None when refused (after the pause)."""
        loop = asyncio.get_running_loop()
        step_down = asyncio.Event()

        def handoff(lease: HeldLease) -> None:  # a heartbeat worker thread; a loss cancels this task through the hold
            loop.call_soon_threadsafe(step_down.set)

        started = False
        held: HeldLease | None = None
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            async with self._hold(None, handoff) as lease:
                held = lease
                self._start_term(lease)
                await self._acall(self._on_new_leader, self.owner, seen=self._seen(self.owner))
                started = True
                leader: asyncio.Future[Any] = asyncio.ensure_future(self._on_started_leading(lease))
                stepping = asyncio.ensure_future(step_down.wait())
                try:
                    await asyncio.wait({leader, stepping}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when this task is cancelled: by the hold on a loss, or from outside
                    self._lease = None
                    stepping.cancel()
                    if not leader.done():
                        leader.cancel()
                        await asyncio.wait({leader})
                if leader.cancelled():
                    ended = _End.RETURNED  # by the hand-off (see _end_of)
                elif (exc := leader.exception()) is not None:
                    self._log_failure("on_started_leading", exc)
                    ended = _End.FAILED
                else:
                    ended = _End.RETURNED
        except NotAcquirableError as busy:
            if busy.holder is not None:
                await self._acall(self._on_new_leader, busy.holder, seen=self._seen(busy.holder))
            await asyncio.sleep(conf.poll_interval())
            return None
        except LeaseLostError:
            if not started:
                return _End.LOST
            ended = _End.LOST  # the hold cancelled this task on the loss, and turned that into this error
        except asyncio.CancelledError:
            # The hold's own cancellation on a loss normally comes back as LeaseLostError; one that lands
            # as the hold is being left escapes unconverted. It is ours if it is the only one pending.
            if task is not None and held is not None and held.lost and task.cancelling() == cancelling + 1:
                task.uncancel()
                ended = _End.LOST
            else:
                if started:  # cancelled from outside while leading: the hold has released; step down, then go
                    await self._acall(self._on_stopped_leading)
                raise
        except Exception as exc:  # the database, while acquiring: keep campaigning, backing off
            logger.warning("election %r (%s): campaigning failed: %r", self.key, self.owner, exc)
            if started:
                await self._acall(self._on_stopped_leading)
            await asyncio.sleep(self._rest(_End.FAILED))
            return None
        if ended != _End.LOST:
            ended = self._end_of(lease, ended)
        await self._acall(self._on_stopped_leading)
        return ended

    async def _acall(self, callback: Callable[..., Any] | None, *args: Any, seen: bool = True) -> None:
        if callback is None or not seen:
            return
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            self._log_failure(getattr(callback, "__name__", "a callback"), exc)

    async def _awatch_for(self, seconds: float) -> None:
        """`_watch_for` for the event loop."""
        from .models import Lease

        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(conf.poll_interval(), remaining))
            try:
                state = await Lease.objects.db_manager(self._using).ainspect(self.key)
            except Exception as exc:
                logger.warning("election %r: reading the lease failed: %r", self.key, exc)
                continue
            if state.held and state.owner and state.owner != self.owner:
                await self._acall(self._on_new_leader, state.owner, seen=self._seen(state.owner))
                return


def elect(
    key: str,
    *,
    ttl: Seconds,
    on_started_leading: Callable[[HeldLease], Any],
    on_stopped_leading: Callable[[], Any],
    on_new_leader: Callable[[str], Any] | None = None,
    owner: str | None = None,
    using: str | None = None,
) -> Election:
    """Campaign for ``key`` in a thread of its own; lead (call ``on_started_leading``) whenever elected.

    Of all campaigners for a key, at most one leads at a time (the lease's holder, fenced by its
    epoch). The loop: campaign until the lease is won; call ``on_started_leading(lease)`` with the
    `HeldLease` in the election's thread; when it returns or raises, or the lease is lost, or a
    hand-off is requested (``Lease.objects.request_handoff``), or `Election.stop` is called:
    leave the hold (release, unless lost), call ``on_stopped_leading()``, rest (a hand-off: until
    another leader is seen or one TTL passed) and campaign again unless stopped.

    ``on_started_leading`` must return when the term must end: wait between steps on
    ``current_election().wait_stop(timeout)`` (lost, hand-off or stop) or ``lease.wait_stop()``
    (lost or hand-off), or check ``lease.lost`` / ``lease.handoff_requested``. It cannot be
    interrupted; while it has not returned the lease is not released (though it may be lost:
    guard side effects with the lease as a fence). An exception from it is logged and ends the
    term; the next campaign backs off (doubling from ``PG_LEASE_POLL_INTERVAL`` up to one TTL).
    Exceptions from the other callbacks are logged.

    Args:
        key: the lease key.
        ttl: seconds or timedelta each grant and renewal lasts (renewed every ``ttl / 3``).
        on_started_leading: ``f(lease)``, called in the election thread at the start of each term.
        on_stopped_leading: ``f()``, called after each term, once the lease is released (or lost).
        on_new_leader: ``f(identity)``, called with each new leader identity observed: the holder
            named by a refused attempt, and ``owner`` when this campaigner wins (once per change).
        owner: this campaigner's identity for every term; default ``host:pid:random``.
        using: the database alias; default the router's write database for Lease.

    Returns:
        The running `Election`: ``stop()``, ``join()``, ``leading``, ``leader``; leaving ``with
        elect(...)`` stops it and waits for its thread. The thread is a daemon: a process that
        exits without stopping leaves its lease to lapse after ``ttl``.

    Raises:
        InvalidInputError: a bad argument; nothing was started.
    """
    return Election(  # noqa: SLF001 (_start: Election is of this module; elect() is its public start)
        key,
        ttl=ttl,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
        on_new_leader=on_new_leader,
        owner=owner,
        using=using,
    )._start()


async def aelect(
    key: str,
    *,
    ttl: Seconds,
    on_started_leading: Callable[[HeldLease], Awaitable[Any]],
    on_stopped_leading: Callable[[], Any],
    on_new_leader: Callable[[str], Any] | None = None,
    owner: str | None = None,
    using: str | None = None,
) -> None:
    """`elect` for the event loop: campaign for ``key`` until this coroutine is cancelled.

    ``on_started_leading(lease)`` is a coroutine function, run as a task of its own for each term;
    the task is cancelled when the lease is lost, a hand-off is requested, or this coroutine is
    cancelled (the term then ends as in `elect`: release, ``on_stopped_leading()``, and, on
    cancellation, the CancelledError goes on). ``on_stopped_leading`` and ``on_new_leader`` may be
    plain or coroutine functions. Arguments as for `elect`; the database calls run in worker threads.

    Raises:
        InvalidInputError: a bad argument.
    """
    if not iscoroutinefunction(on_started_leading):
        raise InvalidInputError("on_started_leading of aelect() must be a coroutine function (async def)")
    election = Election(
        key,
        ttl=ttl,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
        on_new_leader=on_new_leader,
        owner=owner,
        using=using,
    )
    await election._acampaign()  # noqa: SLF001 (Election is of this module); aelect is the event loop's driver of an Election, elect() its thread's
