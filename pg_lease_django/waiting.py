"""The wait of a blocking acquire: attempt, and after a refusal wait for a release, the holder's expiry or a poll.

Nothing here is public API: ``acquire(blocking=True)``, ``aacquire(blocking=True)`` and
``hold(blocking=True)`` are (see docs/blocking.md). Between attempts no transaction or snapshot is
held (outside ``atomic()``), and a refused attempt takes no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseErrorWrapper
from psycopg.sql import SQL, Identifier

from . import conf, operations, sql
from .exceptions import LeaseTimeoutError
from .operations import Attempt, Grant
from .validation import MAX_WAIT, describe_seconds

# The logger these warnings were always logged under: the manager's, whose calls they are part of.
logger = logging.getLogger("pg_lease_django.managers")


def pause_after_refusal(
    key: str, owner: str, refused: Attempt, wait: timedelta | None, deadline: float | None
) -> float:
    """Seconds a waiter sleeps after the refused attempt; LeaseTimeoutError once past ``deadline``.

    Until the holder's expiry (server clock), a poll interval, or the deadline (``time.monotonic()``).
    """
    now = time.monotonic()
    if deadline is not None and now >= deadline:
        waited = describe_seconds(wait) if wait is not None else "the wait"
        raise LeaseTimeoutError(
            f"lease {key!r} still held by {refused.owner!r} after waiting {waited}", key=key, owner=owner
        )
    pause: float = min(max((refused.expires_at - refused.server_time).total_seconds(), 0.0), conf.poll_interval())
    if deadline is not None:
        pause = min(pause, deadline - now)
    return pause


def retry_within(deadline: float | None) -> timedelta:
    """The longest a waiter sleeps before its next attempt (unless woken): what it registers for.

    The poll interval, or less when the deadline (``time.monotonic()``) comes sooner; the holder's
    expiry, the other bound, the server knows from the attempt itself.
    """
    seconds = conf.poll_interval()
    if deadline is not None:
        seconds = min(seconds, deadline - time.monotonic())
    return min(timedelta(seconds=max(seconds, 0.0)), MAX_WAIT)


def wait_and_acquire(
    connection: BaseDatabaseWrapper,
    key: str,
    owner: str,
    ttl: timedelta,
    wait: timedelta | None,
    *,
    before_attempt: Callable[[], object] | None = None,
) -> Grant:
    """Retry on ``connection`` until granted: on a release notification, at the holder's expiry, or every poll.

    ``before_attempt`` is called just before each attempt is sent (the heartbeat's trust window
    starts there). Inside ``atomic()`` LISTEN would only start at commit, so it polls. A waiter that
    LISTENs registers with each refused attempt (``ACQUIRE_OR_REGISTER``): releases notify only then.
    """
    deadline = None if wait is None else time.monotonic() + wait.total_seconds()
    # LISTEN inside a transaction takes effect only at its commit: inside atomic() (or with
    # autocommit off) a waiter could never hear a release, so it polls.
    listen = conf.listen_enabled() and connection.get_autocommit()
    with _listening(connection, listen):
        while True:
            if before_attempt is not None:
                before_attempt()
            if listen:
                tried = operations.attempt_or_register(connection, key, owner, ttl, retry_within(deadline))
            else:
                tried = operations.attempt(connection, key, owner, ttl)
            grant = tried.grant(key)
            if grant is not None:
                return grant
            pause = pause_after_refusal(key, owner, tried, wait, deadline)
            if listen:
                _wait_for_release(connection, key, pause)
            else:
                time.sleep(pause)


@contextmanager
def _listening(connection: BaseDatabaseWrapper, listen: bool) -> Iterator[None]:
    """LISTEN for the wait (if ``listen``); on every way out leave no LISTEN and no running statement.

    Cleanup never replaces the exception in flight (the timeout, a database error, or an
    interrupt such as KeyboardInterrupt, an exception from a signal handler, a cancellation).
    """
    try:
        if listen:
            with connection.cursor() as cursor:
                cursor.execute(sql.LISTEN)
        yield
    except BaseException:
        _abandon_statement(connection)
        if listen:
            _unlisten(connection)
        raise
    if listen:
        _unlisten(connection)


def _abandon_statement(connection: BaseDatabaseWrapper) -> None:
    # psycopg cancels the running statement on KeyboardInterrupt only. Any other exception
    # raised while an attempt runs (say from a signal handler, while the attempt waits for a
    # row lock) leaves the attempt running on the server: it could still commit a grant that
    # nobody receives, and the connection cannot send anything else. Cancel it and drop the
    # connection (Django reconnects on next use; inside atomic() the transaction is lost).
    raw = connection.connection
    if raw is None or raw.info.transaction_status != psycopg.pq.TransactionStatus.ACTIVE:
        return
    logger.warning("blocking acquire interrupted mid-statement: cancelling it and closing the connection")
    with suppress(Exception):
        raw.cancel_safe(timeout=5.0)
    with suppress(Exception):
        connection.close()


def _unlisten(connection: BaseDatabaseWrapper) -> None:
    if connection.connection is None:  # closed: the server dropped the LISTEN with the session
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql.UNLISTEN)
    except Exception:
        # Closing the session is the only other way to be sure no LISTEN outlives the wait;
        # a grant already obtained stays valid.
        logger.warning("UNLISTEN after a blocking acquire failed: closing the connection", exc_info=True)
        with suppress(Exception):
            connection.close()


def _wait_for_release(connection: BaseDatabaseWrapper, key: str, seconds: float) -> None:
    # psycopg queues notifications that arrive during an attempt and yields them here first,
    # so a release that commits between our refused attempt and this wait is not missed.
    deadline = time.monotonic() + seconds
    raw = connection.connection
    # The raw connection's errors are psycopg's: map them to Django's, as for every other call.
    with connection.wrap_database_errors:
        while (remaining := deadline - time.monotonic()) > 0:
            for notify in raw.notifies(timeout=remaining, stop_after=1):
                if notify.payload == key:
                    return


# ---- the same wait for the event loop: LeaseManager.aacquire(blocking=True) ----------------------


@dataclass(frozen=True)
class _OwnWait:
    """What an async blocking acquire takes from the caller's connection to wait on one of its own."""

    statement: str  # sql.ACQUIRE_OR_REGISTER when it listens, else sql.ACQUIRE, rendered for that database
    connect: dict[str, Any]  # psycopg.AsyncConnection.connect() arguments
    role: str | None  # OPTIONS["assume_role"], set as Django's backend sets it on its connections
    listen: bool
    errors: DatabaseErrorWrapper  # Django's mapping of psycopg's errors, as for every other call


