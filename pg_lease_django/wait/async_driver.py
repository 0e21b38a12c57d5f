"""The blocking acquire on the event loop: `wait.plan` run by `plans.adrive` on an async psycopg connection.

Nothing here is public API; see docs/async.md. The first try is made as a non-blocking
``aacquire`` makes it, through ``first_try``: on the lease pool, or on the caller's connection
inside its transaction. So a free key costs no more than one attempt.

Once refused, the wait holds no thread. The waiter opens a connection of its own from the alias's
database settings, a `sql.arun.Session`. It attempts and LISTENs there, and closes it when the
call returns, raises or is cancelled. Its errors are mapped to Django's by a connection object of
its own, never the caller's: that belongs to another thread, which ``errors_occurred`` would mark.
When the caller's connection is in a transaction, the attempts run there instead and the waiter
polls. An attempt cut short by a cancellation is settled by `wait.settling.asettle` before the
cancellation goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseErrorWrapper, load_backend

from pg_lease_django import conf, operations
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.operations import Attempt, Grant
from pg_lease_django.plans import Pause, Plan, adrive
from pg_lease_django.sql import run, statements
from pg_lease_django.sql.arun import Session

from .plan import Lost, ReadEpoch, Reconnect, Step, TryOnce, wait_plan
from .settling import asettle, settled_anyway

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _OwnWait:
    """What an async blocking acquire takes from the alias's settings to wait on a connection of its own."""

    alias: str  # the database's
    connect: dict[str, Any]  # psycopg.AsyncConnection.connect() arguments
    role: str | None  # OPTIONS["assume_role"], set as Django's backend sets it on its connections
    listen: bool
    errors: DatabaseErrorWrapper  # Django's mapping of psycopg's errors, on a connection object of its own


async def await_and_acquire(
    connection_of: Callable[[], BaseDatabaseWrapper],
    alias: str,
    key: str,
    owner: str,
    ttl: timedelta,
    wait: timedelta | None,
    *,
    first_try: Callable[[], Awaitable[Attempt]],
    in_transaction: bool,
) -> Grant:
    """`wait_and_acquire` for the event loop: the same plan, and no thread held while waiting.

    ``first_try`` makes the first attempt as a non-blocking call does; the wait begins only if it is
    refused. ``in_transaction`` says the caller's connection to ``alias`` is in a transaction, so the
    attempts run there. ``connection_of`` returns that connection. For sync code it is called in
    Django's thread through ``sync_to_async``, where it is the connection the caller's other ORM calls
    use.

    Raises:
        UnconfirmedCommitError: an attempt's grant committed on the primary, but the server could not
            confirm it reached the synchronous standby. That is the WARNING of `sql.confirmation`, on
            any statement of the wait. As `wait_and_acquire` does, the waiter has released that grant
            before raising, so nobody received it; that release may be unconfirmed too. The outcome
            is unknown, as for a lost connection: the caller holds nothing it may act on. Acquire
            again; a grant that survives a failover is fenced by the next one.
    """
    with metrics.waiting(key):
        started = time.monotonic()
        grant = (await first_try()).grant(key)
        if grant is not None:
            return grant
        plan = wait_plan(key, owner, wait, rejoin=not in_transaction, poll_interval=conf.poll_interval(), since=started)
        if in_transaction:
            return await _poll_in_transaction(connection_of, key, owner, ttl, plan)
        return await _await_and_acquire(_own_wait(alias, owner), key, owner, ttl, plan)


