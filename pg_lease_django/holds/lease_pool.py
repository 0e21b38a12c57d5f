"""The database connections of ``hold()``: one small pool per database alias, per process.

A hold borrows a `LeaseConnection` for each statement it sends, the acquire, each renewal and the
release, and gives it back at once. Only a clean connection goes back: autocommit, no transaction,
no statement in flight, no LISTEN left. One that failed or timed out is closed. At most
``PG_LEASE_HOLD_CONNECTIONS`` idle connections are kept per pool. The heartbeat's scheduler closes
them when no hold is left, and they are closed at exit. Test runs close them explicitly, so that
the test databases can be dropped: `pg_lease_django.testing.LeaseTestRunner` and the pytest plugin
call `close_connections`. This module knows nothing of tests.

A child process never uses its parent's connections. Everything is per process, keyed by
``os.getpid()``, and reset in the child. The inherited connections are kept referenced, never
closed, so the child cannot end its parent's sessions.

The pool holds our own `LeaseConnection` wrappers rather than using ``psycopg_pool``, because the
lease connections must be Django connections. Django's backend maps errors to ``django.db`` errors
and applies ``OPTIONS``, ``assume_role``, the isolation level and the rendering of `sql`;
psycopg_pool cannot hand those out. And what a pool must do here is small: a bounded stack of idle
wrappers, a cleanliness check on return, a pid check, closing at exit. psycopg_pool's background
maintenance threads and its resizing would add threads and connections, not bound them.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from pg_lease_django import conf, operations
from pg_lease_django.operations import Grant

from .lease_connection import InFlight, LeaseConnection, statement_timeout_ms

# Inherited across fork: kept referenced so that their finalizers never end the parent's sessions.
_inherited: list[Any] = []


class LeasePool:
    """The idle lease connections of one database alias and one I/O bound in this process.

    It lends a connection per statement. It prefers one whose session already has the
    statement_timeout the call needs, so that a renewal is one statement. It opens one more while
    fewer than ``size`` are open, and otherwise lends the most recently used. It keeps at most
    ``size`` idle connections.
    """

    def __init__(self, alias: str, io_timeout: float) -> None:
        self.alias = alias
        self.io_timeout = io_timeout
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._idle: list[LeaseConnection] = []
        self._open = 0  # lent + idle

    @contextmanager
    def connection(self, timeout_ms: int | None, call: InFlight | None = None) -> Iterator[LeaseConnection]:
        """Lend a connection for one call; it goes back only if still clean, else it is closed.

        ``call``, when given, may interrupt the call from another thread until it returns.
        """
        conn = self._take(timeout_ms)
        lend = conn.lend()
        if call is not None:
            call.lent(conn, lend)
        try:
            yield conn
        finally:
            if call is not None:
                call.done.set()  # before the connection can be lent again
                if call.interrupted:
                    # An interrupt that saw no statement in flight shut the socket, maybe after the
                    # answer came: the session looks clean and is not. (`InFlight.interrupt` sets
                    # ``interrupted`` before it looks at ``done``, so one of the two sees the other.)
                    conn.discard()
            self._give(conn)

    def acquire(
        self,
        key: str,
        owner: str,
        ttl: timedelta,
        *,
        blocking: bool,
        wait: timedelta | None,
        call: InFlight | None = None,
    ) -> tuple[Grant, float]:
        """`LeaseConnection.acquire` on a lent connection: the grant and when its statement was sent.

        ``call``, when given, may interrupt the acquire from another thread (`InFlight.interrupt`).
        """
        if call is not None:
            call.check()
        with self.connection(None, call) as conn:
            grant = conn.acquire(key, owner, ttl, blocking=blocking, wait=wait, call=call)
            return grant, conn.sent_at

    def renew(
        self, key: str, owner: str, epoch: int, ttl: timedelta, *, timeout: float, call: InFlight | None = None
    ) -> tuple[operations.Renewal, float]:
        """`LeaseConnection.renew` on a lent connection: the `Renewal` and when its statement was sent."""
        with self.connection(statement_timeout_ms(timeout), call) as conn:
            renewal = conn.renew(key, owner, epoch, ttl, timeout=timeout)
            return renewal, conn.sent_at

    def release(self, key: str, owner: str, epoch: int, *, timeout: float, call: InFlight | None = None) -> None:
        """`LeaseConnection.release` on a lent connection."""
        with self.connection(statement_timeout_ms(timeout), call) as conn:
            conn.release(key, owner, epoch, timeout=timeout)

    def settle(self, key: str, owner: str) -> None:
        """`LeaseConnection.settle` on a lent connection: after an acquire interrupted before its grant was received."""
        with self.connection(None) as conn:
            conn.settle(key, owner)

    def open_count(self) -> int:
        """Connections of this pool open now (lent or idle)."""
        with self._lock:
            return self._open

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def close_idle(self) -> None:
        """Close every idle connection (lent ones go on until they come back)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.close()

    def _take(self, timeout_ms: int | None) -> LeaseConnection:
        if self.pid != os.getpid():
            raise RuntimeError("a lease connection pool of the parent process was used in a forked child")
        size = conf.hold_connections()
        with self._lock:
            for index in range(len(self._idle) - 1, -1, -1):
                if self._idle[index].timeout_ms == timeout_ms or self._idle[index].per_transaction:
                    return self._idle.pop(index)
            if self._idle and self._open >= size:
                return self._idle.pop()
            self._open += 1
        try:
            return LeaseConnection(self.alias, io_timeout=self.io_timeout)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def _give(self, conn: LeaseConnection) -> None:
        if conn.pid != os.getpid():
            return  # lent before a fork, returned in the child: the parent's, never touched here
        kept = False
        if conn.clean():
            with self._lock:
                if len(self._idle) < conf.hold_connections():
                    self._idle.append(conn)
                    kept = True
        if not kept:
            with self._lock:
                self._open -= 1
            conn.close()


