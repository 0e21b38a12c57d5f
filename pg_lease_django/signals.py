"""Signals sent by ``hold()`` and ``@leased``. The sender is `HeldLease`, except for ``lease_skipped``.

Receivers are called with ``send_robust``. An exception in a receiver is logged to the logger
``pg_lease_django.jobs`` and never breaks the hold, its heartbeat or its release.

``lease_acquired(sender, lease)``
    The hold got its lease and its heartbeat is running. Sent before the job starts, in the thread
    that entered the hold; for async code, that is a worker thread.

``lease_released(sender, lease, freed)``
    The hold ended without losing the lease. ``freed`` is True when the lease was released, so the
    key is free now. It is False when the lease was left to lapse on its own. Either the hold kept
    it until ``hold_at_least``, and ``lease.expires_at`` says until when, or the release failed and
    it lapses at its expiry. Sent in the thread that left the hold.

``lease_lost(sender, lease, error)``
    The lease was lost while held: ``error`` is the `LeaseLostError` subclass ``lease.check()``
    raises from now on. Sent once, right after ``on_lost``, from the heartbeat's worker thread. A
    hold can end after its trust window ran out but before the heartbeat noticed; then it is sent
    from the thread leaving the hold. Not followed by ``lease_released``.

``lease_handoff_requested(sender, lease)``
    Someone asked the holder to step down with ``Lease.objects.request_handoff``. Sent once per
    hold, right after ``on_handoff``, from a thread of its own, so a slow receiver delays no
    renewal. ``lease.handoff_requested`` is True from then on. The lease is still held.

``lease_skipped(sender, key, error)``
    ``@leased(on_busy="skip")`` did not run its function because the lease could not be had;
    ``"exit"`` sends it too, just before it exits. ``sender`` is the decorated function, ``error``
    the `NotAcquirableError` or `LeaseTimeoutError`. It is also logged at WARNING to the logger
    ``pg_lease_django.jobs``, which a default Django project shows.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["lease_acquired", "lease_handoff_requested", "lease_lost", "lease_released", "lease_skipped"]

lease_acquired = Signal()
lease_released = Signal()
lease_lost = Signal()
lease_skipped = Signal()
lease_handoff_requested = Signal()
