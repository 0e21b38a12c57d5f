"""One hold from enter to exit: its options, checked once, and its session.

`HoldSession.start` acquires the lease on a lease connection, never the job's. It starts the
heartbeat that renews the lease and sends ``lease_acquired``. `HoldSession.finish` stops the
heartbeat, releases the lease or keeps it until ``hold_at_least``, and sends ``lease_released``.
Each copes with an interrupt at any point, such as a signal or a cancelled task, and ``finish()``
called again completes what an interrupt left. `pg_lease_django.holds.holding.Holding` runs a
session per ``with`` block, sync or async.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

from django.db import router

from pg_lease_django import conf
from pg_lease_django.exceptions import InvalidInputError, NotAcquirableError
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.operations import Grant
from pg_lease_django.owners import default_owner
from pg_lease_django.signals import lease_acquired, lease_released
from pg_lease_django.validation import (
    MAX_TTL,
    MIN_TTL,
    Seconds,
    check_name,
    check_ttl,
    check_wait,
    to_timedelta,
)

from .context import current_lease
from .heartbeat import Heartbeat
from .lease import HeldLease, OnLost, Tenure, send_lease_signal
from .lease_connection import InFlight
from .lease_pool import pool_for

# The documented logger of holds (docs/jobs.md), wherever their code lives.
logger = logging.getLogger("pg_lease_django.jobs")


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


class HoldSession:
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
                current_epoch=enclosing.epoch,
            )
        pool = pool_for(alias, io_timeout=interval)
        grant: Grant | None = None
        heartbeat: Heartbeat | None = None
        try:
            with metrics.acquiring(self.key) as measured:
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
        """Stop renewing; release, or keep the lease until ``hold_at_least``, on a pooled lease connection.

        When an interrupt cut it short, `Holding.__exit__` calls it again, and it completes what is left.
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
                heartbeat.tenure.released = heartbeat.outcome == "freed"
                if not lease.lost:
                    logger.debug("ended the hold of lease %r (%s)", lease.key, heartbeat.outcome)
                    send_lease_signal(lease_released, lease, freed=heartbeat.outcome == "freed")
