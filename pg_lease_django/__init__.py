"""Time-scoped leases with fencing tokens, stored in PostgreSQL, for Django.

The public API is re-exported here. Model classes are loaded lazily (PEP 562) because Django
imports this package before its app registry is ready.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .election import Election, aelect, current_election, elect
from .exceptions import (
    AlreadyFreeError,
    EpochMismatchError,
    HeartbeatFailedError,
    InvalidInputError,
    LapsedError,
    LeaseError,
    LeaseLostError,
    LeaseTimeoutError,
    NeverAcquiredError,
    NotAcquirableError,
    NotOwnerError,
    QuotaExceededError,
    UnconfirmedCommitError,
    UnfencedWriteError,
)
from .holds.context import current_lease
from .holds.holding import Holding, hold
from .holds.jobs import exit_on_signals, leased
from .holds.lease import HeldLease
from .managers import Grant, LeaseManager, LeaseState
from .operations import HandoffRequest
from .signals import lease_acquired, lease_handoff_requested, lease_lost, lease_released, lease_skipped

if TYPE_CHECKING:
    from .fencing import FencedManager, FencedModel, FencedQuerySet, unfenced_writes
    from .models import EndReason, Lease, LeaseTenure

try:
    __version__ = version("pg-lease-django")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AlreadyFreeError",
    "Election",
    "EndReason",
    "EpochMismatchError",
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
    "LeaseTenure",
    "LeaseTimeoutError",
    "NeverAcquiredError",
    "NotAcquirableError",
    "NotOwnerError",
    "QuotaExceededError",
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

_LAZY_MODELS = {
    "FencedManager": "fencing",
    "FencedModel": "fencing",
    "FencedQuerySet": "fencing",
    "EndReason": "models",
    "Lease": "models",
    "LeaseTenure": "models",
    "unfenced_writes": "fencing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODELS:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY_MODELS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
