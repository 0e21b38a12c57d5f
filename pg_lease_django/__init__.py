"""Time-scoped leases with fencing tokens, stored in PostgreSQL, for Django.

The public API is re-exported here, and imported on first use through PEP 562. Importing a
submodule runs this module first, as ``pg_lease_django.patroni`` does during a failover, or
``pg_lease_django.sql``. This module imports nothing of the package itself, so each submodule
loads only what it uses. Django also imports this package before its app registry is ready, when
the models cannot be imported yet. Type checkers read the names from the imports under
``TYPE_CHECKING``; ``from pg_lease_django import hold`` works as it always did.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .election import Election, aelect, current_election, elect
    from .exceptions import (
        AlreadyFreeError,
        AlreadyLapsedError,
        EpochMismatchError,
        EpochMovedOnError,
        HeartbeatFailedError,
        InvalidInputError,
        LapsedError,
        LeaseError,
        LeaseLostError,
        LeaseTimeoutError,
        MissingRowError,
        NeverAcquiredError,
        NotAcquirableError,
        NotOwnerError,
        OperatorRefusalError,
        OutcomeUnknownError,
        QuotaExceededError,
        UnconfirmedCommitError,
        UnfencedWriteError,
    )
    from .fencing import Fence, FencedManager, FencedModel, FencedQuerySet, unfenced_writes
    from .holds.context import current_lease
    from .holds.holding import Holding, OnBusy, hold
    from .holds.jobs import RaisingDecorator, SkippingDecorator, exit_on_signals, leased
    from .holds.lease import HeldLease, OnLost
    from .managers import LeaseManager
    from .models import EndReason, Lease, LeaseTenure
    from .signals import lease_acquired, lease_handoff_requested, lease_lost, lease_released, lease_skipped
    from .sql.rows import EpochAdvance, Grant, HandoffRequest, LeaseState
    from .status import LeaseStatus
    from .validation import Seconds

__all__ = [
    "AlreadyFreeError",
    "AlreadyLapsedError",
    "Election",
    "EndReason",
    "EpochAdvance",
    "EpochMismatchError",
    "EpochMovedOnError",
    "Fence",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "Grant",
    "HandoffRequest",
    "HeartbeatFailedError",
    "HeldLease",
    "Holding",
    "InvalidInputError",
    "LapsedError",
    "Lease",
    "LeaseError",
    "LeaseLostError",
    "LeaseManager",
    "LeaseState",
    "LeaseStatus",
    "LeaseTenure",
    "LeaseTimeoutError",
    "MissingRowError",
    "NeverAcquiredError",
    "NotAcquirableError",
    "NotOwnerError",
    "OnBusy",
    "OnLost",
    "OperatorRefusalError",
    "OutcomeUnknownError",
    "QuotaExceededError",
    "RaisingDecorator",
    "Seconds",
    "SkippingDecorator",
    "UnconfirmedCommitError",
    "UnfencedWriteError",
    "aelect",
    "current_election",
    "current_lease",
    "elect",
    "exit_on_signals",
    "hold",
    "lease_acquired",
    "lease_handoff_requested",
    "lease_lost",
    "lease_released",
    "lease_skipped",
    "leased",
    "unfenced_writes",
]

#: Each public name -> the module it lives in, relative to this package.
_EXPORTS = {
    "AlreadyFreeError": "exceptions",
    "AlreadyLapsedError": "exceptions",
    "Election": "election",
    "EndReason": "models",
    "EpochAdvance": "sql.rows",
    "EpochMismatchError": "exceptions",
    "EpochMovedOnError": "exceptions",
    "Fence": "fencing",
    "FencedManager": "fencing",
    "FencedModel": "fencing",
    "FencedQuerySet": "fencing",
    "Grant": "sql.rows",
    "HandoffRequest": "sql.rows",
    "HeartbeatFailedError": "exceptions",
    "HeldLease": "holds.lease",
    "Holding": "holds.holding",
    "InvalidInputError": "exceptions",
    "LapsedError": "exceptions",
    "Lease": "models",
    "LeaseError": "exceptions",
    "LeaseLostError": "exceptions",
    "LeaseManager": "managers",
    "LeaseState": "sql.rows",
    "LeaseStatus": "status",
    "LeaseTenure": "models",
    "LeaseTimeoutError": "exceptions",
    "NeverAcquiredError": "exceptions",
    "NotAcquirableError": "exceptions",
    "NotOwnerError": "exceptions",
    "OnBusy": "holds.holding",
    "OnLost": "holds.lease",
    "OperatorRefusalError": "exceptions",
    "OutcomeUnknownError": "exceptions",
    "MissingRowError": "exceptions",
    "QuotaExceededError": "exceptions",
    "RaisingDecorator": "holds.jobs",
    "Seconds": "validation",
    "SkippingDecorator": "holds.jobs",
    "UnconfirmedCommitError": "exceptions",
    "UnfencedWriteError": "exceptions",
    "aelect": "election",
    "current_election": "election",
    "current_lease": "holds.context",
    "elect": "election",
    "exit_on_signals": "holds.jobs",
    "hold": "holds.holding",
    "lease_acquired": "signals",
    "lease_handoff_requested": "signals",
    "lease_lost": "signals",
    "lease_released": "signals",
    "lease_skipped": "signals",
    "leased": "holds.jobs",
    "unfenced_writes": "fencing",
}

if not TYPE_CHECKING:  # a type checker sees the imports above, and no catch-all attribute

    def __getattr__(name: str) -> Any:
        """A public name, imported from its module on first use and kept here after; ``__version__``."""
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError, version

            try:
                value = version("pg-lease-django")
            except PackageNotFoundError:  # running from a source tree that is not installed
                value = "0+unknown"
        elif name in _EXPORTS:
            value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
