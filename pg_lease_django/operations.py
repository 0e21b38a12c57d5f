"""The lease operations as plain functions over a Django connection: one statement each, from `sql.statements`.

`LeaseManager` calls these on the caller's connection, and the heartbeat of ``hold()`` on a
connection of its own. They check no argument: their callers have done so, once. Each sends its one
statement through the sync executor ``sql.run``, where a commit the server could not confirm on its
synchronous standby becomes `UnconfirmedCommitError`. The statement's decoder in ``sql.rows`` turns
the row into the result or the typed error; what happens here besides is the metrics' count. Nothing
here is public API except `Grant`, `LeaseState` and `EpochAdvance`, which `pg_lease_django` and
`pg_lease_django.managers` re-export.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import BaseDatabaseWrapper

from .exceptions import NotAcquirableError
from .metrics import hooks as metrics
from .sql import run, statements
from .sql.rows import Attempt, EpochAdvance, Grant, HandoffRequest, LeaseState, Renewal

__all__ = [
    "Attempt",
    "EpochAdvance",
    "Grant",
    "HandoffRequest",
    "LeaseState",
    "Renewal",
    "acquire",
    "acquire_or_raise",
    "advance_epochs",
    "answer",
    "attempt",
    "attempt_or_register",
    "force_release",
    "inspect",
    "prune",
    "release",
    "renew",
    "request_handoff",
    "require_postgresql",
]


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


def attempted(key: str, tried: Attempt) -> Attempt:
    """``tried``, an attempt of ``key`` the server answered; a grant is counted in the metrics.

    Every attempt is read here, whichever call sent it (the async blocking wait, which sends its own
    statements, included): each grant is counted once.
    """
    if tried.granted:
        metrics.granted(key)
    return tried


def attempt(
    connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta, marker: str | None = None
) -> Attempt:
    """One non-blocking acquire; ``marker``: the identity it shows in ``pg_stat_activity`` (`run.first`)."""
    return attempted(key, run.one(connection, statements.ACQUIRE, key=key, owner=owner, ttl=ttl, marker=marker))


def attempt_within(
    connection: BaseDatabaseWrapper,
    key: str,
    owner: str,
    ttl: timedelta,
    within: timedelta | None,
    marker: str | None = None,
) -> Attempt:
    """One attempt of a waiter that polls: every lock it waits for, at most ``within`` (what is left
    of its deadline; None: no deadline), or it is refused; ``marker`` as for `attempt`."""
    tried = run.one(connection, statements.ACQUIRE_WITHIN, key=key, owner=owner, ttl=ttl, within=within, marker=marker)
    return attempted(key, tried)


def attempt_or_register(
    connection: BaseDatabaseWrapper,
    key: str,
    owner: str,
    ttl: timedelta,
    retry_within: timedelta,
    marker: str | None = None,
) -> Attempt:
    """One attempt of a waiter that LISTENs: when refused, the next release of ``key`` notifies.

    ``retry_within``: the longest the waiter sleeps before its next attempt unless notified (and the
    longest the attempt waits for a lock); ``marker`` as for `attempt`.
    """
    tried = run.one(
        connection, statements.ACQUIRE_OR_REGISTER, key=key, owner=owner, ttl=ttl, within=retry_within, marker=marker
    )
    return attempted(key, tried)


def acquire(
    connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta, marker: str | None = None
) -> Grant | None:
    """A non-blocking acquire: the grant, or None when another owner holds the key."""
    return answer(key, attempt(connection, key, owner, ttl, marker))


def answer(key: str, tried: Attempt) -> Grant | None:
    """A non-blocking acquire's answer to its attempt ``tried``: the grant, or None (a refusal, counted)."""
    grant = tried.grant(key)
    if grant is None:
        metrics.refused(key)
    return grant


def acquire_or_raise(
    connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta, marker: str | None = None
) -> Grant:
    """A non-blocking acquire that raises `NotAcquirableError`, naming the holder, when refused."""
    tried = attempt(connection, key, owner, ttl, marker)
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
        current_epoch=tried.epoch,
        expires_at=expires_at,
    )


def renew(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int, ttl: timedelta) -> Renewal:
    """Extend ``(owner, epoch)``'s lease; the `Renewal`, or the `LeaseLostError` of the verdict."""
    renewal = run.one(connection, statements.RENEW, key=key, owner=owner, epoch=epoch, ttl=ttl)
    metrics.renewal_confirmed(key)
    return renewal


def release(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """Free ``(owner, epoch)``'s lease, or raise the `LeaseLostError` of the verdict."""
    run.one(connection, statements.RELEASE, key=key, owner=owner, epoch=epoch)
    metrics.release_confirmed(key)


def inspect(connection: BaseDatabaseWrapper, key: str) -> LeaseState:
    """The state of ``key`` at the server clock."""
    return run.one(connection, statements.INSPECT, key=key)


def force_release(connection: BaseDatabaseWrapper, key: str, epoch: int | None, operator: str | None = None) -> int:
    """Free ``key`` whoever holds it, at ``epoch`` if given: the new epoch, or why nothing was freed.

    ``operator`` is who forces it, for the history; None records the database role.
    """
    return run.one(connection, statements.FORCE_RELEASE, key=key, epoch=epoch, operator=operator)


def request_handoff(connection: BaseDatabaseWrapper, key: str, epoch: int | None) -> HandoffRequest:
    """Ask the holder of ``key`` (at ``epoch``, if given) to step down; why nobody can be asked, raised."""
    return run.one(connection, statements.REQUEST_HANDOFF, key=key, epoch=epoch)


def prune(connection: BaseDatabaseWrapper, free_for: timedelta, dry_run: bool) -> list[str]:
    """Delete (or, ``dry_run``, list) the rows free for at least ``free_for``: their keys, sorted."""
    return sorted(run.rows(connection, statements.PRUNE, free_for=free_for, dry_run=dry_run))


def advance_epochs(connection: BaseDatabaseWrapper, by: int, dry_run: bool) -> EpochAdvance:
    """Raise every epoch and the epoch floor by ``by`` in one transaction, or say what would be when ``dry_run``.

    Raises:
        InvalidInputError: an epoch or the floor would pass ``MAX_ADVANCE``; nothing changed.
    """
    return run.one(connection, statements.ADVANCE_EPOCHS, by=by, dry_run=dry_run)
