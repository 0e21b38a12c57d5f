"""One hold's renewals, in `Heartbeat`, run by the process's scheduler in `pg_lease_django.holds.scheduler`.

Nothing here is public API; `pg_lease_django` is. A `Heartbeat` owns its hold's `Tenure` from
`pg_lease_django.holds.lease` and changes it only through the tenure's named methods. The job's
`HeldLease` reads it. Its statements go through connections lent by `lease_pool`.

- **Bounded exits**: leaving a hold waits for a renewal in flight no longer than the end of the
  trust window. It waits for the release no longer than ``max(renew interval, 1 s)`` plus
  ``INTERRUPT_GRACE``. Past that the call is interrupted by `LeaseConnection.interrupt`, and the
  outcome is ``unknown``: the lease lapses at its expiry. The interrupt is a cancel, which also
  ends a commit's wait for a synchronous standby where ``statement_timeout`` does not. If the
  server cannot be reached, the socket is then shut. A renewal still in flight when the trust
  window ends is interrupted the same way.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Literal

from django.db import DatabaseError, connections

from pg_lease_django.exceptions import HeartbeatFailedError, LeaseLostError
from pg_lease_django.metrics import hooks as metrics

from . import lease_connection, lease_pool
from .lease import Tenure
from .scheduler import Scheduler, process_scheduler, run_job

logger = logging.getLogger(__name__)

#: Longest pause between two attempts after a failed renewal (the first retry is after 50 ms).
MAX_RETRY_DELAY = 2.0

#: Seconds between the cancel request of an interrupted call and shutting its socket.
INTERRUPT_GRACE = 1.0

Outcome = Literal["freed", "kept", "gone", "unknown"]


# ---- one hold's renewals -------------------------------------------------------------------------


class Heartbeat:
    """The renewals of one hold, driven by the process's scheduler; its release when the hold ends.

    A transient failure is logged and retried on another connection. That is anything but a verdict:
    a lost connection, a server restarting, a statement timeout. Only a verdict such as
    ``not_owner``, ``lapsed`` or ``epoch_mismatch``, or the end of the trust window, declares the lease
    lost. At most one renewal of a hold is in flight at a time. `finish` waits for it, then makes the
    last move on a pooled connection: it releases, or keeps the lease until ``hold_at_least``.
    """

    def __init__(self, tenure: Tenure, pool: lease_pool.LeasePool, *, ttl: timedelta, interval: float) -> None:
        self.tenure = tenure  # the state this heartbeat drives
        self.lease = tenure.lease
        self.pool = pool
        self.ttl = ttl
        self.interval = interval
        self.outcome: Outcome = "unknown"
        self._cond = threading.Condition()
        self._next_at = self.tenure.granted_at + interval
        self._failures = 0
        self._in_flight = False  # a renewal is in flight (or waiting for a worker)
        self._jobs = 0  # jobs of this hold handed to workers and not finished: `finish` waits for them
        self._beating = True  # False once lost (no more renewals)
        self._stopped = False
        self._generation = 0  # only the latest due time scheduled counts
        self._scheduler: Scheduler | None = None
        self._renewing: lease_connection.InFlight | None = None  # the renewal in flight, to interrupt
        #: True once `finish` has ended (whatever its outcome): a second call does nothing.
        self.ended = False
        self._left_early = False  # an interrupted finish released with a renewal perhaps in flight

    def start(self) -> None:
        """Hand the renewals to the process's scheduler."""
        self._scheduler = process_scheduler()
        self._scheduler.add(self)
        with self._cond:
            self._schedule(min(self._next_at, self.tenure.trusted_until))

    def finish(self, *, keep_until: float | None = None) -> Outcome:
        """Stop renewing, then release, or keep the lease until ``keep_until``, a monotonic instant.

        It first waits for a renewal in flight. It may be interrupted in this thread before its last move
        is made, by a signal, KeyboardInterrupt or SystemExit. It then makes that move anyway, and the
        interruption goes on. A release cut short is completed on a fresh session by
        `LeaseConnection.release`. A second call does nothing.
        """
        if self.ended:
            self._unregister()  # an interrupt may have cut the first call short just before
            return self.outcome
        if self.pool.pid != os.getpid():
            # A hold entered before a fork, left in the child: the parent's scheduler and
            # connections are not the child's to use (the parent still renews and releases it).
            self._stopped = True
            return "unknown"
        try:
            try:
                self._stop_renewing()
                self.outcome = self._finish(keep_until)
            except Exception:
                logger.exception("ending the hold of lease %r failed; it lapses at its expiry", self.lease.key)
                self.outcome = "unknown"
            except BaseException:
                # Interrupted before the last move was made (or known to be): make it now, once. A
                # verdict then is no loss: the interrupted release had committed, or was completed.
                # (Without waiting for a renewal in flight again: what was interrupted may be that wait.)
                self._stopped = self._left_early = True
                try:
                    self.outcome = self._finish(keep_until, again=True)
                except Exception:
                    logger.warning("ending the hold of lease %r failed; it lapses at its expiry", self.lease.key)
                    self.outcome = "unknown"
                raise
        finally:
            self.ended = True
            self._unregister()  # after the end: its watchdog runs on the scheduler
        return self.outcome

    def _unregister(self) -> None:
        if self._scheduler is not None:
            self._scheduler.remove(self)

    def _stop_renewing(self) -> None:
        with self._cond:
            self._stopped = True
            self._generation += 1
            # A renewal in flight ends within its statement_timeout, unless its commit waits for a
            # synchronous standby that is gone: wait no longer than the trust window, then interrupt it.
            while self._jobs:
                remaining = self.tenure.trusted_until - time.monotonic()
                if self._in_flight and remaining <= 0:
                    break
                self._cond.wait(remaining if self._in_flight else None)
            stuck = self._renewing if self._in_flight else None
        if stuck is not None:
            logger.warning(
                "a renewal of lease %r did not return within the trust window; interrupting it", self.lease.key
            )
            stuck.interrupt(grace=INTERRUPT_GRACE)

    # ---- the scheduler thread --------------------------------------------------------------------

    def _schedule(self, when: float) -> None:  # with self._cond held
        self._generation += 1
        if self._scheduler is not None:
            self._scheduler.at(when, functools.partial(self._due, self._generation))

    def _due(self, generation: int) -> None:
        """The scheduler woke for this hold: lose trust, or hand a renewal to a worker, or wait on."""
        with self._cond:
            if generation != self._generation or self._stopped or not self._beating:
                return
            now = time.monotonic()
            trusted_until = self.tenure.trusted_until
            if now >= trusted_until:
                self._beating = False
                job: Callable[[], None] = functools.partial(
                    self._lose_trust, self._renewing if self._in_flight else None
                )
                self._jobs += 1
                # Even when every worker is stuck in a renewal: this is what frees them.
                urgent = True
            elif self._in_flight:
                self._schedule(trusted_until)  # the renewal in flight may hang: still lose trust on time
                return
            elif now < self._next_at:
                self._schedule(min(self._next_at, trusted_until))
                return
            else:
                timeout = min(self.interval, trusted_until - now)
                self._in_flight = True
                self._jobs += 1
                self._schedule(trusted_until)
                job = functools.partial(self._renew, timeout)
                urgent = False
        assert self._scheduler is not None
        self._scheduler.submit(job, beyond_limit=urgent)

    # ---- worker threads --------------------------------------------------------------------------

    def _lose_trust(self, in_flight: lease_connection.InFlight | None) -> None:
        try:
            if in_flight is not None:
                # A renewal hung past the trust window (a commit waiting for a gone standby): free its
                # worker and connection (on a thread of its own: a cancel may block up to the grace).
                _interrupt_soon(in_flight)
            self.tenure.lose_trust()  # log, on_lost, lease_lost, cancel an async job: before the exit goes on
        finally:
            with self._cond:
                self._jobs -= 1
                self._cond.notify_all()

    def _renew(self, timeout: float) -> None:
        lease = self.lease
        next_at: float | None = None
        handoff = False
        call = self._renewing = lease_connection.InFlight()
        try:
            if self._stopped:
                return  # the hold ended while this renewal waited for a worker: never renew after the end
            try:
                renewal, sent_at = self.pool.renew(
                    lease.key, lease.owner, lease.epoch, self.ttl, timeout=timeout, call=call
                )
            except LeaseLostError as exc:
                self._stop_beating()
                if not self._left_early:  # else the verdict answers our own release, not a loss
                    self.tenure.declare_lost(exc, definitive=True)
                return
            except Exception:
                metrics.renewal_failed(lease.key)
                self._failures += 1
                delay = min(self.interval, MAX_RETRY_DELAY, 0.05 * 2 ** min(self._failures - 1, 10))
                logger.warning(
                    "renewing lease %r failed (attempt %d); retrying in %.2fs until the trust window ends",
                    lease.key,
                    self._failures,
                    delay,
                    exc_info=True,
                )
                next_at = time.monotonic() + delay
                return
            if self._failures:
                logger.info("renewed lease %r after %d failed attempts", lease.key, self._failures)
            self._failures = 0
            metrics.hold_renewed(
                lease.key, lease.epoch, sent_at, self.tenure.trusted_until
            )  # before _renewed moves the trust window
            if not self.tenure.renewed(renewal.expires_at, sent_at):
                self._stop_beating()  # the answer came after the trust window ended: lost all the same
                return
            handoff = renewal.handoff_requested
            next_at = sent_at + self.interval
        except BaseException as exc:
            logger.exception("heartbeat of lease %r crashed; treating the lease as lost", lease.key)
            self._stop_beating()
            crashed = HeartbeatFailedError(
                f"heartbeat of lease {lease.key!r} crashed ({exc!r}); no more renewals",
                key=lease.key,
                owner=lease.owner,
                epoch=lease.epoch,
            )
            crashed.__cause__ = exc
            self.tenure.declare_lost(crashed, definitive=False)
        finally:
            call.done.set()
            with self._cond:
                self._in_flight = False
                self._jobs -= 1
                if next_at is not None:
                    self._next_at = next_at
                if self._beating and not self._stopped:
                    self._schedule(min(self._next_at, self.tenure.trusted_until))
                self._cond.notify_all()
        if handoff and not lease.handoff_requested:
            # On a thread of its own, once: a slow on_handoff or receiver delays no renewal of any hold.
            threading.Thread(
                target=run_job, args=(self.tenure.handoff_requested_seen,), name="pg_lease hand-off", daemon=True
            ).start()

    def _stop_beating(self) -> None:
        with self._cond:
            self._beating = False

    # ---- the end of the hold (the thread that leaves it) -----------------------------------------

    def _finish(self, keep_until: float | None, *, again: bool = False) -> Outcome:
        """The last move. ``again``: a first one was interrupted; a verdict now means it took effect."""
        lease = self.lease
        if self.tenure.gone:
            return "gone"  # the server said it is not ours: nothing to release
        if keep_until is not None and not lease.lost:
            remaining = keep_until - time.monotonic()
            if remaining >= 0.001:
                return self._keep(remaining)
        bound = max(self.interval, 1.0)
        for attempt in (1, 2):
            call = lease_connection.InFlight()
            try:
                with self._watchdog(call, bound):
                    self.pool.release(lease.key, lease.owner, lease.epoch, timeout=bound, call=call)
            except LeaseLostError as exc:
                if again:
                    return "freed"  # by the interrupted release (or its completion): not a loss
                self.tenure.declare_lost(exc, definitive=True)  # lost unnoticed (a no-op if already known)
                return "gone"
            except Exception as exc:
                if attempt == 2 or call.interrupted:  # a release that hung would hang again: give up
                    # One line for the database's failure (unreachable, cut off: an operator reads it
                    # in a stop's log); a traceback only for anything else, which would be a bug.
                    logger.warning(
                        "releasing lease %r failed (%s); it lapses at its expiry (%s)%s",
                        lease.key,
                        (str(exc).strip().splitlines() or [type(exc).__name__])[0],
                        lease.expires_at,
                        self._own_transaction_hint(),
                        exc_info=not isinstance(exc, DatabaseError),
                    )
                    return "unknown"
                continue
            return "freed"
        return "unknown"  # pragma: no cover

    def _own_transaction_hint(self) -> str:
        # The likeliest cause of a release that waited until its bound: the leaving thread's own
        # transaction, still open, made a fenced write, and its fence locks the lease row until it
        # commits (a hold ended inside atomic(), or in a TestCase, whose transaction ends with the test).
        alias = self.lease.using
        if alias not in connections or not connections[alias].in_atomic_block:
            return ""
        return (
            f": the hold ended inside a transaction on database {alias!r} (atomic(), or a TestCase) that has not "
            "committed; if it made fenced writes, their fence locks the lease row until it commits, and the "
            "release waits for that. End the hold after the transaction (in tests: TransactionTestCase, or "
            "pytest's transaction=True)"
        )

    def _keep(self, remaining: float) -> Outcome:
        # Renew to exactly the time left, under our (owner, epoch): the lease then lapses on its own
        # at grant + hold_at_least. A renewal can shorten a lease as well as extend it.
        lease = self.lease
        bound = max(self.interval, 1.0)
        call = lease_connection.InFlight()
        try:
            with self._watchdog(call, bound):
                renewal, _sent_at = self.pool.renew(
                    lease.key, lease.owner, lease.epoch, timedelta(seconds=remaining), timeout=bound, call=call
                )
        except LeaseLostError as exc:
            self.tenure.declare_lost(exc, definitive=True)
            return "gone"
        except Exception:
            logger.warning(
                "keeping lease %r until hold_at_least failed; it lapses at its expiry (%s)",
                lease.key,
                lease.expires_at,
                exc_info=True,
            )
            return "unknown"
        lease.expires_at = renewal.expires_at
        return "kept"

    @contextmanager
    def _watchdog(self, call: lease_connection.InFlight, bound: float) -> Iterator[None]:
        """Interrupt ``call`` if it has not returned ``bound`` seconds from now, plus a margin.

        The margin lets the server's own statement_timeout, which is ``bound``, answer first when it can.
        The interrupt runs on a thread of its own: the workers may all be stuck in what it is to end.
        """
        scheduler = self._scheduler if self._scheduler is not None and self._scheduler.pid == os.getpid() else None
        if scheduler is not None:
            scheduler.at(time.monotonic() + bound + INTERRUPT_GRACE, functools.partial(_interrupt_soon, call))
        try:
            yield
        finally:
            call.done.set()


def _interrupt_soon(call: lease_connection.InFlight) -> None:
    """Interrupt ``call`` on a thread of its own: the caller (the scheduler, a worker) must not block."""
    if not call.done.is_set():
        threading.Thread(
            target=call.interrupt, kwargs={"grace": INTERRUPT_GRACE}, name="pg_lease interrupt", daemon=True
        ).start()
