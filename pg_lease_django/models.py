"""The lease table: one row per key; a row is deleted only by a prune that raises the epoch floor."""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.db.models import F, Func, IntegerField, Q, Value
from django.db.models.lookups import Range

from . import conf
from .display import printable
from .managers import LeaseManager
from .querysets import LeaseQuerySet, ServerNow
from .validation import MAX_NAME_BYTES, MAX_PRUNE_AGE, to_timedelta


def _octet_length(field: str) -> Func:
    return Func(F(field), function="octet_length", output_field=IntegerField())


class Lease(models.Model):
    """A time-scoped lease on a named resource, with its fencing epoch.

    `Lease.objects` is a `LeaseManager`: use it to acquire, renew, release and inspect. Its
    `LeaseQuerySet` methods list leases with their state, as ``Lease.objects.with_state()`` does.
    Rows are written only by the SQL functions the migrations install. Never edit them by hand:
    an epoch that goes backwards un-fences stale holders.

    Columns:

    - ``key``: the primary key.
    - ``owner``: None when free.
    - ``epoch``: the fencing token, which never decreases.
    - ``acquired_at`` and ``expires_at``: on the server clock; None when free.
    - ``released_at``: when it was last released; None while held.

    A row whose ``expires_at`` has passed is *lapsed*, evaluated lazily on access. Rows of leases
    free for long enough may be pruned with `LeaseManager.prune`. The epoch floor keeps a key that
    comes back above its past epochs.
    """

    key = models.TextField(primary_key=True)
    owner = models.TextField(null=True, blank=True)  # noqa: DJ001  (NULL means free; "" is not an owner)
    epoch = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    #: When someone asked the holder to step down (`LeaseManager.request_handoff`); None when nobody
    #: did since the grant. Advice only: the holder's renewals learn it, the grant is unchanged.
    handoff_requested_at = models.DateTimeField(null=True, blank=True)
    #: Whether the database records this key's history (``PG_LEASE_HISTORY``): kept by the database,
    #: which refuses any other value, so its history triggers decide without a lookup.
    recorded = models.BooleanField(db_default=False, editable=False)

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
        # For people (the admin's titles and breadcrumbs, its log): the key escaped, never obeyed.
        return printable(self.key)


class EndReason(models.TextChoices):
    """How a tenure ended (`LeaseTenure.end_reason`)."""

    RELEASED = "released", "released by its holder"
    HANDED_OFF = "handed_off", "handed off (released after a hand-off request)"
    LAPSED = "lapsed", "lapsed (then taken over, or pruned)"
    REACQUIRED = "reacquired", "re-acquired by its holder under a new epoch"
    FORCE_RELEASED = "force_released", "force-released by an operator"
    EPOCHS_ADVANCED = "epochs_advanced", "fenced by an epoch advance"


class TenureQuerySet(models.QuerySet["LeaseTenure"]):
    def for_key(self, key: str) -> TenureQuerySet:
        """The tenures of ``key``, oldest first."""
        return self.filter(key=key).order_by("epoch")

    def prune(self, *, older_than: float | timedelta | None = None, dry_run: bool = False) -> int:
        """Delete the tenures that ended more than ``older_than`` ago, and return how many.

        The age is measured on the server clock; ``older_than`` defaults to
        ``PG_LEASE_HISTORY_RETENTION``. With ``dry_run`` nothing is deleted, and the count is of
        the tenures that would be. A tenure still running, whose ``ended_at`` is None, is never
        deleted.

        Raises:
            InvalidInputError: ``older_than`` is not seconds or a timedelta from 0 to 3,650 days.
        """
        if older_than is None:
            older_than = conf.history_retention()
        age = to_timedelta("older_than", older_than, minimum=timedelta(0), maximum=MAX_PRUNE_AGE)
        doomed = self.filter(ended_at__lt=ServerNow() - Value(age, output_field=models.DurationField()))
        if dry_run:
            return doomed.count()
        deleted, _ = doomed.delete()
        return deleted


class LeaseTenure(models.Model):
    """One tenure of a lease: a grant, from the statement that made it to the one that ended it.

    Only the database writes it, never per renewal. Triggers on the lease table write it in the
    statement of each transition, for the keys ``PG_LEASE_HISTORY`` names. ``ended_at`` is None
    while the tenure lasts. It stays None after the lease lapsed, until someone takes the key over
    or the row is pruned; the lease row says whether it is lapsed. Delete old rows with
    ``manage.py leases prune-history``.

    Columns:

    - ``key``, ``owner``, ``granted_at``, ``ended_at``.
    - ``epoch``: the grant's epoch.
    - ``end_reason``: an `EndReason`.
    - ``ended_by``: who ended it. Released, handed off or re-acquired: the holder. Lapsed: the
      owner that took the key over, or None when the row was pruned. Force-released: the operator
      as passed to ``force_release(operator=...)``, else the database role. Epochs advanced: the
      database role that advanced them.
    - ``ended_by_role``: the database role, ``session_user``, that sent the statement ending it,
      whatever owner name it presented.
    """

    key = models.TextField()
    epoch = models.BigIntegerField()
    owner = models.TextField()
    granted_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.TextField(choices=EndReason.choices, null=True, blank=True)  # noqa: DJ001
    ended_by = models.TextField(null=True, blank=True)  # noqa: DJ001
    ended_by_role = models.TextField(null=True, blank=True)  # noqa: DJ001

    objects = TenureQuerySet.as_manager()

    class Meta:
        db_table = "pg_lease_django_tenure"
        ordering = ["key", "epoch"]
        # Not unique: a history must never refuse a grant (an epoch may repeat after an asynchronous failover).
        indexes = [models.Index(fields=["key", "epoch"], name="pg_lease_tenure_key_epoch")]

    def __str__(self) -> str:
        return printable(f"{self.key} #{self.epoch} ({self.owner})")
