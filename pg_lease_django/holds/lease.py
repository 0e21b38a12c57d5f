"""`HeldLease`, what a hold gives its job, and `Tenure`, the state its heartbeat and its hold drive.

`HeldLease` is documented API, re-exported by `pg_lease_django`: a read-only view with the key,
owner, epoch, ``lost``, ``check()`` and more. `Tenure` is the internal contract of
`pg_lease_django.holds.scheduler` and `pg_lease_django.holds.holding`. It holds the trust window,
the verdicts and the events, changed only through its named methods. A tenure makes its lease,
`Tenure.lease`; the lease reads the tenure and changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from pg_lease_django.exceptions import LapsedError, LeaseLostError, NotOwnerError
from pg_lease_django.operations import Grant
from pg_lease_django.signals import lease_handoff_requested, lease_lost

# The documented logger of holds (docs/jobs.md), wherever their code lives.
logger = logging.getLogger("pg_lease_django.jobs")

OnLost = Callable[["HeldLease"], object]


def _fresh(error: LeaseLostError) -> LeaseLostError:
    # A new instance per raise: re-raising one instance would chain every traceback onto it.
    return type(error)(
        str(error),
        key=error.key,
        owner=error.owner,
        epoch=error.epoch,
        holder=error.holder,
        current_epoch=error.current_epoch,
    )


class Tenure:
    """The state of one hold, owned by its heartbeat and its `Holding`; its `lease` is the job's view of it.

    It is changed only through its methods `renewed`, `declare_lost`, `lose_trust`, `end` and
    `handoff_requested_seen`. The monotonic instants are ``time.monotonic()`` values.

    Attributes:
        lease: the `HeldLease` the job is given.
        granted_at: just before the statement that granted the lease was sent.
        trust_span: how long after sending a renewal that succeeded the holder trusts itself.
        trusted_until: the instant the holder stops trusting itself. Only `renewed` moves it, and only
            ever later.
        error: why the lease was lost, the first verdict; or None.
        ended_at: the instant `end` ended the hold, or None.
        released: the hold's release committed. False for a release that failed or was cut short.
        handoff_requested: a renewal said someone asked this holder to step down.
        lost_event: set on loss; ``wait_lost`` sleeps on it.
        stop_event: set on loss and on a hand-off request; ``wait_stop`` sleeps on it.
    """

    def __init__(
        self,
        grant: Grant,
        *,
        ttl: timedelta,
        sent_at: float,
        trust_span: float,
        on_lost: OnLost | None,
        on_handoff: OnLost | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ):
        self.granted_at = sent_at
        self.trust_span = trust_span
        self.trusted_until = sent_at + trust_span
        self.error: LeaseLostError | None = None
        self.ended_at: float | None = None
        self.released = False  # the hold's release committed (set once its exit knows)
        self.handoff_requested = False
        self.lost_event = threading.Event()
        self.stop_event = threading.Event()
        self._on_lost = on_lost
        self._on_handoff = on_handoff
        self._lock = threading.Lock()
        self._definitive_loss = False
        self._cancel_hooks: list[Callable[[], None]] = []
        self.lease = HeldLease(grant, self, ttl=ttl, using=using)

    @property
    def gone(self) -> bool:
        """True when the server said the lease is not ours: there is nothing left to release."""
        return self._definitive_loss

    def trust_expired(self) -> bool:
        """The trust window has run out (judged at the end of the hold once it has ended)."""
        now = time.monotonic() if self.ended_at is None else self.ended_at
        return now >= self.trusted_until

    def trust_ended_error(self) -> LeaseLostError:
        """The error of a trust window that ran out with no renewal confirmed."""
        lease = self.lease
        return LapsedError(
            f"lease {lease.key!r} (epoch {lease.epoch}): no renewal was confirmed within the trust window "
            f"({self.trust_span:.3g}s after sending the last one that succeeded); it may have lapsed",
            key=lease.key,
            owner=lease.owner,
            epoch=lease.epoch,
        )

    def lose_trust(self) -> None:
        """Declare the lease lost because no renewal was confirmed within the trust window."""
        self.declare_lost(self.trust_ended_error(), definitive=False)

    def end(self) -> None:
        """The hold ends now: from here on the trust window is judged at this instant, and lost if it ran out."""
        if self.ended_at is not None:
            return  # a second call, after an interrupt cut the end of the hold short: the first instant counts
        self.ended_at = time.monotonic()
        if self.trust_expired() and self.error is None:
            self.lose_trust()

    def renewed(self, expires_at: datetime, sent_at: float) -> bool:
        """Record a successful renewal sent at ``sent_at``; False if it came too late to count."""
        with self._lock:
            if self.error is None and time.monotonic() < self.trusted_until:
                self.lease.expires_at = expires_at
                self.trusted_until = max(self.trusted_until, sent_at + self.trust_span)
                return True
        # check() may already have reported the end of the trust window: loss is final.
        self.lose_trust()
        return False

    def declare_lost(self, error: LeaseLostError, *, definitive: bool) -> None:
        """Mark the lease lost (once) and tell everyone: log, on_lost, lease_lost, cancel async jobs."""
        lease = self.lease
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            # A verdict from the server (not our own trust window): not ours to release any more.
            self._definitive_loss = definitive
            hooks = list(self._cancel_hooks)
        self.lost_event.set()
        self.stop_event.set()
        logger.warning(
            "lease %r lost (owner %r, epoch %s, %s): %s", lease.key, lease.owner, lease.epoch, error.code, error
        )
        if self._on_lost is not None:
            try:
                self._on_lost(lease)
            except Exception:
                logger.exception("on_lost callback for lease %r failed", lease.key)
        send_lease_signal(lease_lost, lease, error=_fresh(error))
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("cancelling the job of lease %r failed", lease.key)

    def handoff_requested_seen(self) -> None:
        """A renewal said someone asked this holder to step down: tell the job (once; every renewal
        after the request says so)."""
        lease = self.lease
        with self._lock:
            if self.handoff_requested:
                return
            self.handoff_requested = True
        self.stop_event.set()
        logger.info("lease %r: a hand-off was requested (owner %r, epoch %s)", lease.key, lease.owner, lease.epoch)
        if self._on_handoff is not None:
            try:
                self._on_handoff(lease)
            except Exception:
                logger.exception("on_handoff callback for lease %r failed", lease.key)
        send_lease_signal(lease_handoff_requested, lease)

    def add_cancel_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when the lease is lost (at once if it already is): an async hold cancels its task."""
        with self._lock:
            if self.error is None:
                self._cancel_hooks.append(hook)
                return
        hook()

    def remove_cancel_hook(self, hook: Callable[[], None]) -> None:
        """Forget ``hook`` (the async hold has ended)."""
        with self._lock:
            if hook in self._cancel_hooks:
                self._cancel_hooks.remove(hook)


