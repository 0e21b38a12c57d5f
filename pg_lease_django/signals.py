"""Signals sent by ``hold()`` and ``@leased``. The sender is `HeldLease`, except for ``lease_skipped``.

Receivers are called with ``send_robust``: an exception in a receiver is logged (logger
``pg_lease_django.jobs``) and never breaks the hold, its heartbeat or its release.

``lease_acquired(sender, lease)``
    The hold got its lease and its heartbeat is running. Sent in the thread that entered the hold
    (for async code, a worker thread), before the job starts.

``lease_released(sender, lease, freed)``
    The hold ended without losing the lease. ``freed`` is True when the lease was released (the
    key is free now); False when it was left to lapse on its own: kept until ``hold_at_least``
    (``lease.expires_at`` says until when), or the release failed (it lapses at its expiry).
    Sent in the thread that left the hold.

``lease_lost(sender, lease, error)``
    The lease was lost while held: ``error`` is the `LeaseLostError`
    subclass ``lease.check()`` raises from now on. Sent once, right after ``on_lost``, from the
    heartbeat's worker thread (or, when a hold ends after its trust window ran out before the heartbeat
    noticed, from the thread leaving it). Not followed by ``lease_released``.

``lease_handoff_requested(sender, lease)``
    Someone asked the holder to step down (``Lease.objects.request_handoff``): sent once per hold,
    right after ``on_handoff``, from a thread of its own (a slow receiver delays no renewal).
    ``lease.handoff_requested`` is True from then on. The lease is still held.

``lease_skipped(sender, key, error)``
    ``@leased(on_busy="skip")`` (or ``"exit"``, just before it exits) did not run its function
    because the lease could not be had: ``sender`` is the decorated function, ``error`` the
    `NotAcquirableError` or `LeaseTimeoutError`.
    Also logged at WARNING (logger ``pg_lease_django.jobs``), which a default Django project shows.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["lease_acquired", "lease_handoff_requested", "lease_lost", "lease_released", "lease_skipped"]

lease_acquired = Signal()
lease_released = Signal()
lease_lost = Signal()
lease_skipped = Signal()
lease_handoff_requested = Signal()
