"""The lease table: one row per key; a row is deleted only by a prune that raises the epoch floor."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Func, IntegerField, Q
from django.db.models.lookups import Range

from .managers import LeaseManager
from .querysets import LeaseQuerySet
from .validation import MAX_NAME_BYTES


def _octet_length(field: str) -> Func:
    return Func(F(field), function="octet_length", output_field=IntegerField())


class Lease(models.Model):
    """A time-scoped lease on a named resource, with its fencing epoch.

    Use `Lease.objects` (a `LeaseManager`) to acquire, renew, release and inspect, and its
    `LeaseQuerySet` methods to list leases with their state (``Lease.objects.with_state()``).
    Rows are written only by the SQL functions the migrations install; never edit them by hand:
    an epoch that goes backwards un-fences stale holders.

    Columns: ``key`` (primary key), ``owner`` (None when free), ``epoch`` (fencing token, never
    decreases), ``acquired_at`` and ``expires_at`` (server clock; None when free), ``released_at``
    (when it was last released; None while held). A row whose ``expires_at`` has passed is
    *lapsed*, evaluated lazily on access. Rows of leases free for long enough may be pruned
    (`LeaseManager.prune`); the epoch floor keeps a key that comes back above its past epochs.
    """

    key = models.TextField(primary_key=True)
    owner = models.TextField(null=True, blank=True)  # noqa: DJ001  (NULL means free; "" is not an owner)
    epoch = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)

    # A LeaseManager (acquire, renew, release, ...) that has LeaseQuerySet's reads (with_state(), ...) too.
    objects = LeaseManager.from_queryset(LeaseQuerySet)()

    class Meta:
        db_table = "pg_lease_django_lease"
        ordering = ["key"]
        permissions = [("force_release_lease", "Can force-release a lease")]
        # No index on owner, epoch or expires_at: renewals must stay HOT updates.
        constraints = [
            models.CheckConstraint(
                condition=Range(_octet_length("key"), (1, MAX_NAME_BYTES)), name="pg_lease_key_length"
            ),
            models.CheckConstraint(
                condition=Q(owner__isnull=True) | Q(Range(_octet_length("owner"), (1, MAX_NAME_BYTES))),
                name="pg_lease_owner_length",
            ),
            models.CheckConstraint(condition=Q(epoch__gte=0), name="pg_lease_epoch_non_negative"),
            models.CheckConstraint(
                condition=Q(owner__isnull=True, expires_at__isnull=True, acquired_at__isnull=True)
                | Q(owner__isnull=False, expires_at__isnull=False, acquired_at__isnull=False),
                name="pg_lease_held_fields_together",
            ),
        ]

    def __str__(self) -> str:
        return self.key
