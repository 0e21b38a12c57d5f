"""Leader election on ``hold()``: campaign for a key, lead while the hold lasts, step down, campaign again.

``elect()`` runs the loop in a thread of its own and returns an `Election` handle; ``aelect()``
(`pg_lease_django.async_election`) is the same loop as a coroutine. See docs/leader-election.md.

- **Campaigning** is a non-blocking ``hold()`` attempt every ``PG_LEASE_POLL_INTERVAL`` (0.5 s),
  sleeping on an event in between: a refused attempt is one cheap statement (no write, no lock)
  that names the holder (``on_new_leader``), and ``stop()`` ends the sleep at once. Not
  ``hold(blocking=True)``: its wait cannot be interrupted from another thread, and a wait that
  times out closes its connection, so waiting in short slices would reconnect every slice.
- **Leading** is the callback running inside the hold. A term ends when the callback returns or
  raises, the lease is lost, a hand-off is requested, or the election is stopped; then the hold
  is left (released, unless lost) and ``on_stopped_leading()`` is called.
- **Resting** before the next campaign, and everything else decided between terms, is
  `pg_lease_django.election_plan`: written once, run by the thread of ``elect()`` and the
  coroutine of ``aelect()`` (`Election._run`, `AsyncElection._acampaign`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from django.db import connections

from . import sigterm
from .election_plan import (
    Announce,
    Campaign,
    CampaignFailed,
    ReadLeader,
    Refused,
    Rest,
    RunTerm,
    Served,
    Step,
    StepDown,
    TermEnd,
    TermOutcome,
    term_end,
)
from .exceptions import InvalidInputError, NotAcquirableError
from .holds.holding import Holding, hold, report_next_acquire_to
from .holds.lease import HeldLease
from .holds.lease_connection import InFlight
from .metrics import hooks as metrics
from .operations import LeaseState
from .owners import default_owner
from .validation import Seconds, check_new_name, check_ttl

__all__ = ["Election", "current_election", "elect"]

logger = logging.getLogger(__name__)

#: Seconds between the cancel request of a campaign attempt interrupted by `Election.stop` and
#: shutting its socket (the attempt is settled on the server either way: `settling.settle`).
_INTERRUPT_GRACE = 1.0

_current: ContextVar[Election | None] = ContextVar("pg_lease_current_election", default=None)


#: Steps a stopped campaign does not take (``stop()`` ends it there); an announcement and a step-down still run.
_ENDED_BY_STOP = (RunTerm, Rest, ReadLeader)


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
        self.key = check_new_name("key", key)
        self._ttl = check_ttl(ttl)
        self.owner = check_new_name("owner", owner if owner is not None else default_owner())
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
        self._campaign = Campaign(self.owner, self._ttl.total_seconds())
        self._term_failed = False  # `fail_term`: the term ends as failed (backs off) without raising
        self._thread: threading.Thread | None = None
        self._sigterm = False  # `with` in the main thread counted in sigterm.enter()
        self._done = threading.Event()  # set when the election's thread ends (`join` waits on it)
        #: Called (from any thread) when a term must end (`start`: ``leases run --campaign`` wakes its select).
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

    # ---- shared by both drivers ------------------------------------------------------------------

    def _end_term(self, ends: threading.Event | None = None) -> None:
        # on_lost / on_handoff of a term's hold (a heartbeat worker thread; ``ends``: that term's
        # event, so a late call about an earlier term ends nothing), and stop().
        (ends or self._term_ends).set()
        for wake in list(self._wakers):
            try:
                wake()
            except Exception:
                logger.exception("waking the leader of election %r failed", self.key)

    def _start_term(self, lease: HeldLease) -> None:
        self._term_failed = False
        self._lease = lease
        metrics.leading(lease)
        if self._stop.is_set():  # stop() came while acquiring: the callback must see it at once
            self._term_ends.set()

    def _served(self, lease: HeldLease, ended: TermEnd) -> Served:
        return Served(term_end(ended, lost=lease.lost, handoff_requested=lease.handoff_requested))

    def _call(self, callback: Callable[..., Any] | None, *args: Any) -> Any:
        """Call one of the user's callbacks; an exception from it is logged, never raised. Returns its result
        (an awaitable for the async driver to `_finish`)."""
        if callback is None:
            return None
        try:
            return callback(*args)
        except Exception as exc:
            self._log_failure(getattr(callback, "__name__", "a callback"), exc)
            return None

    def _announce(self, identity: str) -> Any:
        """Record ``identity`` as the leader; on a change, call on_new_leader (`_call`'s result)."""
        if identity == self._leader:
            return None
        self._leader = identity
        return self._call(self._on_new_leader, identity)

    def _holder(self, state: LeaseState) -> str | None:
        return state.owner if state.held and state.owner else None

    def _log_failure(self, what: str, exc: BaseException) -> None:
        logger.error("election %r (%s): %s failed: %r", self.key, self.owner, what, exc, exc_info=exc)

    def _log_campaign_failure(self, exc: BaseException) -> None:
        logger.warning("election %r (%s): campaigning failed: %r", self.key, self.owner, exc)

    def _hold(self, on_lost: Callable[[HeldLease], Any] | None, on_handoff: Callable[[HeldLease], Any]) -> Holding:
        return hold(self.key, self._ttl, owner=self.owner, on_lost=on_lost, on_handoff=on_handoff, using=self._using)

    # ---- the thread of elect() -------------------------------------------------------------------

    def _start(self) -> Election:
        self._thread = threading.Thread(target=self._run, name=f"pg_lease election {self.key}"[:100], daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """The blocking driver of the campaign's plan, until stopped."""
        _current.set(self)
        metrics.campaigning(self.key, 1)
        try:
            plan = self._campaign.plan()
            step = next(plan)
            while not (self._stop.is_set() and isinstance(step, _ENDED_BY_STOP)):
                step = plan.send(self._do(step))
        except BaseException:
            logger.exception("election %r (%s) crashed; it no longer campaigns", self.key, self.owner)
        finally:
            metrics.campaigning(self.key, -1)
            connections.close_all()  # this thread's own (callbacks', and the watch after a hand-off)
            self._done.set()

    def _do(self, step: Step) -> Any:
        from .models import Lease

        match step:
            case RunTerm():
                return self._term()
            case Rest(seconds):
                self._stop.wait(seconds)
            case ReadLeader():
                try:
                    return self._holder(Lease.objects.db_manager(self._using).inspect(self.key))
                except Exception as exc:
                    logger.warning("election %r: reading the lease failed: %r", self.key, exc)
            case Announce(identity):
                self._announce(identity)
            case StepDown():
                self._call(self._on_stopped_leading)
        return None

    def _term(self) -> TermOutcome:
        """One campaign attempt, and the term it wins, in this thread."""
        ends = self._term_ends = threading.Event()  # this term's: set by its hold's callbacks and by stop()

        def end_term(lease: HeldLease) -> None:
            self._end_term(ends)

        holding = self._hold(end_term, end_term)
        self._acquiring = InFlight()
        report_next_acquire_to(holding, self._acquiring)
        if self._stop.is_set():  # stop() may have read the previous attempt's handle
            self._acquiring.interrupt(grace=_INTERRUPT_GRACE)
        led = False
        try:
            with holding as lease:
                self._start_term(lease)
                self._announce(self.owner)
                led = True
                try:
                    self._on_started_leading(lease)
                    ended = TermEnd.STOPPED if self._stop.is_set() else TermEnd.RETURNED
                    if self._term_failed and ended == TermEnd.RETURNED:
                        ended = TermEnd.FAILED
                except Exception as exc:
                    self._log_failure("on_started_leading", exc)
                    ended = TermEnd.FAILED
                finally:
                    self._lease = None
        except NotAcquirableError as busy:
            return Refused(busy.holder)
        except Exception as exc:  # the database, while acquiring or leaving: keep campaigning, backing off
            if not self._stop.is_set():  # else: the attempt was interrupted by stop(), and settled
                self._log_campaign_failure(exc)
            return CampaignFailed(led=led)
        finally:
            self._acquiring = None
        return self._served(lease, ended)


# ---- for pg_lease_django.supervisor (``leases run --campaign``): hooks, not public API ------------


def start(election: Election, *, wake: Callable[[], None]) -> Election:
    """Start ``election`` in its thread as `elect` does, calling ``wake()`` (from any thread) whenever
    a term must end: lost, hand-off requested, or stopped."""
    election._wakers.append(wake)  # noqa: SLF001 (Election is of this module)
    return election._start()  # noqa: SLF001 (Election is of this module)


def fail_term(election: Election) -> None:
    """End ``election``'s current term as failed once its callback returns: the next campaign backs
    off, as after a callback that raised (a COMMAND that exited with an error is no traceback)."""
    election._term_failed = True  # noqa: SLF001 (Election is of this module)


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
    election = Election(
        key,
        ttl=ttl,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
        on_new_leader=on_new_leader,
        owner=owner,
        using=using,
    )
    return election._start()  # noqa: SLF001 (Election is of this module; elect() is its public start)
