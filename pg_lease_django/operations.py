"""The lease operations as plain functions over a Django connection: one statement each, from `sql`.

`LeaseManager` (on the caller's connection) and the heartbeat of ``hold()`` (on a connection of its
own) both call these. They check no argument: their callers have done so, once. Each sends its one
statement and turns the row into the result or the typed error; a commit the server could not
confirm on its synchronous standby becomes `UnconfirmedCommitError` (`commit_confirmation`, which
`call` uses inline). Nothing here is public API except `Grant` and `LeaseState`, which
`pg_lease_django` and `pg_lease_django.managers` re-export, and `EpochAdvance` (re-exported by
`pg_lease_django.managers`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple, NoReturn

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, DataError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.base import DatabaseWrapper as PostgreSQLDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from . import metrics, sql
from .commit_confirmation import UnconfirmedCommitNotices, confirmed_commit, watch_caller_commit
from .exceptions import (
    LOST_ERRORS,
    AlreadyFreeError,
    EpochMismatchError,
    InvalidInputError,
    LapsedError,
    NeverAcquiredError,
    NotAcquirableError,
    QuotaExceededError,
)
from .status import LeaseStatus


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
        status: ``"free"``, ``"held"`` or ``"lapsed"`` (expired, not yet taken over): a `LeaseStatus` value.
        owner: the holder; the former holder when lapsed; None when free.
        epoch: the current epoch (0 for a key never acquired).
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
        return self.status == LeaseStatus.HELD.value


class Attempt(NamedTuple):
    """A ``pg_lease_acquire`` row: granted, or refused naming who holds the key and until when."""

    granted: bool
    key: str
    owner: str  # the grantee; when refused, the holder
    epoch: int  # the grant's epoch; when refused, the holder's
    expires_at: datetime  # the grant's expiry; when refused, the holder's
    server_time: datetime

    def grant(self, key: str) -> Grant | None:
        """The `Grant` of ``key`` this attempt obtained, or None when refused."""
        return Grant(key, self.owner, self.epoch, self.expires_at, self.server_time) if self.granted else None


@dataclass(frozen=True)
class EpochAdvance:
    """What `LeaseManager.advance_epochs` did (or, dry run, would do).

    Attributes:
        by: how much every epoch and the epoch floor went up.
        leases: the lease rows advanced.
        held: of those, the ones held then: their holders are fenced (``epoch_mismatch``) and must re-acquire.
        epoch_floor: the new epoch floor: a key without a row starts above it.
        max_epoch: the new highest epoch (the floor when there are no rows).
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


def require_postgresql(connection: BaseDatabaseWrapper) -> BaseDatabaseWrapper:
    """``connection``, if it is PostgreSQL's; the lease functions exist nowhere else.

    Where system checks do not run (``manage.py shell``, a script), this names the cause that
    check ``pg_lease_django.E001`` would have named, instead of the other backend's syntax error.

    Raises:
        ImproperlyConfigured: ``connection`` is not a PostgreSQL one.
    """
    if connection.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"leases need PostgreSQL, but database {connection.alias!r} is {connection.vendor} "
            f"(system check pg_lease_django.E001): use ENGINE 'django.db.backends.postgresql' for "
            f"DATABASES[{connection.alias!r}], or route the pg_lease_django app to a PostgreSQL database "
            "(DATABASE_ROUTERS)"
        )
    return connection


def call(connection: BaseDatabaseWrapper, template: str, params: Sequence[Any]) -> tuple[Any, ...]:
    """Send one statement of `sql` on ``connection`` and return its one row.

    Inside the caller's ``atomic()`` the statement does not commit: the caller's COMMIT is checked
    instead, after it returns, by an ``on_commit`` hook (`CallerCommitWatch`) that raises out of ``atomic()``.

    Raises:
        UnconfirmedCommitError: the statement committed on its own, but the server could not confirm
            the commit reached its synchronous standby (`confirmed_commit`).
    """
    statement = sql.render(connection, template)
    # confirmed_commit, inline on this hot path; kept_on runs Django's health check and connects: once a call.
    notices = UnconfirmedCommitNotices.kept_on(connection)
    raw = connection.connection
    notices.seen.clear()
    row = _one_row(connection, raw, statement, params)
    notices.raise_if_unconfirmed()
    watch_caller_commit(connection)
    assert row is not None
    return tuple(row)


def _one_row(
    connection: BaseDatabaseWrapper, raw: psycopg.Connection[Any], statement: str, params: Sequence[Any]
) -> Any:
    """Send ``statement`` on ``raw`` (``connection``'s psycopg connection, open and health-checked) and
    return its one row, the cheapest way Django's connection allows.

    Through Django's cursor whenever anything may watch or change what it sends (`_unwatched`);
    otherwise on a cursor of ``raw``, after the checks Django's cursor makes (thread, broken
    transaction) and with its error wrapping: the same session, the same cursor class and binding,
    ~10 µs less Python per call (docs/performance.md).
    """
    if _unwatched(connection) and _loads_in_django_time_zone(connection, raw):
        connection.validate_thread_sharing()
        connection.validate_no_broken_transaction()
        with connection.wrap_database_errors, raw.cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchone()
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