class HeldLease:
    """A lease held by ``hold()`` or ``@leased``; ``with hold(...) as lease`` yields it.

    It is also a fence: ``obj.save(fence=lease)``. FencedModel writes with no fence inside the hold use
    it on their own.

    Attributes:
        key: the lease key.
        owner: the owner identity it is held under, unique per hold unless you passed ``owner``.
        epoch: the fencing token of this grant; renewals keep it.
        expires_at: the server's expiry after the last successful acquire or renewal.
        ttl: the TTL every renewal asks for.
        using: the database alias the lease is held in.
    """

    def __init__(self, grant: Grant, tenure: Tenure, *, ttl: timedelta, using: str = DEFAULT_DB_ALIAS):
        self.key: str = grant.key
        self.owner: str = grant.owner
        self.epoch: int = grant.epoch
        self.expires_at: datetime = grant.expires_at
        self.ttl = ttl
        self.using = using
        self._tenure = tenure  # read only: its heartbeat and its hold change it

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
        return self._tenure.error is not None or self._tenure.trust_expired()

    @property
    def released(self) -> bool:
        """True once the hold has ended and its release committed: the key is free now.

        False while held, and after an exit whose release did not commit (the database did not
        answer in time, the lease was already lost, or ``hold_at_least`` kept it): the lease then
        lapses at ``expires_at``, the server's expiry after the last renewal that succeeded.
        """
        return self._tenure.released

    @property
    def handoff_requested(self) -> bool:
        """True once a renewal learned that someone asked this holder to step down.

        Set by ``Lease.objects.request_handoff`` (the admin, ``manage.py leases handoff``), seen at
        the next renewal. Advice: the lease is still held and fenced writes still pass; finish or
        checkpoint the current step, then leave the hold so the next holder takes over at once.
        Never turns false again during this hold.
        """
        return self._tenure.handoff_requested

    @property
    def error(self) -> LeaseLostError | None:
        """Why the lease was lost (what `check` raises), or None."""
        tenure = self._tenure
        if tenure.error is not None:
            return _fresh(tenure.error)
        return tenure.trust_ended_error() if tenure.trust_expired() else None

    @property
    def trust_remaining(self) -> float:
        """Seconds the holder still trusts itself (0 once lost or ended)."""
        tenure = self._tenure
        if tenure.error is not None or tenure.ended_at is not None:
            return 0.0
        return max(0.0, tenure.trusted_until - time.monotonic())

    def check(self) -> None:
        """Raise unless the lease is still held and trusted. Call it between steps of the job.

        It costs no query: it reads what the heartbeat learned and the monotonic clock.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: the lease was lost. Either the server said so,
                or no renewal was confirmed within the trust window, which raises LapsedError. Stop acting.
            NotOwnerError: the hold has ended because the lease was released.
        """
        error = self.error
        if error is not None:
            raise error
        if self._tenure.ended_at is not None:
            raise NotOwnerError(
                f"the hold of lease {self.key!r} has ended", key=self.key, owner=self.owner, epoch=self.epoch
            )

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` seconds pass; True if it was lost.

        A leader-election loop can simply wait here. Returns at once after the hold has ended.
        """
        return self._wait(lambda: self.lost, self._tenure.lost_event, timeout)

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or a hand-off is requested, or ``timeout`` seconds pass.

        True if either happened (``lost`` and ``handoff_requested`` say which): a long-running
        leader's loop waits here between steps. Returns at once after the hold has ended.
        """
        return self._wait(lambda: self.lost or self._tenure.handoff_requested, self._tenure.stop_event, timeout)

    def _wait(self, done: Callable[[], bool], event: threading.Event, timeout: float | None) -> bool:
        """Wait until ``done()``, answering True, or until the end of the hold or ``timeout``, answering False.

        ``event`` wakes it. So does the end of the trust window by itself, a loss nobody has to announce.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if done():
                return True
            if self._tenure.ended_at is not None:
                return False
            now = time.monotonic()
            pause = self._tenure.trusted_until - now
            if deadline is not None:
                if now >= deadline:
                    return False
                pause = min(pause, deadline - now)
            event.wait(max(pause, 0.0))


def send_lease_signal(signal_: Any, lease: HeldLease, **kwargs: Any) -> None:
    """Send ``signal_`` about ``lease`` (sender `HeldLease`); a failing receiver is logged, not raised."""
    send_robust(signal_, HeldLease, lease=lease, **kwargs)


def send_robust(signal_: Any, sender: Any, **kwargs: Any) -> None:
    """``signal_.send_robust``, logging each receiver that failed."""
    for receiver, result in signal_.send_robust(sender=sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of a lease signal failed", receiver, exc_info=result)
