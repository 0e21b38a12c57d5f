"""``elect()``: an election driven by a thread of its own, and `Election`, the handle it returns.

The thread performs the steps of `pg_lease_django.election.plan` with blocking calls; every decision
is the plan's. What is a thread's own is here:

- **Campaigning** is a non-blocking ``hold()`` attempt every ``PG_LEASE_POLL_INTERVAL``, 0.5 s by
  default, sleeping on an event in between. A refused attempt is one cheap statement, with no
  write and no lock, and it names the holder for ``on_new_leader``. ``stop()`` ends the sleep at
  once and interrupts an attempt in flight on the server. It is not ``hold(blocking=True)``, for
  two reasons: that wait cannot be interrupted from another thread, and a wait that times out
  closes its connection, so waiting in short slices would reconnect every slice.
- **Leading** is the callback running in this thread inside the hold. It cannot be interrupted: it
  returns when told, by `Election.wait_stop`. That wakes when the lease is lost, a hand-off is
  requested or the election is stopped, through the hold's ``on_lost`` and ``on_handoff`` and
  through ``stop()``.

See docs/leader-election.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from django.db import connections

from pg_lease_django import sigterm
from pg_lease_django.holds.holding import report_next_acquire_to
from pg_lease_django.holds.lease import HeldLease
from pg_lease_django.holds.lease_connection import InFlight
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.plans import Pause, drive
from pg_lease_django.validation import Seconds

from .candidate import Candidate, Term, leader_in, logger
from .plan import (
    ENDED_BY_STOP,
    Announce,
    Failed,
    Lead,
    Leave,
    Left,
    ReadLeader,
    Refused,
    Stand,
    Step,
    StepDown,
    TermEnd,
    Won,
)

__all__ = ["Election", "current_election", "elect", "fail_term", "start"]

#: Seconds between the cancel request of a campaign attempt interrupted by `Election.stop` and
#: shutting its socket (the attempt is settled on the server either way: `wait.settling.settle`).
_INTERRUPT_GRACE = 1.0


class _Stopped(Exception):
    """Thrown into the plan at a step a stopped campaign does not take: it ends the plan and the thread."""


_current: ContextVar[Election | None] = ContextVar("pg_lease_current_election", default=None)


def current_election() -> Election | None:
    """The `Election` whose ``on_started_leading`` runs in this thread, or None (in ``aelect``'s task too).

    A sync leader callback uses it to watch ``stop()`` as well as its lease::

        def lead(lease):
            election = current_election()
            while not election.wait_stop(timeout=5):
                do_one_step(lease)
    """
    return _current.get()


class Election:
    """A campaign for ``key``: the handle ``elect()`` returns, also usable as a context manager.

    Attributes:
        key: the lease key campaigned for.
        owner: this campaigner's identity, the same for every term; ``host:pid:random`` by default.
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
        self._candidate = Candidate(
            key,
            ttl=ttl,
            on_started_leading=on_started_leading,
            on_stopped_leading=on_stopped_leading,
            on_new_leader=on_new_leader,
            owner=owner,
            using=using,
        )
        self.key = self._candidate.key
        self.owner = self._candidate.owner
        self._stop = threading.Event()
        self._term_ends = threading.Event()  # set when the current term must end: lost, hand-off, stop
        self._term: Term | None = None  # entered by the plan's Stand, left by its Leave
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
        lease = self._candidate.lease
        return lease is not None and not lease.lost

    @property
    def leader(self) -> str | None:
        """The last leader identity observed (``owner`` when this campaigner won), or None."""
        return self._candidate.leader

    @property
    def lease(self) -> HeldLease | None:
        """The `HeldLease` of the current term, or None when not leading."""
        return self._candidate.lease

    @property
    def stopping(self) -> bool:
        """True once `stop` was called."""
        return self._stop.is_set()

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Block until the current term must end or ``timeout`` passes; True if it must end.

        The term must end when the lease is lost, a hand-off is requested or `stop` is called. A sync
        leader callback waits on this between steps. ``lease.wait_stop()`` does not wake on `stop`.
        """
        lease = self._candidate.lease
        if self._stop.is_set() or lease is None or lease.lost or lease.handoff_requested:
            return True
        return self._term_ends.wait(timeout)

    def stop(self) -> None:
        """Stop campaigning; a leader steps down once its callback returns, see `wait_stop`. Does not wait.

        A campaign attempt in flight is cancelled on the server, and a grant it committed is released.
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

    def _end_term(self, ends: threading.Event | None = None) -> None:
        # on_lost / on_handoff of a term's hold (a heartbeat worker thread; ``ends``: that term's
        # event, so a late call about an earlier term ends nothing), and stop().
        (ends or self._term_ends).set()
        for wake in list(self._wakers):
            try:
                wake()
            except Exception:
                logger.exception("waking the leader of election %r failed", self.key)

    # ---- the thread of elect(): the plan's steps, blocking -----------------------------------------

    def _start(self) -> Election:
        self._thread = threading.Thread(target=self._run, name=f"pg_lease election {self.key}"[:100], daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """Perform the plan's steps until stopped."""
        _current.set(self)
        metrics.campaigning(self.key, 1)
        try:
            drive(self._candidate.campaign.plan(), self._perform)
        except _Stopped:
            pass
        except BaseException as exc:
            self._abandon_term(exc)
            logger.error("election %r (%s) crashed; it no longer campaigns", self.key, self.owner, exc_info=exc)
        finally:
            metrics.campaigning(self.key, -1)
            connections.close_all()  # this thread's own (callbacks', and the look for a leader after a hand-off)
            self._done.set()

    def _perform(self, step: Step) -> Any:
        from pg_lease_django.models import Lease

        candidate = self._candidate
        if self._stop.is_set() and isinstance(step, ENDED_BY_STOP):
            raise _Stopped
        match step:
            case Stand():
                return self._attempt()
            case Announce(identity):
                candidate.announce(identity)
            case Lead():
                return self._lead()
            case Leave():
                return self._leave()
            case StepDown():
                candidate.call(candidate.on_stopped_leading)
            case Pause(seconds):
                self._stop.wait(seconds)
            case ReadLeader():
                try:
                    return leader_in(Lease.objects.db_manager(candidate.using).inspect(self.key))
                except Exception as exc:
                    candidate.log_read_failure(exc)
        return None

    def _attempt(self) -> Won | Refused | Failed:
        """Enter a hold of the key without waiting; ``stop()`` interrupts the attempt on the server."""
        ends = self._term_ends = threading.Event()  # this term's: set by its hold's callbacks and by stop()

        def end_term(lease: HeldLease) -> None:
            self._end_term(ends)

        holding = self._candidate.hold(end_term, end_term)
        self._acquiring = InFlight()
        report_next_acquire_to(holding, self._acquiring)
        if self._stop.is_set():  # stop() may have read the previous attempt's handle
            self._acquiring.interrupt(grace=_INTERRUPT_GRACE)
        try:
            lease = holding.__enter__()
        except Exception as exc:  # refused, or the database (or interrupted by stop(), and settled)
            return self._candidate.refused_or_failed(exc, stopping=self._stop.is_set())
        finally:
            self._acquiring = None
        self._term = Term(holding, lease)
        self._term_failed = False
        self._candidate.begin_term(lease)
        if self._stop.is_set():  # stop() came while acquiring: the callback must see it at once
            ends.set()
        return Won()

    def _lead(self) -> TermEnd:
        """Run the leader callback in this thread: it returns when told (`wait_stop`)."""
        candidate, term = self._candidate, self._term
        assert term is not None  # the plan leads only after a won attempt
        try:
            candidate.on_started_leading(term.lease)
        except Exception as exc:
            candidate.log_failure("on_started_leading", exc)
            return TermEnd.FAILED
        finally:
            candidate.lease = None
        return TermEnd.FAILED if self._term_failed else TermEnd.RETURNED

    def _leave(self) -> Left | Failed:
        """Leave the term's hold: release, unless lost."""
        term, self._term = self._term, None
        assert term is not None  # the plan leaves only after a won attempt
        try:
            term.holding.__exit__(None, None, None)
        except Exception as exc:  # the database: keep campaigning, backing off
            return self._candidate.failed(exc, stopping=self._stop.is_set())
        return Left(lost=term.lease.lost, handoff_requested=term.lease.handoff_requested)

    def _abandon_term(self, exc: BaseException) -> None:
        """Leave the hold of a term that ``exc`` (raised through a step, ending the thread) cut short."""
        term, self._term = self._term, None
        self._candidate.lease = None
        if term is not None:
            try:
                term.holding.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as error:
                self._candidate.log_campaign_failure(error)


# ---- for pg_lease_django.management.supervision.campaign (``leases run --campaign``): hooks, not public API ----------


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
    """Campaign for ``key`` in a thread of its own, and lead whenever elected by calling ``on_started_leading``.

    Of all campaigners for a key, at most one leads at a time: the lease's holder, fenced by its
    epoch. The loop goes like this. Campaign until the lease is won. Call
    ``on_started_leading(lease)`` with the `HeldLease` in the election's thread. The term ends when
    that returns or raises, when the lease is lost, when a hand-off is requested with
    ``Lease.objects.request_handoff``, or when `Election.stop` is called. Then leave the hold,
    releasing the lease unless it was lost, and call ``on_stopped_leading()``. Rest, and campaign
    again unless stopped. After a hand-off the rest lasts until another leader is seen or one TTL has
    passed.

    ``on_started_leading`` must return when the term must end. Between steps it can wait on
    ``current_election().wait_stop(timeout)``, which wakes on a loss, a hand-off or a stop. It can
    wait on ``lease.wait_stop()``, which wakes on a loss or a hand-off. Or it can check ``lease.lost``
    and ``lease.handoff_requested``. It cannot be interrupted. While it has not returned, the lease is
    not released, though it may be lost: guard side effects with the lease as a fence. An exception
    from it is logged and ends the term. The next campaign then backs off, doubling from
    ``PG_LEASE_POLL_INTERVAL`` up to one TTL. Exceptions from the other callbacks are logged.

    Args:
        key: the lease key.
        ttl: seconds or timedelta each grant and renewal lasts; it is renewed every ``ttl / 3``.
        on_started_leading: ``f(lease)``, called in the election thread at the start of each term.
        on_stopped_leading: ``f()``, called after each term, once the lease is released or lost.
        on_new_leader: ``f(identity)``, called once per change with each new leader identity
            observed: the holder named by a refused attempt, and ``owner`` when this campaigner wins.
        owner: this campaigner's identity for every term; default ``host:pid:random``.
        using: the database alias; default the router's write database for Lease.

    Returns:
        The running `Election`, with ``stop()``, ``join()``, ``leading`` and ``leader``. Leaving
        ``with elect(...)`` stops it and waits for its thread. The thread is a daemon: a process that
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
