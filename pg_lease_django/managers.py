"""LeaseManager: the operations on the caller's connection, each one call of a SQL function in one round trip.

The statements and their results are `pg_lease_django.operations`; the blocking wait is
`pg_lease_django.wait`. This module checks the arguments and picks the connection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal, TypeVar, overload

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, models, router
from django.db.backends.base.base import BaseDatabaseWrapper

from . import manager_calls, operations
from .exceptions import InvalidInputError, LeaseLostError
from .holds import lease_calls
from .metrics import hooks as metrics
from .operations import Attempt, EpochAdvance, Grant, HandoffRequest, LeaseState
from .sql import NOTIFY_CHANNEL
from .validation import (
    MAX_PRUNE_AGE,
    Seconds,
    check_advance,
    check_epoch,
    check_name,
    check_ttl,
    check_wait,
    to_timedelta,
)
from .wait import async_driver, sync_driver

if TYPE_CHECKING:
    from .models import Lease  # noqa: F401  (named in the Manager["Lease"] base)

T = TypeVar("T")

__all__ = ["NOTIFY_CHANNEL", "EpochAdvance", "Grant", "LeaseManager", "LeaseState"]


class LeaseManager(models.Manager["Lease"]):
    """Acquire, renew, release and inspect leases.

    Every method is one SQL statement in one round trip, except a blocking acquire, which repeats
    its one-statement attempt and LISTENs between attempts outside ``atomic()``. Outside
    ``atomic()`` each statement commits on its own; inside, it rolls back with the caller's
    transaction. ``Lease.objects.db_manager(alias)`` picks another database than the router's.

    Each operation but `prune` and `advance_epochs` has an awaitable twin for async code, with the
    same arguments, rules, results and errors: `aacquire`, `arenew`, `arelease`, `ainspect`,
    `aforce_release` and `arequest_handoff`.
    """

    def _alias(self) -> str:
        return self._db or (router.db_for_write(self.model) if router.routers else DEFAULT_DB_ALIAS)

    def _connection(self) -> BaseDatabaseWrapper:
        return operations.require_postgresql(connections[self._alias()])

    def _on_callers(self, call: Callable[[BaseDatabaseWrapper], T]) -> T:
        return call(self._connection())

    async def _arun(self, call: Callable[[BaseDatabaseWrapper], T]) -> T:
        """``call`` on the connection an async call uses. In a transaction it is the caller's, in
        Django's thread for sync code, since the statement is the transaction's. Otherwise it is one
        of the lease pool's, in a thread of the package's own (`holds.lease_calls`)."""
        alias = self._alias()
        if await lease_calls.in_transaction(alias):
            return await sync_to_async(self._on_callers)(call)
        return await lease_calls.call(alias, call)

    async def _aattempt(
        self,
        alias: str,
        in_transaction: bool,
        key: str,
        owner: str,
        ttl: timedelta,
        blocking: bool,
        wait: timedelta | None,
    ) -> Attempt:
        """One acquire attempt of an async call, where `_arun` says. Cancelled in flight outside a
        transaction, it is settled by `holds.lease_calls.attempt`; inside one it is the transaction's.
        The first try of a blocking one waits for a lock ``wait`` at most, its whole deadline."""
        if in_transaction:
            if blocking:
                return await sync_to_async(self._on_callers)(
                    lambda c: operations.attempt_within(c, key, owner, ttl, wait)
                )
            return await sync_to_async(self._on_callers)(lambda c: operations.attempt(c, key, owner, ttl))
        return await lease_calls.attempt(alias, key, owner, ttl, blocking=blocking, within=wait)

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
        """Acquire ``key`` for ``owner`` for ``ttl``, given in seconds or as a timedelta.

        Granted when the key is free, lapsed, or already held by ``owner``. That last is a
        self-takeover: the grant has a new epoch, which fences the owner's earlier incarnation.

        Args:
            key: the lease key, 1-255 UTF-8 bytes with no NUL.
            owner: the caller's identity, unique among concurrent clients.
            ttl: how long the grant lasts without renewal, on the server clock.
            blocking: wait until the key can be acquired instead of returning None.
            timeout: with ``blocking=True``, the longest wait, in seconds or as a timedelta.

        Returns:
            A `Grant`, or None when another owner holds the key; None only when not blocking.

        Raises:
            InvalidInputError: bad argument; nothing was sent.
            LeaseTimeoutError: ``blocking=True`` and ``timeout`` passed.
            UnconfirmedCommitError: the grant committed on the primary, but the synchronous standby did
                not confirm it, so its outcome is unknown; it is a ``django.db.OperationalError``. With
                ``blocking=True`` the waiter released it first. Act on no grant: acquire again.
        """
        ttl_delta, wait = self._check_acquire(key, owner, ttl, blocking, timeout)
        if not blocking:
            return manager_calls.acquire_once(self._connection(), key, owner, ttl_delta)
        return sync_driver.wait_and_acquire(self._connection(), key, owner, ttl_delta, wait)

    @staticmethod
    def _check_acquire(
        key: str, owner: str, ttl: Seconds, blocking: bool, timeout: Seconds | None
    ) -> tuple[timedelta, timedelta | None]:
        """The argument rules of `acquire` and `aacquire`: the TTL and the wait bound, or InvalidInputError."""
        check_name("key", key)
        check_name("owner", owner)
        ttl_delta = check_ttl(ttl)
        return ttl_delta, check_wait(blocking, timeout, key=key, owner=owner)

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
        return self._renew(key, owner, epoch, ttl)(self._connection())

    @staticmethod
    def _renew(key: str, owner: str, epoch: int, ttl: Seconds) -> Callable[[BaseDatabaseWrapper], datetime]:
        """`renew` on a connection, its arguments checked now."""
        check_name("key", key)
        check_name("owner", owner)
        check_epoch(epoch)
        ttl_delta = check_ttl(ttl)

        def renew(connection: BaseDatabaseWrapper) -> datetime:
            try:
                return operations.renew(connection, key, owner, epoch, ttl_delta).expires_at
            except LeaseLostError as exc:
                metrics.lost(key, exc.code)  # a hold's losses are counted from its lease_lost signal
                raise

        return renew

    def release(self, key: str, owner: str, epoch: int) -> None:
        """Free a live lease held by ``(owner, epoch)``; the epoch goes up, fencing the holder.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: as for `renew`; nothing changed.
            InvalidInputError: bad argument; nothing was sent.
        """
        self._release(key, owner, epoch)(self._connection())

    @staticmethod
    def _release(key: str, owner: str, epoch: int) -> Callable[[BaseDatabaseWrapper], None]:
        """`release` on a connection, its arguments checked now."""
        check_name("key", key)
        check_name("owner", owner)
        check_epoch(epoch)

        def release(connection: BaseDatabaseWrapper) -> None:
            try:
                manager_calls.release_once(connection, key, owner, epoch)
            except LeaseLostError as exc:
                metrics.lost(key, exc.code)
                raise

        return release

    def inspect(self, key: str) -> LeaseState:
        """Return the state of ``key`` at the server clock (lazy expiry). Never raises for an unknown key.

        Advisory only: the state may change right after it is read. Guard actions with the epoch.
        """
        return self._inspect(key)(self._connection())

    @staticmethod
    def _inspect(key: str) -> Callable[[BaseDatabaseWrapper], LeaseState]:
        check_name("key", key)
        return lambda connection: operations.inspect(connection, key)

    def force_release(self, key: str, *, epoch: int | None = None, operator: str | None = None) -> int:
        """Free ``key`` whoever holds it, the operator's override; the epoch goes up, fencing the holder.

        For humans and scripts breaking a stuck lease, such as ``manage.py leases release --force``
        and the admin's "Force release" action. Never for workers: they release with their own
        owner and epoch. Works on held and lapsed leases. Pass the ``epoch`` you looked at so
        that a lease which changed hands since is not freed behind your back.

        Args:
            key: the lease key.
            epoch: release only if this is still the current epoch; None releases any holder.
            operator: who forces it, recorded in the lease's history; None records the database role.

        Returns:
            The new epoch, the released one plus one.

        Raises:
            AlreadyFreeError: nothing to release: the key is free; ``current_epoch`` says its epoch.
            NeverAcquiredError: nothing to release: the key has no row, never acquired or pruned.
            EpochMovedOnError: ``epoch`` was given and the lease has moved on; ``holder`` and
                ``current_epoch`` are the key's now. Look again before releasing.
                All three are `OperatorRefusalError`: nothing changed, and nothing to stop.
            InvalidInputError: bad argument; nothing was sent.
        """
        return self._force_release(key, epoch, operator)(self._connection())

    @staticmethod
    def _force_release(key: str, epoch: int | None, operator: str | None) -> Callable[[BaseDatabaseWrapper], int]:
        check_name("key", key)
        if epoch is not None:
            check_epoch(epoch)
        if operator is not None:
            check_name("operator", operator)
        return lambda connection: operations.force_release(connection, key, epoch, operator)

    def request_handoff(self, key: str, *, epoch: int | None = None) -> HandoffRequest:
        """Ask the holder of ``key`` to step down at its next safe point, as a rolling deploy's hand-over.

        Advice, never a force: the lease stays granted. A ``hold()`` learns of it at its next renewal,
        within its renew interval of ``ttl / 3`` by default, and exposes it as
        ``lease.handoff_requested``; ``elect()`` steps down, releasing the lease to the next campaigner.
        A holder that ignores it keeps its lease; its release is recorded as ``handed_off``. Any new
        grant clears the request. Asking again is harmless: ``requested_at`` stays the first request's.

        Args:
            key: the lease key.
            epoch: ask only if this is still the current epoch, the holder you looked at.

        Returns:
            The `HandoffRequest`: who was asked, at which epoch, since when.

        Raises:
            NeverAcquiredError: the key has no row; AlreadyFreeError: it is free; AlreadyLapsedError:
                it lapsed. Nobody holds it to ask: acquire it instead.
            EpochMovedOnError: ``epoch`` was given and the lease has moved on.
                All four are `OperatorRefusalError`: nothing changed.
            InvalidInputError: bad argument; nothing was sent.
        """
        return self._request_handoff(key, epoch)(self._connection())

    @staticmethod
    def _request_handoff(key: str, epoch: int | None) -> Callable[[BaseDatabaseWrapper], HandoffRequest]:
        check_name("key", key)
        if epoch is not None:
            check_epoch(epoch)
        return lambda connection: operations.request_handoff(connection, key, epoch)

    async def arequest_handoff(self, key: str, *, epoch: int | None = None) -> HandoffRequest:
        """Async `request_handoff`: the same arguments, result and errors (where `aacquire` says)."""
        return await self._arun(self._request_handoff(key, epoch))

    # --- the async API: each method runs its sync twin's rules (validation, result, errors) as is --
    # Outside a transaction, on a connection of the lease pool hold() uses, in a thread of the
    # package's own (holds.lease_calls): no call waits behind another, and no Django connection is
    # opened in a thread where nothing would close it. Inside the caller's transaction, on the
    # caller's connection in Django's thread for sync code (sync_to_async), as Django's async ORM does.

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

        The one statement runs on a connection of the lease pool ``hold()`` uses, in a thread of the
        package's own: no call waits behind another. With ``blocking=True`` the first try is made so
        too; only when it is refused does the wait begin, holding no thread. The waiter opens a
        connection of its own from the same database settings, named ``pg_lease_django wait
        <owner>`` in ``pg_stat_activity``. It makes each attempt and LISTENs on it, or sleeps with
        ``asyncio.sleep`` when ``PG_LEASE_LISTEN = False``, and closes it when the call returns,
        raises or is cancelled. The grant is committed when the call returns. When the caller's
        connection is in a transaction, as with ``async_to_sync`` within ``atomic()`` or with
        ``AUTOCOMMIT`` off, the attempts run in that transaction instead, in Django's thread for
        sync code, and a waiter polls, as `acquire` does.

        Args:
            key: the lease key, 1-255 UTF-8 bytes with no NUL.
            owner: the caller's identity, unique among concurrent clients.
            ttl: how long the grant lasts without renewal, on the server clock.
            blocking: wait until the key can be acquired instead of returning None.
            timeout: with ``blocking=True``, the longest wait, in seconds or as a timedelta.

        Returns:
            A `Grant`, or None when another owner holds the key; None only when not blocking.

        Raises:
            InvalidInputError: bad argument; nothing was sent.
            LeaseTimeoutError: ``blocking=True`` and ``timeout`` passed.
            UnconfirmedCommitError: the grant committed on the primary, but the synchronous standby did
                not confirm it, so its outcome is unknown; it is a ``django.db.OperationalError``. With
                ``blocking=True`` the waiter released it first. Act on no grant: acquire again.
            asyncio.CancelledError: the task was cancelled while waiting; the attempt in flight is
                cancelled on the server and the waiter's connection closed, its LISTEN with it.
        """
        ttl_delta, wait = self._check_acquire(key, owner, ttl, blocking, timeout)
        alias = self._alias()
        in_transaction = await lease_calls.in_transaction(alias)
        first_try = functools.partial(self._aattempt, alias, in_transaction, key, owner, ttl_delta, blocking, wait)
        if not blocking:
            return operations.answer(key, await first_try())
        return await async_driver.await_and_acquire(
            self._connection, alias, key, owner, ttl_delta, wait, first_try=first_try, in_transaction=in_transaction
        )

    async def arenew(self, key: str, owner: str, epoch: int, ttl: Seconds) -> datetime:
        """Async `renew`: the same arguments, result and errors (where `aacquire` says).

        Returns:
            The new ``expires_at``, on the server clock.

        Raises:
            NotOwnerError: the key is unknown, free, or held by another owner.
            LapsedError: ``owner`` held it but it expired; re-acquire to continue.
            EpochMismatchError: ``owner`` holds it under another epoch.
            InvalidInputError: bad argument; nothing was sent.
        """
        return await self._arun(self._renew(key, owner, epoch, ttl))

    async def arelease(self, key: str, owner: str, epoch: int) -> None:
        """Async `release`: the same arguments and errors (where `aacquire` says).

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: as for `renew`; nothing changed.
            InvalidInputError: bad argument; nothing was sent.
        """
        await self._arun(self._release(key, owner, epoch))

    async def ainspect(self, key: str) -> LeaseState:
        """Async `inspect`: the state of ``key`` at the server clock (where `aacquire` says).

        Advisory only: the state may change right after it is read. Guard actions with the epoch.
        """
        return await self._arun(self._inspect(key))

    async def aforce_release(self, key: str, *, epoch: int | None = None, operator: str | None = None) -> int:
        """Async `force_release`, the operator's override and never for workers: the same arguments,
        result and errors, run where `aacquire` says."""
        return await self._arun(self._force_release(key, epoch, operator))

    def prune(self, *, free_for: Seconds, dry_run: bool = False) -> list[str]:
        """Delete the rows of leases free for at least ``free_for``, released or lapsed.

        Rows are otherwise kept forever, so per-object keys such as ``invoice:{id}`` grow the table
        without bound. A pruned key loses nothing: the database first raises its epoch floor to the
        highest pruned epoch, and a key without a row starts above the floor, which `inspect`
        reports for it. So every epoch it is granted again is above every epoch it ever had. Rows
        locked right now are skipped. For operators, as ``manage.py leases prune``: the SQL function
        ``pg_lease_prune`` is revoked from PUBLIC.

        Args:
            free_for: seconds or a timedelta, from 0 to 3,650 days.
            dry_run: only list the keys that would go.

        Returns:
            The keys pruned, or that would be, sorted.

        Raises:
            InvalidInputError: bad argument; nothing was sent.
        """
        delta = to_timedelta("free_for", free_for, minimum=timedelta(0), maximum=MAX_PRUNE_AGE)
        if not isinstance(dry_run, bool):
            raise InvalidInputError(f"dry_run must be a bool, not {type(dry_run).__name__}")
        return operations.prune(self._connection(), delta, dry_run)

    def advance_epochs(self, *, by: int, dry_run: bool = False) -> EpochAdvance:
        """Raise the epoch of every lease, and the epoch floor, by ``by``, in one transaction.

        The remedy for a failover to a standby of asynchronous replication that may have missed
        acknowledged lease writes. Run it on the promoted server before the application reconnects,
        with ``by`` above the number of grants per key the lost primary could have made since the
        last replicated point, as docs/high-availability.md explains. Then every later grant of any
        key, pruned ones included, is above every grant the lost primary acknowledged.

        Holders keep their lease until its expiry, and nobody else gets the key meanwhile, but at an
        epoch nobody was granted: their renewals, releases and fenced writes are refused with
        `EpochMismatchError`, and they re-acquire to go on. For operators, as ``manage.py leases
        advance-epochs``: the SQL function ``pg_lease_advance_epochs`` is revoked from PUBLIC.

        Args:
            by: a whole number from 1 to `MAX_ADVANCE`, which is 2**62.
            dry_run: only report what it would do.

        Returns:
            An `EpochAdvance`: the rows advanced, how many were held, the new floor and highest epoch.

        Raises:
            InvalidInputError: bad argument, and nothing was sent; or an epoch or the floor would pass
                `MAX_ADVANCE`, and nothing was changed.
        """
        check_advance(by)
        if not isinstance(dry_run, bool):
            raise InvalidInputError(f"dry_run must be a bool, not {type(dry_run).__name__}")
        return operations.advance_epochs(self._connection(), by, dry_run)