async def await_and_acquire(
    connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta, wait: timedelta | None
) -> Grant:
    """`wait_and_acquire` for the event loop: the same attempts and pauses, and no thread held while waiting.

    ``connection_of`` returns the caller's connection; it is called in Django's thread for sync code
    (``sync_to_async``), where that is the connection the caller's other ORM calls use.
    """
    deadline = None if wait is None else time.monotonic() + wait.total_seconds()
    own = await sync_to_async(_own_wait)(connection_of, owner)
    if own is None:
        # The caller's connection is in a transaction: the grant must belong to it, so the
        # attempts run there (in its thread) and the waiter polls, as acquire() does there. An
        # attempt in flight when the task is cancelled finishes in that thread.
        while True:
            tried = await sync_to_async(_attempt_on)(connection_of, key, owner, ttl)
            grant = tried.grant(key)
            if grant is not None:
                return grant
            await asyncio.sleep(pause_after_refusal(key, owner, tried, wait, deadline))
    # Each attempt is one statement (ACQUIRE, or ACQUIRE_OR_REGISTER when it listens) on the
    # waiter's own connection rather than an attempt in a thread: a thread cannot be interrupted,
    # so an attempt stuck behind a row lock when the task is cancelled would run on and could
    # commit a grant nobody receives, while psycopg cancels a statement in flight on cancellation
    # and waits for it to end. No thread is taken even for the attempts, and, as in acquire(),
    # LISTEN and attempts share one session: a release committed while an attempt is in flight
    # is queued there, not missed.
    with own.errors:
        conn = await psycopg.AsyncConnection.connect(**own.connect)
        try:
            if own.role:
                await conn.execute(SQL("SET ROLE {}").format(Identifier(own.role)))
            if own.listen:
                await conn.execute(sql.LISTEN)
            while True:
                params: list[Any] = [key, owner, ttl]
                if own.listen:
                    params.append(retry_within(deadline))
                row = await (await conn.execute(own.statement, params)).fetchone()
                assert row is not None
                tried = Attempt(*row)
                grant = tried.grant(key)
                if grant is not None:
                    return grant
                pause = pause_after_refusal(key, owner, tried, wait, deadline)
                if own.listen:
                    await _await_release(conn, key, pause)
                else:
                    await asyncio.sleep(pause)
        finally:
            # Ending the session ends its LISTEN; no statement runs any more (psycopg has already
            # cancelled and waited out one interrupted by a cancellation).
            await conn.close()


def _attempt_on(connection_of: Callable[[], BaseDatabaseWrapper], key: str, owner: str, ttl: timedelta) -> Attempt:
    return operations.attempt(connection_of(), key, owner, ttl)


def _own_wait(connection_of: Callable[[], BaseDatabaseWrapper], owner: str) -> _OwnWait | None:
    """How an async blocking acquire waits on a connection of its own; None when the caller's is in a transaction."""
    connection = connection_of()
    # Asked without opening the caller's connection: the attempts will not run on it.
    opened = connection.connection is not None
    if not (connection.get_autocommit() if opened else connection.settings_dict["AUTOCOMMIT"]):
        return None
    # Django's own translation of the alias's settings into connect() arguments (the test
    # database's name during tests; OPTIONS["pool"] and "isolation_level" left out), as the
    # heartbeat's LeaseConnection gets through its wrapper. Django's cursor classes are sync:
    # use psycopg's async class with the same (client- or server-side) parameter binding.
    params = connection.get_connection_params()
    client_side = issubclass(params.pop("cursor_factory", psycopg.ClientCursor), psycopg.ClientCursor)
    params.update(
        autocommit=True,
        cursor_factory=psycopg.AsyncClientCursor if client_side else psycopg.AsyncCursor,
        application_name=f"pg_lease_django wait {owner}"[:63],
    )
    listen = conf.listen_enabled()
    return _OwnWait(
        statement=sql.render(connection, sql.ACQUIRE_OR_REGISTER if listen else sql.ACQUIRE),
        connect=params,
        role=connection.settings_dict["OPTIONS"].get("assume_role"),
        listen=listen,
        errors=connection.wrap_database_errors,
    )


async def _await_release(conn: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
    # As _wait_for_release: notifications that arrived during the attempt are yielded first.
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        async with aclosing(conn.notifies(timeout=remaining, stop_after=1)) as notifies:
            async for notify in notifies:
                if notify.payload == key:
                    return
