"""LeaseManager: the four operations, each one call of a SQL function in one round trip."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, overload

import psycopg
from asgiref.sync import sync_to_async
from django.db import connections, models, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseErrorWrapper
from psycopg.sql import SQL, Identifier

from . import conf, sql
from .exceptions import (
    LOST_ERRORS,
    AlreadyFreeError,
    EpochMismatchError,
    InvalidInputError,
    LeaseTimeoutError,
    NeverAcquiredError,
    NotAcquirableError,
)
from .validation import (
    MAX_PRUNE_AGE,
    MAX_WAIT,
    Seconds,
    check_epoch,
    check_name,
    check_ttl,
    describe_seconds,
    to_timedelta,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .models import Lease  # noqa: F401  (named in the Manager["Lease"] base)

logger = logging.getLogger(__name__)

#: Channel the release function notifies, with the key as payload.
NOTIFY_CHANNEL = "pg_lease_django"


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
        status: ``"free"``, ``"held"`` or ``"lapsed"`` (expired, not yet taken over).
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
        return self.status == "held"


@dataclass(frozen=True)
class _OwnWait:
    """What a blocking `LeaseManager.aacquire` takes from the caller's connection to wait on one of its own."""

    statement: str  # sql.ACQUIRE, rendered for that database
    connect: dict[str, Any]  # psycopg.AsyncConnection.connect() arguments
    role: str | None  # OPTIONS["assume_role"], set as Django's backend sets it on its connections
    listen: bool
    errors: DatabaseErrorWrapper  # Django's mapping of psycopg's errors, as for every other call


