"""The manager's one-shot sync calls: one attempt and one release, settled when interrupted in flight.

`Lease.objects.acquire` without waiting and `Lease.objects.release` send one statement each through
`operations`. An interruption that lands while it runs is settled by the rules of `wait.settling`
before it goes on, unless the caller's transaction owns the statement.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import operations
from pg_lease_django.operations import Grant
from pg_lease_django.wait import settling


def acquire_once(connection: BaseDatabaseWrapper, key: str, owner: str, ttl: timedelta) -> Grant | None:
    """One non-blocking attempt for `Lease.objects.acquire`; interrupted in flight, it is settled.

    A signal, ``SystemExit`` or any other interruption that is not an error of the call leaves a
    statement that may still run on the server, since psycopg cancels only on its own interrupts.
    Outside a transaction it is cancelled and a grant it made is released, as `settling.settle`
    does for every attempt. Inside one, the caller's transaction owns the attempt.
    """
    own = settling.commits_on_its_own(connection)
    in_flight = settling.attempt_in_flight(connection) if own else None
    try:
        return operations.acquire(connection, key, owner, ttl, None if in_flight is None else in_flight.marker)
    except Exception:
        raise  # the server answered (a refusal, a bad argument) or the connection is lost: reported
    except BaseException:
        if in_flight is not None:
            settling.settle(connection, key, owner, in_flight)
        raise


def release_once(connection: BaseDatabaseWrapper, key: str, owner: str, epoch: int) -> None:
    """A release for `Lease.objects.release`; interrupted before it took effect, it is completed.

    An interruption landing before the release commits would leave the lease held, for up to its
    TTL, by an owner that is leaving. Outside a transaction `settling.complete_release` completes it
    before the interruption goes on. Inside one, the caller's transaction owns it.
    """
    own = settling.commits_on_its_own(connection)
    try:
        operations.release(connection, key, owner, epoch)
    except Exception:
        raise  # the server answered (a refusal) or the connection is lost: reported
    except BaseException:
        if own:
            settling.complete_release(connection, key, owner, epoch)
        raise
