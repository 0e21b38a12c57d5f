"""The holds active in this thread or task, and `current_lease`. A leaf: it imports nothing of the package.

`pg_lease_django.holds.holding` pushes and pops the leases through `active`. Two readers use them
without loading the machinery of a hold: ``current_lease()``, and FencedModel writes with no fence,
through `pg_lease_django.fencing.resolution`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lease import HeldLease

#: The holds active in this thread / task, outermost first (set only by `pg_lease_django.holds.holding`).
active: ContextVar[tuple[HeldLease, ...]] = ContextVar("pg_lease_active_holds", default=())


def current_lease(key: str | None = None) -> HeldLease | None:
    """The innermost active ``hold()``/``@leased`` lease in this thread or task, or None.

    Args:
        key: only a lease with this key (the innermost one, if holds of several keys are nested).
    """
    for lease in reversed(active.get()):
        if key is None or lease.key == key:
            return lease
    return None