_pools: dict[tuple[str, int], LeasePool] = {}
_pools_lock = threading.Lock()
_pools_pid = os.getpid()
_hooks_registered = False


def pool_for(alias: str, *, io_timeout: float) -> LeasePool:
    """The pool of ``alias`` in this process for calls that must fail within about ``io_timeout`` on a dead network."""
    bound = max(1, math.ceil(io_timeout))  # holds with the same whole-second bound share connections
    with _pools_lock:
        if _pools_pid != os.getpid():
            _after_fork_in_child()
        _register_process_hooks()
        pool = _pools.get((alias, bound))
        if pool is None:
            pool = _pools[(alias, bound)] = LeasePool(alias, float(bound))
        return pool


def close_connections() -> None:
    """Close the idle lease connections of every pool of this process.

    Called at exit, by the heartbeat's scheduler once no hold is left, and by test runs before they
    drop the test databases (DROP DATABASE fails while any session is connected).
    """
    with _pools_lock:
        pools = list(_pools.values()) if _pools_pid == os.getpid() else []
    for pool in pools:
        pool.close_idle()


def open_connections() -> int:
    """How many lease connections this process has open (lent or idle)."""
    with _pools_lock:
        pools = list(_pools.values()) if _pools_pid == os.getpid() else []
    return sum(pool.open_count() for pool in pools)


def _after_fork_in_child() -> None:
    # The child starts with no pool: its holds get their own. The parent's connections stay
    # referenced (never closed, never finalized) so the child cannot end them.
    global _pools_pid
    _inherited.extend(_pools.values())
    _pools.clear()
    _pools_pid = os.getpid()


def _at_fork_child() -> None:
    global _pools_lock
    _pools_lock = threading.Lock()  # a lock held by another thread at fork time stays held in the child
    _after_fork_in_child()


def _register_process_hooks() -> None:
    # With the first pool, not at import: a process that never holds a lease gets no hook.
    # Called under _pools_lock.
    global _hooks_registered
    if not _hooks_registered:
        _hooks_registered = True
        os.register_at_fork(after_in_child=_at_fork_child)
        atexit.register(close_connections)
