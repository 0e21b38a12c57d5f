"""The lease history of a run, checked one to one against the harness's own record of grants.

The database records a tenure (``pg_lease_django_tenure``) in the statement of each grant and end
(migration 0009). Against the client history (:class:`~stress.checker.Op`):

* every acknowledged grant (``acquire`` ``ok``) is exactly one tenure, same key, epoch and owner;
* every tenure is a grant the client was told of, or one whose outcome it could not learn
  (``acquire`` ``unknown``, by that owner on that key); never one nobody asked for;
* no key has two tenures at one epoch;
* a tenure recorded as released by its holder matches a release of that grant that was
  acknowledged or unknown; one acknowledged released is recorded as released (or handed off);
* a tenure ended after a lapse ended at or before the grant that followed it.

Independent of Django, like the checker: it reads plain rows.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stress.checker import Op

#: The statement reading a run's tenures (``psycopg`` rows in :class:`TenureRow` order).
READ_TENURES = (
    "SELECT key, epoch, owner, extract(epoch FROM granted_at)::float8, extract(epoch FROM ended_at)::float8, "
    "end_reason, ended_by FROM pg_lease_django_tenure ORDER BY key, epoch"
)
#: What makes a run's database record every key (run after migrate, before the workers start).
RECORD_EVERY_KEY = "INSERT INTO pg_lease_django_history_scope (prefix) VALUES ('') ON CONFLICT DO NOTHING"


@dataclass(frozen=True)
class TenureRow:
    key: str
    epoch: int
    owner: str
    granted_at: float
    ended_at: float | None
    end_reason: str | None
    ended_by: str | None


def check_tenures(ops: Sequence[Op], tenures: Sequence[TenureRow]) -> list[dict[str, Any]]:
    """The violations of the one-to-one rules above (empty: the history matches the client record)."""
    violations: list[dict[str, Any]] = []

    def violation(kind: str, **details: Any) -> None:
        violations.append({"kind": kind, **details})

    acknowledged: dict[tuple[str, int | None], str] = {
        (op.key, op.epoch): op.worker for op in ops if op.op == "acquire" and op.outcome == "ok"
    }
    maybe = {(op.key, op.worker) for op in ops if op.op == "acquire" and op.outcome == "unknown"}
    released = {(op.key, op.epoch) for op in ops if op.op == "release" and op.outcome == "ok"}
    maybe_released = {(op.key, op.epoch) for op in ops if op.op == "release" and op.outcome == "unknown"}

    per_grant = Counter((row.key, row.epoch) for row in tenures)
    for (key, epoch), count in per_grant.items():
        if count > 1:
            violation("tenure_twice", key=key, epoch=epoch, count=count)
    recorded = {(row.key, row.epoch): row for row in tenures}
    for (key, granted), worker in acknowledged.items():
        row = recorded.get((key, granted or 0))
        if row is None:
            violation("grant_not_recorded", key=key, epoch=granted, owner=worker)
        elif row.owner != worker:
            violation("tenure_owner", key=key, epoch=granted, owner=worker, recorded=row.owner)
    for row in tenures:
        told = acknowledged.get((row.key, row.epoch))
        if told is None and (row.key, row.owner) not in maybe:
            violation("tenure_never_granted", key=row.key, epoch=row.epoch, owner=row.owner)
        if row.end_reason == "released" and (row.key, row.epoch) not in released | maybe_released:
            violation("released_without_release", key=row.key, epoch=row.epoch, owner=row.owner)
    for key, let_go in released:
        row = recorded.get((key, let_go or 0))
        if row is not None and row.end_reason not in ("released", "handed_off"):
            violation("release_recorded_as", key=key, epoch=let_go, recorded=row.end_reason)

    by_key: dict[str, list[TenureRow]] = defaultdict(list)
    for row in tenures:
        by_key[row.key].append(row)
    for rows in by_key.values():
        rows.sort(key=lambda r: r.epoch)
        for before, after in itertools.pairwise(rows):
            if before.ended_at is None:
                violation("tenure_left_open", key=before.key, epoch=before.epoch, next_epoch=after.epoch)
            elif before.end_reason == "lapsed" and before.ended_at > after.granted_at + 1e-6:
                violation("lapse_after_next_grant", key=before.key, epoch=before.epoch, next_epoch=after.epoch)
    return violations
