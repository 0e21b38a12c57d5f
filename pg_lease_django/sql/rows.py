"""The rows of the lease statements, typed: what each answer means.

Each decoder takes a statement's row and, as keywords, the parameters it was sent, naming those it
reads. ``sql.statements`` pairs each decoder with its statement. Decoders only decode: a verdict
that is an error never reaches them, because the executor raises it first from the statement's
verdict map in ``sql.errors``. `Grant`, `LeaseState` and `EpochAdvance` are public, re-exported by
``pg_lease_django`` and ``pg_lease_django.managers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple, TypeVar

#: A row as the driver returns it.
Row = Sequence[Any]
R = TypeVar("R")


@dataclass(frozen=True)
class Grant:
    """A successful acquire.

    Attributes:
        key: the lease key.
        owner: the owner identity it was granted to.
        epoch: the fencing token; present it to renew, release and guarded writes.
        expires_at: server time at which the lease lapses unless renewed.
        server_time: the server clock at the grant (``expires_at - server_time`` is the TTL).
    """

    key: str
    owner: str
    epoch: int
    expires_at: datetime
    server_time: datetime


@dataclass(frozen=True)
class LeaseState:
    """What `LeaseManager.inspect` saw, computed from the server clock.

    Attributes:
        key: the lease key.
        status: ``"free"``, ``"held"`` or ``"lapsed"``, a `LeaseStatus` value. Lapsed means expired and not
            yet taken over.
        owner: the holder; the former holder when lapsed; None when free.
        epoch: the current epoch, 0 for a key never acquired.
        expires_at: expiry of the current or lapsed grant; None when free.
        server_time: the server clock when the state was read.
    """

    key: str
    status: Literal["free", "held", "lapsed"]
    owner: str | None
    epoch: int
    expires_at: datetime | None
    server_time: datetime

    @property
    def held(self) -> bool:
        """True when someone holds the lease at ``server_time``."""
        return self.status == "held"  # LeaseStatus.HELD, a str: not imported, for the ORM it needs


class Attempt(NamedTuple):
    """A ``pg_lease_acquire`` row: granted, or refused naming who holds the key and until when."""

    granted: bool
    key: str
    owner: str | None  # the grantee; when refused, the holder (None: free, but a lock it needs was busy)
    epoch: int  # the grant's epoch; when refused, the holder's
    expires_at: datetime  # the grant's expiry; when refused, the holder's
    server_time: datetime

    def grant(self, key: str) -> Grant | None:
        """The `Grant` of ``key`` this attempt obtained, or None when refused."""
        if not self.granted or self.owner is None:
            return None
        return Grant(key, self.owner, self.epoch, self.expires_at, self.server_time)


@dataclass(frozen=True)
class EpochAdvance:
    """What `LeaseManager.advance_epochs` did, or would do on a dry run.

    Attributes:
        by: how much every epoch and the epoch floor went up.
        leases: the lease rows advanced.
        held: of those, the ones held then. Their holders are fenced with ``epoch_mismatch`` and must
            re-acquire.
        epoch_floor: the new epoch floor: a key without a row starts above it.
        max_epoch: the new highest epoch, or the floor when there are no rows.
        server_time: the server clock when it was done.
        dry_run: nothing was changed.
    """

    by: int
    leases: int
    held: int
    epoch_floor: int
    max_epoch: int
    server_time: datetime
    dry_run: bool


class Renewal(NamedTuple):
    """A renewal that succeeded: the new expiry, and whether someone asked the holder to step down."""

    expires_at: datetime
    handoff_requested: bool


@dataclass(frozen=True)
class HandoffRequest:
    """A hand-off request recorded on a held lease by `LeaseManager.request_handoff`.

    Attributes:
        key: the lease key.
        owner: the holder asked to step down.
        epoch: its epoch.
        expires_at: its expiry when asked.
        requested_at: when the hand-off was first requested during this grant, by the server clock.
        server_time: the server clock when this request was made.
    """

    key: str
    owner: str
    epoch: int
    expires_at: datetime
    requested_at: datetime
    server_time: datetime


def attempt(row: Row, **_: Any) -> Attempt:
    """An acquire's row (``pg_lease_acquire``, ``pg_lease_acquire_within``, ``pg_lease_acquire_or_register``)."""
    return Attempt(*row)


def state(row: Row, **_: Any) -> LeaseState:
    """An inspect's row: ``pg_lease_inspect`` answers the key it was sent."""
    return LeaseState(*row)