def _loads_in_django_time_zone(connection: BaseDatabaseWrapper, raw: psycopg.Connection[Any]) -> bool:
    """Whether ``raw`` loads timestamps in the zone Django's cursor would: it sets its own loader on
    each cursor when the database's time zone setting changed after connecting. Remembered per
    psycopg connection and zone (Django registers a connection's loader only when it connects)."""
    zone = connection.timezone
    known = connection.__dict__.get("_pg_lease_zone")
    if known is not None and known[0]() is raw and known[1] is zone:
        return bool(known[2])
    loader = raw.adapters.get_loader(_TIMESTAMPTZ, psycopg.pq.Format.TEXT)
    agrees = loader is not None and getattr(loader, "timezone", None) == zone
    connection._pg_lease_zone = (weakref.ref(raw), zone, agrees)  # type: ignore[attr-defined]  # noqa: SLF001 (our own attribute)
    return agrees


def _unwatched(connection: BaseDatabaseWrapper) -> bool:
    """Whether nothing but Django's own code stands between a call and psycopg: Django's PostgreSQL
    backend itself (a subclass may set a search_path or instrument its cursors), no execute wrapper
    (another app's, or `CallerCommitWatch`), no query log (``DEBUG``, ``assertNumQueries``), no patched
    ``connection.cursor`` (django-debug-toolbar) and an unpatched ``CursorWrapper`` (APM agents)."""
    return (
        type(connection) is PostgreSQLDatabaseWrapper
        and not connection.execute_wrappers
        and not connection.queries_logged
        and "cursor" not in vars(connection)
        and CursorWrapper.execute.__module__ == CursorWrapper.__module__
    )


@contextmanager
def quota_refusals(key: str) -> Iterator[None]:
    """An acquire's refusal by ``PG_LEASE_ROLE_LIMITS`` (SQLSTATE 53400, Django's or psycopg's error)
    raised as `QuotaExceededError`; every other error as it is."""
    try:
        yield
    except (DatabaseError, psycopg.Error) as exc:
        error = exc if isinstance(exc, psycopg.Error) else exc.__cause__
        if getattr(error, "sqlstate", None) != QuotaExceededError.sqlstate:
            raise
        message = getattr(getattr(error, "diag", None), "message_primary", None) or str(error)
        raise QuotaExceededError(message, key=key) from exc


def attempted(key: str, row: Sequence[Any]) -> Attempt:
    """The `Attempt` a ``pg_lease_acquire`` row of ``key`` says; a grant is counted in the metrics.

    Every attempt's row is read here, whichever call sent it (the async blocking wait, which sends its
    own statements, included): each grant is counted once.
    """
    tried = Attempt(*row)
    if tried.granted:
        metrics.granted(key)
    return tried


def attempt(connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta) -> Attempt:
    """One non-blocking acquire."""
    with quota_refusals(key):
        return attempted(key, call(connection, sql.ACQUIRE, [key, owner, ttl]))


def attempt_or_register(
    connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta, retry_within: timedelta
) -> Attempt:
    """One attempt of a waiter that LISTENs: when refused, the next release of ``key`` notifies.

    ``retry_within``: the longest the waiter sleeps before its next attempt unless notified.
    """
    with quota_refusals(key):
        return attempted(key, call(connection, sql.ACQUIRE_OR_REGISTER, [key, owner, ttl, retry_within]))


def acquire(connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta) -> Grant | None:
    """A non-blocking acquire: the grant, or None when another owner holds the key."""
    grant = attempt(connection, key, owner, ttl).grant(key)
    if grant is None:
        metrics.refused(key)
    return grant


def acquire_or_raise(connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta) -> Grant:
    """A non-blocking acquire that raises `NotAcquirableError`, naming the holder, when refused."""
    tried = attempt(connection, key, owner, ttl)
    grant = tried.grant(key)
    if grant is not None:
        return grant
    metrics.refused(key)
    expires_at: datetime | None = tried.expires_at
    until = f" until {expires_at.isoformat(timespec='milliseconds')}" if expires_at is not None else ""
    raise NotAcquirableError(
        f"lease {key!r} is held by {tried.owner!r} at epoch {tried.epoch}{until}",
        key=key,
        owner=owner,
        holder=tried.owner,
        holder_epoch=tried.epoch,
        expires_at=expires_at,
    )


class Renewal(NamedTuple):
    """A renewal that succeeded: the new expiry, and whether someone asked the holder to step down."""

    expires_at: datetime
    handoff_requested: bool


def renew(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int, ttl: timedelta) -> Renewal:
    """Extend ``(owner, epoch)``'s lease; the `Renewal`, or the `LeaseLostError` of the verdict."""
    outcome, expires_at, _server_time, handoff_requested = call(connection, sql.RENEW, [key, owner, epoch, ttl])
    _raise_unless_ok(outcome, "renew", key, owner, epoch)
    metrics.renewal_confirmed(key)
    return Renewal(expires_at, bool(handoff_requested))


