"""The renewal side of ``hold()``: a connection of the lease's own, and the thread that renews on it.

Nothing here is public API; `pg_lease_django.jobs` is. The thread reports to its `HeldLease` only
through the few members that class sets apart for the heartbeat and the hold.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any, Literal

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend
from psycopg import IsolationLevel

from . import operations, waiting
from .exceptions import HeartbeatFailedError, LeaseLostError
from .held import HeldLease
from .operations import Grant

logger = logging.getLogger(__name__)

#: Longest pause between two attempts after a failed renewal (the first retry is after 50 ms).
MAX_RETRY_DELAY = 2.0

Outcome = Literal["freed", "kept", "gone", "unknown"]


class LeaseConnection:
    """A database connection that belongs to one hold: never the job's, never pooled.

    A private copy of the alias's settings: Django's connection pool (``OPTIONS["pool"]``) is left
    out, the session is named ``pg_lease_django <owner>`` in ``pg_stat_activity``, and TCP
    keepalives and ``tcp_user_timeout`` bound how long a dead network can hang a call (unless the
    settings choose otherwise). Usable from several threads, one call at a time.
    """

    def __init__(self, alias: str, *, owner: str, io_timeout: float) -> None:
        source = connections[alias].settings_dict  # the test database's name during tests
        options: dict[str, Any] = dict(source.get("OPTIONS") or {})
        settings = {**source, "OPTIONS": options, "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False, "CONN_MAX_AGE": 0}
        options.pop("pool", None)
        # The lease functions assume READ COMMITTED (spec 8): under a stricter default a contended
        # acquire would fail with a serialization error instead of being refused.
        options["isolation_level"] = IsolationLevel.READ_COMMITTED
        options["application_name"] = f"pg_lease_django {owner}"[:63]
        whole = max(1, math.ceil(io_timeout))
        options.setdefault("connect_timeout", max(2, whole))
        options.setdefault("keepalives", 1)
        options.setdefault("keepalives_idle", whole)
        options.setdefault("keepalives_interval", whole)
        options.setdefault("keepalives_count", 3)
        options.setdefault("tcp_user_timeout", max(1000, int(io_timeout * 1000)))
        self.wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias)
        # Acquired in the caller's thread, renewed and released in the heartbeat thread.
        self.wrapper.inc_thread_sharing()
        #: time.monotonic() just before the last statement was sent.
        self.sent_at = 0.0
        self._lock = threading.Lock()

    def acquire(self, key: str, owner: str, ttl: timedelta, *, blocking: bool, wait: timedelta | None) -> Grant:
        """One acquire (or a blocking wait of at most ``wait``) in autocommit: the grant is committed when this returns.

        Raises:
            NotAcquirableError: not blocking, and another owner holds the key (named in the error).
        """
        with self._lock:
            try:
                if blocking:
                    return waiting.wait_and_acquire(self.wrapper, key, owner, ttl, wait, before_attempt=self._sending)
                self._sending()
                return operations.acquire_or_raise(self.wrapper, key, owner, ttl)
            except BaseException:
                self._discard()
                raise

    def renew(self, key: str, owner: str, epoch: int, ttl: timedelta, *, timeout: float) -> datetime:
        """Renew, giving up server-side after ``timeout`` seconds (statement_timeout)."""
        with self._lock, self._bounded(timeout):
            self._sending()
            return operations.renew(self.wrapper, key, owner, epoch, ttl)

    def release(self, key: str, owner: str, epoch: int, *, timeout: float) -> None:
        """Release ``(owner, epoch)`` only, giving up server-side after ``timeout`` seconds."""
        with self._lock, self._bounded(timeout):
            self._sending()
            operations.release(self.wrapper, key, owner, epoch)

    def close(self) -> None:
        """Close the connection for good."""
        with self._lock:
            self._discard()
            with suppress(RuntimeError):
                self.wrapper.dec_thread_sharing()

    def backend_pid(self) -> int | None:
        """The server process of the open session, or None."""
        raw = self.wrapper.connection
        return None if raw is None or raw.closed else int(raw.info.backend_pid)

    def _sending(self) -> None:
        # The trust window starts just before the statement that succeeds is sent: the server's
        # grant or renewal happens after this instant, so its expiry is at least this + TTL.
        self.sent_at = time.monotonic()

    @contextmanager
    def _bounded(self, seconds: float) -> Iterator[None]:
        # SET LOCAL (set_config(..., true)) in a transaction of its own: the timeout cannot leak
        # into a pooled server session behind PgBouncer in transaction mode, as a plain SET would.
        # On any failure the connection is dropped: its state is unknown (a terminated backend, a
        # cancelled statement, a half-sent query); the next call reconnects.
        wrapper = self.wrapper
        try:
            wrapper.set_autocommit(False)
            with wrapper.cursor() as cursor:
                cursor.execute(
                    "SELECT set_config('statement_timeout', %s, true)", [f"{max(1, math.ceil(seconds * 1000))}ms"]
                )
            yield
            wrapper.commit()
            wrapper.set_autocommit(True)
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        try:
            self.wrapper.close()
        except Exception:
            logger.debug("closing a lease connection failed", exc_info=True)
            self.wrapper.connection = None


class Heartbeat(threading.Thread):
    """Renews one lease every ``interval`` seconds on its own connection, then releases it.

    Sleeps on an Event. A transient failure (connection lost, server restarting, statement timeout,
    anything but a verdict) is logged and retried with a fresh connection; only a verdict
    (``not_owner``, ``lapsed``, ``epoch_mismatch``) or the end of the trust window declares the lease
    lost. When told to stop, it makes the last move (release, or keep until ``hold_at_least``) and
    closes its connection, whatever happened.
    """

    def __init__(self, lease: HeldLease, connection: LeaseConnection, *, ttl: timedelta, interval: float) -> None:
        super().__init__(name=f"pg_lease heartbeat {lease.key}"[:100], daemon=True)
        self.lease = lease
        self.connection = connection
        self.ttl = ttl
        self.interval = interval
        self.outcome: Outcome = "unknown"
        self._stop_requested = threading.Event()
        self._keep_until: float | None = None

    def stop(self, *, keep_until: float | None = None) -> None:
        """Ask the thread to finish: release, or (``keep_until``, a monotonic instant) keep until then."""
        self._keep_until = keep_until
        self._stop_requested.set()

    def run(self) -> None:
        lease = self.lease
        try:
            try:
                self._beat()
            except BaseException as exc:
                logger.exception("heartbeat of lease %r crashed; treating the lease as lost", lease.key)
                crashed = HeartbeatFailedError(
                    f"heartbeat of lease {lease.key!r} crashed ({exc!r}); no more renewals",
                    key=lease.key,
                    owner=lease.owner,
                    epoch=lease.epoch,
                )
                crashed.__cause__ = exc
                lease._declare_lost(crashed, definitive=False)
            self._stop_requested.wait()
            self.outcome = self._finish()
        except BaseException:
            logger.exception("ending the hold of lease %r failed; it lapses at its expiry", lease.key)
        finally:
            self.connection.close()
            # Django connections this thread opened (an on_lost callback or a lease_lost receiver
            # that queried the database) are this thread's to close.
            connections.close_all()

    def _beat(self) -> None:
        lease = self.lease
        next_at = lease._granted_at + self.interval
        failures = 0
        while not self._stop_requested.is_set():
            now = time.monotonic()
            trusted_until = lease._trusted_until
            if now >= trusted_until:
                lease._lose_trust()
                return
            if self._stop_requested.wait(min(next_at, trusted_until) - now):
                return
            if time.monotonic() < next_at:
                continue  # woke for the trust deadline: the loop top decides
            timeout = min(self.interval, lease._trusted_until - time.monotonic())
            if timeout <= 0:
                continue
            try:
                expires_at = self.connection.renew(lease.key, lease.owner, lease.epoch, self.ttl, timeout=timeout)
            except LeaseLostError as exc:
                lease._declare_lost(exc, definitive=True)
                return
            except Exception:
                failures += 1
                delay = min(self.interval, MAX_RETRY_DELAY, 0.05 * 2 ** min(failures - 1, 10))
                logger.warning(
                    "renewing lease %r failed (attempt %d); retrying in %.2fs until the trust window ends",
                    lease.key,
                    failures,
                    delay,
                    exc_info=True,
                )
                next_at = time.monotonic() + delay
                continue
            if failures:
                logger.info("renewed lease %r after %d failed attempts", lease.key, failures)
            failures = 0
            sent_at = self.connection.sent_at
            if not lease._renewed(expires_at, sent_at):
                return  # the answer came after the trust window ended: lost all the same
            next_at = sent_at + self.interval

    def _finish(self) -> Outcome:
        lease = self.lease
        if lease._gone:
            return "gone"  # the server said it is not ours: nothing to release
        keep_until = self._keep_until
        if keep_until is not None and not lease.lost:
            remaining = keep_until - time.monotonic()
            if remaining >= 0.001:
                return self._keep(remaining)
        for attempt in (1, 2):
            try:
                self.connection.release(lease.key, lease.owner, lease.epoch, timeout=max(self.interval, 1.0))
            except LeaseLostError as exc:
                lease._declare_lost(exc, definitive=True)  # lost unnoticed (a no-op if already known)
                return "gone"
            except Exception:
                if attempt == 2:
                    logger.warning(
                        "releasing lease %r failed; it lapses at its expiry (%s)",
                        lease.key,
                        lease.expires_at,
                        exc_info=True,
                    )
                    return "unknown"
                continue
            return "freed"
        return "unknown"  # pragma: no cover

    def _keep(self, remaining: float) -> Outcome:
        # Renew to exactly the time left, under our (owner, epoch): the lease then lapses on its own
        # at grant + hold_at_least. A renewal can shorten a lease as well as extend it.
        lease = self.lease
        try:
            expires_at = self.connection.renew(
                lease.key, lease.owner, lease.epoch, timedelta(seconds=remaining), timeout=max(self.interval, 1.0)
            )
        except LeaseLostError as exc:
            lease._declare_lost(exc, definitive=True)
            return "gone"
        except Exception:
            logger.warning(
                "keeping lease %r until hold_at_least failed; it lapses at its expiry (%s)",
                lease.key,
                lease.expires_at,
                exc_info=True,
            )
            return "unknown"
        lease.expires_at = expires_at
        return "kept"