def renewal(row: Row, **_: Any) -> Renewal:
    """A renewal's row whose verdict is ``ok``: the executor raised any other (``sql.errors``)."""
    _outcome, expires_at, handoff_requested = row
    return Renewal(expires_at, bool(handoff_requested))


def released(row: Row, **_: Any) -> None:
    """A release's row whose verdict is ``ok``: it answers nothing more."""


def forced(row: Row, **_: Any) -> int:
    """A force release's row whose verdict is ``ok``: the new epoch."""
    return int(row[2])


def handoff(row: Row, *, key: str, **_: Any) -> HandoffRequest:
    """A hand-off request's row whose verdict is ``ok``: the request recorded on ``key``."""
    _outcome, holder, current_epoch, expires_at, requested_at, server_time = row
    return HandoffRequest(key, holder, current_epoch, expires_at, requested_at, server_time)


def epoch_advance(row: Row, *, by: int, dry_run: bool) -> EpochAdvance:
    """An epoch advance's row (``by`` and ``dry_run`` as sent)."""
    leases, held, epoch_floor, max_epoch, server_time = row
    return EpochAdvance(by, leases, held, epoch_floor, max_epoch, server_time, dry_run)


def scalar(row: Row, **_: Any) -> Any:
    """The first column."""
    return row[0]


# ---- the operators' reads: probes, metrics, the catalog, the Patroni hook -------------------------
# Each a NamedTuple of its statement's columns in order, read by `shaped`.


class Readiness(NamedTuple):
    """What the readiness probe asks the database (``readiness``)."""

    worker: bool  # may run every function a worker needs
    scope: list[str] | None  # the key prefixes it may use: None, every key; empty, none
    monitor: bool  # may read the metrics


class LeaseCount(NamedTuple):
    """A row of the database's view for Prometheus (``pg_lease_metrics``), labelled by its rule."""

    kind: str  # "lease", "waiter" or "tenure"
    label: str
    state: str  # a lease's `LeaseStatus`, a tenure's end reason
    total: float  # the column ``count``: a NamedTuple's field may not shadow tuple.count
    oldest_lapse: float | None  # seconds since the oldest lapse of a lapsed lease


class MetricsRule(NamedTuple):
    """The metrics' label rule the database holds (``metrics_rule``)."""

    separator: str
    max_labels: int


@dataclass(frozen=True)
class Transition:
    """A grant or an end of a tenure (``transitions``); ``event``: ``granted`` or an `EndReason` value."""

    at: str
    key: str
    epoch: int
    owner: str
    event: str

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "key": self.key, "epoch": self.epoch, "owner": self.owner, "event": self.event}


class Seat(NamedTuple):
    """Who this session logged in as, and who owns a relation (``seat``)."""

    login: str
    owner: str | None  # None where the relation is not there


class FenceTriggers(NamedTuple):
    """A fenced table's triggers of the names asked for (``fence_triggers``)."""

    table_exists: bool
    names: list[str] | None
    comments: list[str] | None  # each trigger's comment, in the order of ``names``


class KeyScope(NamedTuple):
    role: str
    prefix: str


class RoleLimit(NamedTuple):
    role: str
    max_leases: int | None
    max_tenures_per_key: int | None


class MissingPrivilege(NamedTuple):
    """A privilege a declared role's kinds give it, and whether it holds it (``missing_privileges``)."""

    role: str
    exists: bool
    kind: str
    object: str
    privilege: str
    held: bool


class HeldPrivilege(NamedTuple):
    """A privilege a role holds on the package's objects (``held_privileges``)."""

    role: str
    kind: str
    object: str
    privilege: str
    grantable: bool
    tiers: list[str] | None  # the tiers of pg_lease_privileges() that name it
    allowed: list[str] | None  # the tiers the role may hold through the declared roles it is a member of
    direct: bool  # granted to the role itself, not through a role it is a member of


class RoleBypasses(NamedTuple):
    """The ways around the lease rules PostgreSQL gives one role (``bypasses``)."""

    role: str
    replica_mode: bool
    reads_all: bool
    writes_all: bool
    maintains: bool
    reads_secret: bool
    creates_roles: bool


class RecoveryState(NamedTuple):
    """A server's recovery, as the Patroni hook reads it (``recovery_state``)."""

    in_recovery: bool
    received: str | None  # the WAL received and replayed, as LSN text
    replayed: str | None
    data_directory: str
    segment_size: int


def shaped(kind: Callable[..., R]) -> Callable[..., R]:
    """The decoder of a statement whose row is ``kind``, a NamedTuple or dataclass of its columns in order."""

    def decode(row: Row, **_: Any) -> R:
        return kind(*row)

    return decode
