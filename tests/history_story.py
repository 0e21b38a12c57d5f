"""A lease's life with every kind of end, made by real operations, for the history tests.

Shared by ``test_history_display`` and ``test_history_browser`` (plain module, not a fixture file).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.test import override_settings

from pg_lease_django import Lease
from pg_lease_django.provisioning.history import sync_scope
from tests.helpers import wait_until

#: (owner, how the tenure ended, who ended it) of each tenure `tell` makes, in order; the last one is held.
STORY = [
    ("worker-a", "released", "worker-a"),
    ("worker-b", "lapsed", "worker-c"),
    ("worker-c", "force_released", "ops@console"),
    ("worker-a", "handed_off", "worker-a"),
    ("worker-b", "reacquired", "worker-b"),
    ("worker-b", "held", None),
]


@contextmanager
def recording(using: str = "default") -> Iterator[None]:
    """Record the tenures of every key (``PG_LEASE_HISTORY = [""]``), and nothing again afterwards.

    The scope lives in the database; resetting it matters for transactional tests, whose writes stay.
    """
    with override_settings(PG_LEASE_HISTORY=[""]):
        sync_scope(using)
        try:
            yield
        finally:
            with override_settings(PG_LEASE_HISTORY=[]):
                sync_scope(using)


def tell(key: str) -> list[int]:
    """Make `STORY` happen to ``key`` (history must be recording); the epochs of its tenures."""
    epochs = []
    grant = Lease.objects.acquire(key, "worker-a", ttl=30)
    assert grant is not None
    Lease.objects.release(key, "worker-a", grant.epoch)
    epochs.append(grant.epoch)

    grant = Lease.objects.acquire(key, "worker-b", ttl=0.2)
    assert grant is not None
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")
    epochs.append(grant.epoch)

    grant = Lease.objects.acquire(key, "worker-c", ttl=30)
    assert grant is not None
    Lease.objects.force_release(key, epoch=grant.epoch, operator="ops@console")
    epochs.append(grant.epoch)

    grant = Lease.objects.acquire(key, "worker-a", ttl=30)
    assert grant is not None
    Lease.objects.request_handoff(key, epoch=grant.epoch)
    Lease.objects.release(key, "worker-a", grant.epoch)
    epochs.append(grant.epoch)

    grant = Lease.objects.acquire(key, "worker-b", ttl=30)
    assert grant is not None
    epochs.append(grant.epoch)
    # Again, while holding: a new epoch. Held for an hour: a page read a loaded minute later still
    # shows it held, not a second lapse.
    grant = Lease.objects.acquire(key, "worker-b", ttl=3600)
    assert grant is not None
    epochs.append(grant.epoch)
    return epochs
