"""A lease's history read for people: its tenures as rows, each end worked out on the server clock.

`read_history` reads the recorded tenures of one key (`LeaseTenure`) and works out the end of the one still
open against the lease row, in one statement on the server clock: held until its expiry, or
lapsed at it. ``manage.py leases history`` prints those rows and the admin draws them with
`pg_lease_django.timeline.chart.draw_timeline`, so both tell the same story.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, router
from django.db.models import Case, Count, F, OuterRef, Q, Subquery, When, Window

from pg_lease_django.display import format_duration
from pg_lease_django.models import EndReason, Lease, LeaseTenure
from pg_lease_django.querysets import ServerNow, StatusAt
from pg_lease_django.sql import run, statements
from pg_lease_django.status import LeaseStatus

__all__ = ["History", "TenureRow", "read_history"]

#: Outcomes beyond `EndReason`: the current grant, still held; and an open tenure the lease row does
#: not account for (its end was not recorded: history was switched off meanwhile, or a failover).
HELD = "held"
UNKNOWN = "unknown"

#: Ends an operator or the database imposed on the holder: drawn with a red or purple mark.
FORCED = frozenset({EndReason.FORCE_RELEASED, EndReason.EPOCHS_ADVANCED})

_OUTCOME_TEXT = {
    EndReason.RELEASED: "released",
    EndReason.HANDED_OFF: "handed off",
    EndReason.LAPSED: "lapsed",
    EndReason.REACQUIRED: "re-acquired",
    EndReason.FORCE_RELEASED: "force-released",
    EndReason.EPOCHS_ADVANCED: "epochs advanced",
    HELD: "held",
    UNKNOWN: "end not recorded",
}


@dataclass(frozen=True)
class TenureRow:
    """One tenure as people see it, its end worked out on the server clock.

    Attributes:
        epoch: the epoch of the grant.
        owner: who held it.
        granted_at: when it was granted.
        ended_at: when it ended: as recorded, or the expiry of a lapsed grant nobody took over yet.
            None while it is held, and when its end was not recorded.
        outcome: an `EndReason` value, ``"held"`` for the current grant, or ``"unknown"``.
        ended_by: who ended it, as `LeaseTenure` says; None when nobody did yet.
        expires_at: the expiry of the current grant, held or lapsed and not yet taken over; else None.
        handoff_requested_at: when a hand-off was requested of the current holder; else None.
        ended_by_role: the database role that sent the statement ending it; None while it lasts.
    """

    epoch: int
    owner: str
    granted_at: datetime
    ended_at: datetime | None
    outcome: str
    ended_by: str | None
    expires_at: datetime | None = None
    handoff_requested_at: datetime | None = None
    ended_by_role: str | None = None

    @property
    def current(self) -> bool:
        """Whether this is the lease's latest grant (held, or lapsed and not yet taken over)."""
        return self.expires_at is not None

    @property
    def forced(self) -> bool:
        """Whether an operator or an epoch advance ended it."""
        return self.outcome in FORCED

    @property
    def outcome_text(self) -> str:
        """How it ended, in words: ``released``, ``force-released``, ``held``..."""
        return _OUTCOME_TEXT.get(self.outcome, self.outcome)

    def duration(self, server_time: datetime) -> timedelta:
        """How long it lasted (so far, at ``server_time``, while held)."""
        return (self.ended_at or server_time) - self.granted_at

    def describe(self, server_time: datetime) -> str:
        """The outcome for a table cell: ``force-released``, ``held, expires in 29s``, ``lapsed (free to take)``."""
        if self.outcome == HELD and self.expires_at is not None:
            text = f"held, expires in {format_duration(max(self.expires_at - server_time, timedelta(0)))}"
            return text + (", hand-off requested" if self.handoff_requested_at else "")
        if self.outcome == EndReason.LAPSED and self.current:
            return "lapsed (free to take)"
        return self.outcome_text

    def as_json(self, server_time: datetime) -> dict[str, Any]:
        """The stable JSON form: these field names, ISO 8601 times in UTC, ``duration_seconds`` a float."""
        return {
            "epoch": self.epoch,
            "owner": self.owner,
            "granted_at": _iso(self.granted_at),
            "ended_at": _iso(self.ended_at),
            "outcome": self.outcome,
            "ended_by": self.ended_by,
            "ended_by_role": self.ended_by_role,
            "expires_at": _iso(self.expires_at),
            "handoff_requested_at": _iso(self.handoff_requested_at),
            "duration_seconds": self.duration(server_time).total_seconds(),
        }