async def _await_and_acquire(own: _OwnWait, key: str, owner: str, ttl: timedelta, plan: Plan[Step, Grant]) -> Grant:
    # Each attempt is one statement (ACQUIRE_WITHIN, whose lock waits end by the deadline, or
    # ACQUIRE_OR_REGISTER when it listens) on the waiter's own connection rather than an attempt
    # in a thread: a thread cannot be interrupted, so an attempt stuck behind a row lock (until the
    # deadline) when the task is cancelled would run on and could commit a grant nobody receives,
    # while psycopg cancels a statement in flight on cancellation and waits for it to end. No thread
    # is taken even for the attempts, and, as in acquire(), LISTEN and attempts share one session: a
    # release committed while an attempt is in flight is queued there, not missed. A lost connection
    # (the server crashed, a failover) is opened again.
    attempt = statements.ACQUIRE_OR_REGISTER if own.listen else statements.ACQUIRE_WITHIN
    attempting = False  # an attempt's statement is in flight: its outcome unknown if interrupted
    session: Session | None = None

    async def do(step: Step) -> Any:
        nonlocal session, attempting
        if isinstance(step, Reconnect):
            if session is not None:
                await session.close()
                session = None
            await asyncio.sleep(step.seconds)
            return None
        attempting = False
        try:
            if session is None:
                # A schema this process has not looked up yet is looked up on this session,
                # never on the caller's connection, which stays closed if it was.
                session = await Session.connect(
                    own.connect, own.alias, schema=run.known_schema(own.alias), role=own.role, listen=own.listen
                )
            if isinstance(step, TryOnce):
                within = step.register_for if own.listen else step.within
                attempting = True
                # An unconfirmed grant raises here, the attempt still "in flight": settled below.
                tried = await session.one(attempt, key=key, owner=owner, ttl=ttl, within=within)
                attempting = False
                return operations.attempted(key, tried)
            if isinstance(step, ReadEpoch):
                return (await session.one(statements.INSPECT, key=key)).epoch
            if own.listen and step.wakeable:
                await _await_release(session.conn, key, step.seconds)
            else:
                await asyncio.sleep(step.seconds)
            return None
        except psycopg.Error as exc:
            if not (session is None or session.closed):
                raise  # an error of the statement, the connection is fine
            raise Lost(exc, sent=attempting) from None

    with own.errors:
        try:
            return await adrive(plan, do)
        except BaseException as exc:
            # Cancelled (or timed out by asyncio.timeout) during an attempt: psycopg cancelled the
            # statement and read out its result, which may have been a committed grant: settle it
            # before the cancellation goes on (a second cancellation does not cut it short: `settled_anyway`). So is an
            # attempt answered with an unconfirmed commit (UnconfirmedCommitError), as the sync wait
            # settles it: its grant is nobody's. One the server refused (out of scope) granted nothing.
            if attempting and session is not None and not session.closed and not run.refused_by_server(exc):
                await settled_anyway(asettle(session, key, owner), f"the interrupted acquire of {key!r} by {owner!r}")
            raise
        finally:
            # Ending the session ends its LISTEN; no statement runs any more (psycopg has already
            # cancelled and waited out one interrupted by a cancellation).
            if session is not None:
                await settled_anyway(session.close(), f"the wait's connection for {key!r}")


async def _poll_in_transaction(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, plan: Plan[Step, Grant]
) -> Grant:
    """The caller's connection is in a transaction: the grant must belong to it, so the attempts run
    there (in its thread) and the waiter polls, as acquire() does there. An attempt in flight when
    the task is cancelled finishes in that thread. A lost connection took the transaction: raised."""

    async def do(step: Step) -> Any:
        if isinstance(step, TryOnce):
            return await sync_to_async(_attempt_on)(connection_of, key, owner, ttl, step.within)
        assert isinstance(step, Pause)
        await asyncio.sleep(step.seconds)
        return None

    return await adrive(plan, do)


def _attempt_on(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, within: timedelta | None
) -> Attempt:
    return operations.attempt_within(connection_of(), key, owner, ttl, within)


def _own_wait(alias: str, owner: str) -> _OwnWait:
    """How an async blocking acquire waits on a connection of its own to ``alias``'s database.

    Made from the alias's settings with a Django connection object of the waiter's own, never
    connected: the caller's is neither opened nor touched (it may be another thread's).
    """
    settings = connections.settings[alias]  # the test database's name during tests
    private = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias)
    # Django's own translation of the alias's settings into connect() arguments (OPTIONS["pool"] and
    # "isolation_level" left out), as the heartbeat's LeaseConnection gets through its wrapper.
    # Django's cursor classes are sync: use psycopg's async class with the same (client- or
    # server-side) parameter binding.
    params = private.get_connection_params()
    client_side = issubclass(params.pop("cursor_factory", psycopg.ClientCursor), psycopg.ClientCursor)
    params.update(
        autocommit=True,
        cursor_factory=psycopg.AsyncClientCursor if client_side else psycopg.AsyncCursor,
        application_name=f"pg_lease_django wait {owner}"[:63],
    )
    return _OwnWait(
        alias=alias,
        connect=params,
        role=settings["OPTIONS"].get("assume_role"),
        listen=conf.listen_enabled(),
        errors=private.wrap_database_errors,
    )


async def _await_release(conn: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
    # As _wait_for_release: notifications that arrived during the attempt are yielded first.
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        async with aclosing(conn.notifies(timeout=remaining, stop_after=1)) as notifies:
            async for notify in notifies:
                if notify.payload == key:
                    return