class LeaseManager(models.Manager["Lease"]):
    """Acquire, renew, release and inspect leases.

    Every method is one SQL statement (one round trip), except a blocking acquire, which repeats
    its one-statement attempt (with LISTEN/UNLISTEN around the wait outside ``atomic()``).
    Outside ``atomic()`` each statement commits on its own; inside, it is part of the caller's
    transaction and rolls back with it. Use
    ``Lease.objects.db_manager(alias)`` for another database; by default the router's write
    database for `Lease` is used.

    Each operation has an awaitable twin for async code (`aacquire`, `arenew`, `arelease`,
    `ainspect`, `aforce_release`) with the same arguments, rules, results and errors.
    """

    def _connection(self) -> BaseDatabaseWrapper:
        return connections[self._db or router.db_for_write(self.model)]

    def _call(self, template: str, params: Sequence[Any]) -> tuple[Any, ...]:
        connection = self._connection()
        statement = sql.render(connection, template)
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            row = cursor.fetchone()
        assert row is not None
        return tuple(row)

    @overload
    def acquire(self, key: str, owner: str, ttl: Seconds, *, blocking: Literal[False] = False) -> Grant | None: ...
    @overload
    def acquire(
        self, key: str, owner: str, ttl: Seconds, *, blocking: Literal[True], timeout: Seconds | None = None
    ) -> Grant: ...
    @overload
    def acquire(
        self, key: str, owner: str, ttl: Seconds, *, blocking: bool, timeout: Seconds | None = None
    ) -> Grant | None: ...

    def acquire(
        self,
        key: str,
        owner: str,
        ttl: Seconds,
        *,
        blocking: bool = False,
        timeout: Seconds | None = None,
    ) -> Grant | None:
        """Acquire ``key`` for ``owner`` for ``ttl`` (seconds or timedelta).

        Granted when the key is free, lapsed, or already held by ``owner`` (a self-takeover: the
        grant has a new epoch, which fences the owner's earlier incarnation).

        Args:
            key: the lease key (1-255 UTF-8 bytes, no NUL).
            owner: the caller's identity, unique among concurrent clients.
            ttl: how long the grant lasts without renewal, on the server clock.
            blocking: wait until the key can be acquired instead of returning None.
            timeout: with ``blocking=True``, the longest wait (seconds or timedelta).

        Returns:
            A `Grant`, or None when another owner holds the key (non-blocking only).

        Raises:
            InvalidInputError: bad argument; nothing was sent.
            LeaseTimeoutError: ``blocking=True`` and ``timeout`` passed.
        """
        ttl_delta, wait = self._check_acquire(key, owner, ttl, blocking, timeout)
        if not blocking:
            return self._try_acquire(key, owner, ttl_delta)[0]
        return self._wait_and_acquire(key, owner, ttl_delta, wait)

    @staticmethod
    def _check_acquire(
        key: str, owner: str, ttl: Seconds, blocking: bool, timeout: Seconds | None
    ) -> tuple[timedelta, timedelta | None]:
        """The argument rules of `acquire` and `aacquire`: the TTL and the wait bound, or InvalidInputError."""
        check_name("key", key)
        check_name("owner", owner)
        ttl_delta = check_ttl(ttl)
        if not isinstance(blocking, bool):
            raise InvalidInputError(f"blocking must be a bool, not {type(blocking).__name__}", key=key, owner=owner)
        if timeout is not None and not blocking:
            raise InvalidInputError("timeout only applies with blocking=True", key=key, owner=owner)
        wait = None if timeout is None else to_timedelta("timeout", timeout, minimum=timedelta(0), maximum=MAX_WAIT)
        return ttl_delta, wait

    def _try_acquire(self, key: str, owner: str, ttl: timedelta) -> tuple[Grant | None, tuple[Any, ...]]:
        row = self._call(sql.ACQUIRE, [key, owner, ttl])
        return self._granted(key, row), row

    def _acquire_or_raise(self, key: str, owner: str, ttl: Seconds) -> Grant:
        """A non-blocking acquire that raises `NotAcquirableError`, naming the holder, when refused."""
        ttl_delta, _wait = self._check_acquire(key, owner, ttl, False, None)
        grant, row = self._try_acquire(key, owner, ttl_delta)
        if grant is not None:
            return grant
        _granted, _key, holder, holder_epoch, expires_at, _server_time = row
        until = f" until {expires_at.isoformat(timespec='milliseconds')}" if expires_at is not None else ""
        raise NotAcquirableError(
            f"lease {key!r} is held by {holder!r} at epoch {holder_epoch}{until}",
            key=key,
            owner=owner,
            holder=holder,
            holder_epoch=holder_epoch,
            expires_at=expires_at,
        )

    @staticmethod
    def _granted(key: str, row: tuple[Any, ...]) -> Grant | None:
        """The `Grant` in a ``pg_lease_acquire`` row, or None when the attempt was refused."""
        granted, _key, row_owner, epoch, expires_at, server_time = row
        return Grant(key, row_owner, epoch, expires_at, server_time) if granted else None

    @staticmethod
    def _pause_after_refusal(
        key: str, owner: str, row: tuple[Any, ...], wait: timedelta | None, deadline: float | None
    ) -> float:
        """Seconds a waiter sleeps after the refused attempt ``row``; LeaseTimeoutError once past ``deadline``.

        Until the holder's expiry (server clock), a poll interval, or the deadline (``time.monotonic()``).
        """
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            waited = describe_seconds(wait) if wait is not None else "the wait"
            raise LeaseTimeoutError(
                f"lease {key!r} still held by {row[2]!r} after waiting {waited}", key=key, owner=owner
            )
        holder_expires_at, server_time = row[4], row[5]
        pause: float = min(max((holder_expires_at - server_time).total_seconds(), 0.0), conf.poll_interval())
        if deadline is not None:
            pause = min(pause, deadline - now)
        return pause

    def _wait_and_acquire(self, key: str, owner: str, ttl: timedelta, wait: timedelta | None) -> Grant:
        """Retry until granted: on a release notification, at the holder's expiry, or every poll interval.

        Between attempts no transaction or snapshot is held (outside ``atomic()``), and a refused
        attempt takes no lock. Inside ``atomic()`` LISTEN would only start at commit, so it polls.
        """
        deadline = None if wait is None else time.monotonic() + wait.total_seconds()
        connection = self._connection()
        # LISTEN inside a transaction takes effect only at its commit: inside atomic() (or with
        # autocommit off) a waiter could never hear a release, so it polls.
        listen = conf.listen_enabled() and connection.get_autocommit()
        with self._listening(connection, listen):
            while True:
                grant, row = self._try_acquire(key, owner, ttl)
                if grant is not None:
                    return grant
                pause = self._pause_after_refusal(key, owner, row, wait, deadline)
                if listen:
                    self._wait_for_release(connection, key, pause)
                else:
                    time.sleep(pause)

    @contextmanager
    def _listening(self, connection: BaseDatabaseWrapper, listen: bool) -> Iterator[None]:
        """LISTEN for the wait (if ``listen``); on every way out leave no LISTEN and no running statement.

        Cleanup never replaces the exception in flight (the timeout, a database error, or an
        interrupt such as KeyboardInterrupt, an exception from a signal handler, a cancellation).
        """
        try:
            if listen:
                with connection.cursor() as cursor:
                    cursor.execute(f"LISTEN {NOTIFY_CHANNEL}")
            yield
        except BaseException:
            self._abandon_statement(connection)
            if listen:
                self._unlisten(connection)
            raise
        if listen:
            self._unlisten(connection)

    @staticmethod
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

    @staticmethod
    def _unlisten(connection: BaseDatabaseWrapper) -> None:
        if connection.connection is None:  # closed: the server dropped the LISTEN with the session
            return
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"UNLISTEN {NOTIFY_CHANNEL}")
        except Exception:
            # Closing the session is the only other way to be sure no LISTEN outlives the wait;
            # a grant already obtained stays valid.
            logger.warning("UNLISTEN after a blocking acquire failed: closing the connection", exc_info=True)
            with suppress(Exception):
                connection.close()

    @staticmethod
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

    def renew(self, key: str, owner: str, epoch: int, ttl: Seconds) -> datetime:
        """Extend a live lease held by ``(owner, epoch)`` to server now + ``ttl``.

        Returns:
            The new ``expires_at`` (server clock).

        Raises:
            NotOwnerError: the key is unknown, free, or held by another owner.
            LapsedError: ``owner`` held it but it expired; re-acquire to continue.
            EpochMismatchError: ``owner`` holds it under another epoch.
            InvalidInputError: bad argument; nothing was sent.
        """
        check_name("key", key)
        check_name("owner", owner)
        check_epoch(epoch)
        ttl_delta = check_ttl(ttl)
        outcome, expires_at, _server_time = self._call(sql.RENEW, [key, owner, epoch, ttl_delta])
        self._raise_unless_ok(outcome, "renew", key, owner, epoch)
        return expires_at  # type: ignore[no-any-return]

    def release(self, key: str, owner: str, epoch: int) -> None:
        """Free a live lease held by ``(owner, epoch)``; the epoch goes up, fencing the holder.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: as for `renew`; nothing changed.
            InvalidInputError: bad argument; nothing was sent.
        """
        check_name("key", key)
        check_name("owner", owner)
        check_epoch(epoch)
        outcome, _epoch, _server_time = self._call(sql.RELEASE, [key, owner, epoch])
        self._raise_unless_ok(outcome, "release", key, owner, epoch)

    def inspect(self, key: str) -> LeaseState:
        """Return the state of ``key`` at the server clock (lazy expiry). Never raises for an unknown key.

        Advisory only: the state may change right after it is read. Guard actions with the epoch.
        """
        check_name("key", key)
        _key, status, owner, epoch, expires_at, _acquired_at, server_time = self._call(sql.INSPECT, [key])
        return LeaseState(key, status, owner, epoch, expires_at, server_time)

    @staticmethod
    def _raise_unless_ok(outcome: str, operation: str, key: str, owner: str, epoch: int) -> None:
        if outcome == "ok":
            return
        error = LOST_ERRORS[outcome]
        raise error(
            f"cannot {operation} {key!r} as {owner!r} at epoch {epoch}: {outcome}", key=key, owner=owner, epoch=epoch
        )

    def force_release(self, key: str, *, epoch: int | None = None) -> int:
        """Free ``key`` whoever holds it (the operator override); the epoch goes up, fencing the holder.

        For humans and scripts breaking a stuck lease (``manage.py leases release --force``, the
        admin's "Force release" action), never for workers: they release with their own
        ``(owner, epoch)``. Works on held and lapsed leases. Pass the ``epoch`` you looked at so
        that a lease which changed hands since is not freed behind your back.

        Args:
            key: the lease key.
            epoch: release only if this is still the current epoch; None releases any holder.

        Returns:
            The new epoch (the released one plus one).

        Raises:
            AlreadyFreeError: nothing to release: the key is free (``current_epoch`` says its epoch).
            NeverAcquiredError: nothing to release: the key has no row (never acquired, or pruned).
                Both are `NotOwnerError` subclasses.
            EpochMismatchError: ``epoch`` was given and the lease has moved on; ``owner`` is the
                current holder. Look again before releasing.
            InvalidInputError: bad argument; nothing was sent.
        """
        check_name("key", key)
        if epoch is not None:
            check_epoch(epoch)
        outcome, owner, current_epoch, _server_time = self._call(sql.FORCE_RELEASE, [key, epoch])
        if outcome == "ok":
            return current_epoch  # type: ignore[no-any-return]
        if outcome == "epoch_mismatch":
            raise EpochMismatchError(
                f"lease {key!r} has moved on: its epoch is {current_epoch} (held by {owner!r}), not {epoch}",
                key=key,
                owner=owner,
                epoch=epoch,
            )
        if outcome == "not_found":
            raise NeverAcquiredError(
                f"no lease with key {key!r} (never acquired): nothing to release", key=key, epoch=epoch
            )
        raise AlreadyFreeError(
            f"lease {key!r} is already free (epoch {current_epoch}): nothing to release",
            key=key,
            epoch=epoch,
            current_epoch=current_epoch,
        )

    # --- the async API: each method runs its sync twin's rules (validation, result, errors) as is --
    # sync_to_async with thread_sensitive=True (its default), as Django's own async ORM methods use
    # it: the statement runs in Django's thread for sync code (under ASGI the request's), on the
    # connection the caller's other ORM calls use, instead of opening a Django connection in each
    # worker thread of a pool, which nothing would ever close.

    @overload
    async def aacquire(
        self, key: str, owner: str, ttl: Seconds, *, blocking: Literal[False] = False
    ) -> Grant | None: ...
    @overload
    async def aacquire(
        self, key: str, owner: str, ttl: Seconds, *, blocking: Literal[True], timeout: Seconds | None = None
    ) -> Grant: ...
    @overload
    async def aacquire(
        self, key: str, owner: str, ttl: Seconds, *, blocking: bool, timeout: Seconds | None = None
    ) -> Grant | None: ...

    async def aacquire(
        self,
        key: str,
        owner: str,
        ttl: Seconds,
        *,
        blocking: bool = False,
        timeout: Seconds | None = None,
    ) -> Grant | None:
        """Async `acquire`: the same arguments, rules, result and errors.

        Without ``blocking``, the one statement runs the way Django's async ORM methods run theirs:
        in Django's thread for sync code (``sync_to_async``), on the connection the caller's other
        ORM calls use. With ``blocking=True`` the wait holds no thread: the waiter opens a
        connection of its own from the same database settings (named ``pg_lease_django wait
        <owner>`` in ``pg_stat_activity``), makes each attempt and LISTENs on it (or, with
        ``PG_LEASE_LISTEN = False``, sleeps with ``asyncio.sleep``), and closes it when the call
        returns, raises or is cancelled. The grant is committed when the call returns. When the
        caller's connection is in a transaction (``async_to_sync`` within ``atomic()``, or
        ``AUTOCOMMIT`` off) it polls with attempts in that transaction instead, as `acquire` does.

        Args:
            key: the lease key (1-255 UTF-8 bytes, no NUL).
            owner: the caller's identity, unique among concurrent clients.
            ttl: how long the grant lasts without renewal, on the server clock.
            blocking: wait until the key can be acquired instead of returning None.
            timeout: with ``blocking=True``, the longest wait (seconds or timedelta).

        Returns:
            A `Grant`, or None when another owner holds the key (non-blocking only).

        Raises:
            InvalidInputError: bad argument; nothing was sent.
            LeaseTimeoutError: ``blocking=True`` and ``timeout`` passed.
            asyncio.CancelledError: the task was cancelled while waiting; the attempt in flight is
                cancelled on the server and the waiter's connection (and its LISTEN) closed.
        """
        ttl_delta, wait = self._check_acquire(key, owner, ttl, blocking, timeout)
        if not blocking:
            grant, _row = await sync_to_async(self._try_acquire)(key, owner, ttl_delta)
            return grant
        return await self._await_and_acquire(key, owner, ttl_delta, wait)

    async def _await_and_acquire(self, key: str, owner: str, ttl: timedelta, wait: timedelta | None) -> Grant:
        """`_wait_and_acquire` for the event loop: the same attempts and pauses, and no thread held while waiting."""
        deadline = None if wait is None else time.monotonic() + wait.total_seconds()
        own = await sync_to_async(self._own_wait)(owner)
        if own is None:
            # The caller's connection is in a transaction: the grant must belong to it, so the
            # attempts run there (in its thread) and the waiter polls, as acquire() does there. An
            # attempt in flight when the task is cancelled finishes in that thread.
            while True:
                grant, row = await sync_to_async(self._try_acquire)(key, owner, ttl)
                if grant is not None:
                    return grant
                await asyncio.sleep(self._pause_after_refusal(key, owner, row, wait, deadline))
        # Each attempt is sql.ACQUIRE on the waiter's own connection rather than _try_acquire in a
        # thread: a thread cannot be interrupted, so an attempt stuck behind a row lock when the
        # task is cancelled would run on and could commit a grant nobody receives, while psycopg
        # cancels a statement in flight on cancellation and waits for it to end. No thread is
        # taken even for the attempts, and, as in acquire(), LISTEN and attempts share one session:
        # a release committed while an attempt is in flight is queued there, not missed.
        with own.errors:
            conn = await psycopg.AsyncConnection.connect(**own.connect)
            try:
                if own.role:
                    await conn.execute(SQL("SET ROLE {}").format(Identifier(own.role)))
                if own.listen:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                while True:
                    attempt = await (await conn.execute(own.statement, [key, owner, ttl])).fetchone()
                    assert attempt is not None
                    grant = self._granted(key, attempt)
                    if grant is not None:
                        return grant
                    pause = self._pause_after_refusal(key, owner, attempt, wait, deadline)
                    if own.listen:
                        await self._await_release(conn, key, pause)
                    else:
                        await asyncio.sleep(pause)
            finally:
                # Ending the session ends its LISTEN; no statement runs any more (psycopg has already
                # cancelled and waited out one interrupted by a cancellation).
                await conn.close()

    def _own_wait(self, owner: str) -> _OwnWait | None:
        """How a blocking `aacquire` waits on a connection of its own; None when the caller's is in a transaction."""
        connection = self._connection()
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
        return _OwnWait(
            statement=sql.render(connection, sql.ACQUIRE),
            connect=params,
            role=connection.settings_dict["OPTIONS"].get("assume_role"),
            listen=conf.listen_enabled(),
            errors=connection.wrap_database_errors,
        )

    @staticmethod
    async def _await_release(conn: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
        # As _wait_for_release: notifications that arrived during the attempt are yielded first.
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            async with aclosing(conn.notifies(timeout=remaining, stop_after=1)) as notifies:
                async for notify in notifies:
                    if notify.payload == key:
                        return

    async def arenew(self, key: str, owner: str, epoch: int, ttl: Seconds) -> datetime:
        """Async `renew`: the same arguments, result and errors (the statement runs via ``sync_to_async``).

        Returns:
            The new ``expires_at`` (server clock).

        Raises:
            NotOwnerError: the key is unknown, free, or held by another owner.
            LapsedError: ``owner`` held it but it expired; re-acquire to continue.
            EpochMismatchError: ``owner`` holds it under another epoch.
            InvalidInputError: bad argument; nothing was sent.
        """
        return await sync_to_async(self.renew)(key, owner, epoch, ttl)

    async def arelease(self, key: str, owner: str, epoch: int) -> None:
        """Async `release`: the same arguments and errors (the statement runs via ``sync_to_async``).

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: as for `renew`; nothing changed.
            InvalidInputError: bad argument; nothing was sent.
        """
        await sync_to_async(self.release)(key, owner, epoch)

    async def ainspect(self, key: str) -> LeaseState:
        """Async `inspect`: the state of ``key`` at the server clock (the statement runs via ``sync_to_async``).

        Advisory only: the state may change right after it is read. Guard actions with the epoch.
        """
        return await sync_to_async(self.inspect)(key)

    async def aforce_release(self, key: str, *, epoch: int | None = None) -> int:
        """Async `force_release`: the same arguments, result and errors (the statement runs via ``sync_to_async``).

        The operator override, for humans and scripts, never for workers.

        Args:
            key: the lease key.
            epoch: release only if this is still the current epoch; None releases any holder.

        Returns:
            The new epoch (the released one plus one).

        Raises:
            AlreadyFreeError: nothing to release: the key is free (``current_epoch`` says its epoch).
            NeverAcquiredError: nothing to release: the key has no row (never acquired, or pruned).
                Both are `NotOwnerError` subclasses.
            EpochMismatchError: ``epoch`` was given and the lease has moved on; ``owner`` is the
                current holder. Look again before releasing.
            InvalidInputError: bad argument; nothing was sent.
        """
        return await sync_to_async(self.force_release)(key, epoch=epoch)

    def prune(self, *, free_for: Seconds, dry_run: bool = False) -> list[str]:
        """Delete the rows of leases free (released, or lapsed) for at least ``free_for``.

        Rows are otherwise kept forever, so per-object keys (``invoice:{id}``) grow the table without
        bound. A pruned key loses nothing: the database first raises its epoch floor to the highest
        pruned epoch, and a key without a row starts above the floor (`inspect` reports the floor
        for it), so every epoch it is granted again is above every epoch it ever had. Rows locked
        right now are skipped. For operators (``manage.py leases prune``): the SQL function
        ``pg_lease_prune`` is revoked from PUBLIC.

        Args:
            free_for: seconds or a timedelta, from 0 to 3,650 days.
            dry_run: only list the keys that would go.

        Returns:
            The keys pruned (or that would be), sorted.

        Raises:
            InvalidInputError: bad argument; nothing was sent.
        """
        delta = to_timedelta("free_for", free_for, minimum=timedelta(0), maximum=MAX_PRUNE_AGE)
        if not isinstance(dry_run, bool):
            raise InvalidInputError(f"dry_run must be a bool, not {type(dry_run).__name__}")
        connection = self._connection()
        params: list[Any] = [delta, dry_run]
        with connection.cursor() as cursor:
            cursor.execute(sql.render(connection, sql.PRUNE), params)
            return sorted(row[0] for row in cursor.fetchall())