@dataclass(frozen=True)
class History:
    """The recorded tenures of one key, oldest first, as `read_history` found them.

    Attributes:
        key: the lease key.
        tenures: the newest tenures (all of them, or the ``limit`` asked for), oldest first.
        count: how many tenures of the key are recorded in all.
        server_time: the server clock the open tenure was judged at.
    """

    key: str
    tenures: list[TenureRow]
    count: int
    server_time: datetime

    def as_json(self) -> dict[str, Any]:
        """The stable JSON form (``manage.py leases history --json``)."""
        return {
            "key": self.key,
            "server_time": _iso(self.server_time),
            "count": self.count,
            "tenures": [row.as_json(self.server_time) for row in self.tenures],
        }


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def read_history(key: str, *, using: str | None = None, limit: int | None = None) -> History:
    """The tenures of ``key``, the newest ``limit`` of them, oldest first, in one statement.

    The open tenure is judged against the lease row in that same statement, on the server clock,
    so it never disagrees with the state. It is held, ending at its expiry, still to come. Or it
    lapsed, and ended at its expiry. Or the row is at another grant, and it is ``unknown``.

    Args:
        key: the lease key.
        using: the database alias; default where the router sends reads of tenures.
        limit: at most this many tenures, the newest; None for all.
    """
    alias = using or router.db_for_read(LeaseTenure)
    lease = Lease.objects.using(alias).filter(key=OuterRef("key"))
    is_open = Q(ended_at__isnull=True)

    def of_lease(field: str) -> Case:
        # Only the open tenure needs the lease row: the CASE keeps the sub-select off the others.
        return Case(When(is_open, then=Subquery(lease.values(field)[:1])), default=None)

    tenures = (
        LeaseTenure.objects.using(alias)
        .filter(key=key)
        .annotate(
            server_time=ServerNow(),
            total=Window(Count("*")),
            lease_epoch=of_lease("epoch"),
            lease_owner=of_lease("owner"),
            lease_expires_at=of_lease("expires_at"),
            lease_handoff_at=of_lease("handoff_requested_at"),
            lease_state=Case(
                When(is_open, then=StatusAt(F("lease_owner"), F("lease_expires_at"), ServerNow())), default=None
            ),
        )
        .order_by("-epoch", "-granted_at", "-id")
    )
    found = list(tenures if limit is None else tenures[:limit])
    if not found:
        return History(key, [], 0, _server_now(alias))
    rows = [_with_its_end(tenure) for tenure in reversed(found)]
    first: Any = found[0]
    return History(key, rows, first.total, first.server_time)


def _with_its_end(tenure: Any) -> TenureRow:
    """A tenure row with its end: recorded, or read from the lease row when still open."""
    row = TenureRow(
        tenure.epoch,
        tenure.owner,
        tenure.granted_at,
        tenure.ended_at,
        tenure.end_reason or UNKNOWN,
        tenure.ended_by,
        ended_by_role=tenure.ended_by_role,
    )
    if tenure.ended_at is not None:
        return row
    if (tenure.lease_epoch, tenure.lease_owner) != (tenure.epoch, tenure.owner):
        return row  # the lease row is at another grant: this end was never recorded
    expires_at = tenure.lease_expires_at
    if tenure.lease_state == LeaseStatus.HELD:
        return TenureRow(row.epoch, row.owner, row.granted_at, None, HELD, None, expires_at, tenure.lease_handoff_at)
    return TenureRow(row.epoch, row.owner, row.granted_at, expires_at, EndReason.LAPSED, None, expires_at)


def _server_now(alias: str) -> datetime:
    moment: datetime = run.one(connections[alias], statements.SERVER_NOW)
    return moment