def release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """Free ``(owner, epoch)``'s lease, or raise the `LeaseLostError` of the verdict."""
    outcome, _epoch, _server_time = call(connection, sql.RELEASE, [key, owner, epoch])
    _raise_unless_ok(outcome, "release", key, owner, epoch)
    metrics.release_confirmed(key)


def _raise_unless_ok(outcome: str, operation: str, key: str, owner: str, epoch: int) -> None:
    if outcome == "ok":
        return
    error = LOST_ERRORS[outcome]
    raise error(
        f"cannot {operation} {key!r} as {owner!r} at epoch {epoch}: {outcome}", key=key, owner=owner, epoch=epoch
    )


def inspect(connection: BaseDatabaseWrapper, key: str) -> LeaseState:
    """The state of ``key`` at the server clock."""
    _key, status, owner, epoch, expires_at, server_time = call(connection, sql.INSPECT, [key])
    return LeaseState(key, status, owner, epoch, expires_at, server_time)


def force_release(connection: BaseDatabaseWrapper, key: str, epoch: int | None, operator: str | None = None) -> int:
    """Free ``key`` whoever holds it (at ``epoch``, if given): the new epoch, or why nothing was freed.

    ``operator``: who forces it, for the history (None: the database role).
    """
    outcome, owner, current_epoch, _server_time = call(connection, sql.FORCE_RELEASE, [key, epoch, operator])
    if outcome == "ok":
        return current_epoch  # type: ignore[no-any-return]
    _raise_not_held(outcome, key, owner, current_epoch, epoch, "nothing to release")


def _raise_not_held(outcome: str, key: str, owner: str | None, current: int, epoch: int | None, so: str) -> NoReturn:
    """The error of an operator's call on ``key`` that found nobody holding it at ``epoch`` (``so``: what follows)."""
    if outcome == "epoch_mismatch":
        raise EpochMismatchError(
            f"lease {key!r} has moved on: its epoch is {current} (held by {owner!r}), not {epoch}",
            key=key,
            owner=owner,
            epoch=epoch,
        )
    if outcome == "not_found":
        raise NeverAcquiredError(f"no lease with key {key!r} (never acquired): {so}", key=key, epoch=epoch)
    if outcome == "lapsed":
        raise LapsedError(
            f"lease {key!r} lapsed (owner {owner!r}, epoch {current}): {so}", key=key, owner=owner, epoch=current
        )
    raise AlreadyFreeError(
        f"lease {key!r} is already free (epoch {current}): {so}", key=key, epoch=epoch, current_epoch=current
    )


@dataclass(frozen=True)
class HandoffRequest:
    """A hand-off request recorded on a held lease (`LeaseManager.request_handoff`).

    Attributes:
        key: the lease key.
        owner: the holder asked to step down.
        epoch: its epoch.
        expires_at: its expiry when asked.
        requested_at: when the hand-off was first requested during this grant (server clock).
        server_time: the server clock when this request was made.
    """

    key: str
    owner: str
    epoch: int
    expires_at: datetime
    requested_at: datetime
    server_time: datetime


def request_handoff(connection: BaseDatabaseWrapper, key: str, epoch: int | None) -> HandoffRequest:
    """Ask the holder of ``key`` (at ``epoch``, if given) to step down; why nobody can be asked, raised."""
    outcome, owner, current_epoch, expires_at, requested_at, server_time = call(
        connection, sql.REQUEST_HANDOFF, [key, epoch]
    )
    if outcome == "ok":
        return HandoffRequest(key, owner, current_epoch, expires_at, requested_at, server_time)
    _raise_not_held(outcome, key, owner, current_epoch, epoch, "nobody holds it to hand it off")


def prune(connection: BaseDatabaseWrapper, free_for: timedelta, dry_run: bool) -> list[str]:
    """Delete (or, ``dry_run``, list) the rows free for at least ``free_for``: their keys, sorted."""
    params: list[Any] = [free_for, dry_run]
    with connection.cursor() as cursor, confirmed_commit(connection):
        cursor.execute(sql.render(connection, sql.PRUNE), params)
        keys = sorted(row[0] for row in cursor.fetchall())
    return keys


def advance_epochs(connection: BaseDatabaseWrapper, by: int, dry_run: bool) -> EpochAdvance:
    """Raise every epoch and the epoch floor by ``by`` in one transaction (or, ``dry_run``, say what would be).

    Raises:
        InvalidInputError: an epoch or the floor would pass the limit (``MAX_ADVANCE``); nothing changed.
    """
    try:
        leases, held, epoch_floor, max_epoch, server_time = call(connection, sql.ADVANCE_EPOCHS, [by, dry_run])
    except DataError as exc:
        cause = exc.__cause__
        if getattr(cause, "sqlstate", None) != "22003":
            raise
        message = getattr(getattr(cause, "diag", None), "message_primary", None) or str(exc)
        raise InvalidInputError(f"{message}; nothing was changed") from exc
    return EpochAdvance(by, leases, held, epoch_floor, max_epoch, server_time, dry_run)
