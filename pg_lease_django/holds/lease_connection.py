"""One database connection of ``hold()``, and a statement on it that another thread may interrupt.

`LeaseConnection` is a private Django connection for the lease's statements. It is never the
job's and never in Django's pool. It is bounded against a dead network, and it settles an acquire
or release that was interrupted in flight. `lease_pool` lends them, one per statement.
`InFlight` is a statement on one, which another thread may interrupt.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend
from psycopg import IsolationLevel
from psycopg.pq import TransactionStatus

from pg_lease_django import conf, operations
from pg_lease_django.exceptions import LeaseLostError, NotAcquirableError
from pg_lease_django.operations import Grant
from pg_lease_django.sql import run, statements
from pg_lease_django.sql.confirmation import confirmed_commit
from pg_lease_django.wait import settling, sync_driver

logger = logging.getLogger(__name__)

#: ``application_name`` of every lease connection of ``hold()`` in ``pg_stat_activity``.
APPLICATION_NAME = "pg_lease_django hold"


class InFlight:
    """One statement of a hold on a lent connection: what another thread may interrupt (`interrupt`).

    ``done`` is set when the statement has returned, before its connection goes back to the pool.
    """

    def __init__(self) -> None:
        self.done = threading.Event()
        self.interrupted = False
        self._conn: LeaseConnection | None = None
        self._lend = 0

    def lent(self, conn: LeaseConnection, lend: int) -> None:
        self._conn, self._lend = conn, lend

    def interrupt(self, *, grace: float) -> None:
        """Cancel the statement, then shut its socket if it still has not returned; this blocks up to ``grace`` s.

        It also works before the call is lent or between a blocking wait's attempts: an acquire checks
        ``interrupted`` before each attempt, through `check`.
        """
        if self.done.is_set():
            return
        self.interrupted = True
        conn = self._conn
        if conn is None:
            return
        conn.interrupt(self._lend, self.done, grace=grace)

    def check(self) -> None:
        """Raise `AcquireInterrupted` once `interrupt` was called (before an attempt is sent)."""
        if self.interrupted:
            raise AcquireInterrupted("the acquire was interrupted")


class AcquireInterrupted(Exception):
    """An acquire of ``hold()`` was interrupted from another thread (`InFlight.interrupt`): nothing is held."""


def statement_timeout_ms(seconds: float) -> int:
    """Whole milliseconds for ``statement_timeout``, at least 1 (0 would mean none)."""
    return max(1, math.ceil(seconds * 1000))


def _shut(raw: Any) -> None:
    # Shut the socket down under the call blocked on it: it fails at once (the connection is then
    # discarded by the call's own error handling); the server's session notices and ends.
    with suppress(Exception), socket.socket(fileno=os.dup(raw.pgconn.socket)) as sock:
        sock.shutdown(socket.SHUT_RDWR)


class LeaseConnection:
    """A database connection of ``hold()``: never the job's, never Django's pool; lent by a `LeasePool`.

    It uses a private copy of the alias's settings. Django's connection pool, ``OPTIONS["pool"]``, is
    left out. The session is named ``pg_lease_django hold`` in ``pg_stat_activity``. TCP keepalives
    and ``tcp_user_timeout`` bound how long a dead network can hang a call, unless the settings choose
    otherwise. One thread at a time uses it, since the pool lends it to one borrower.

    Every renewal and release is bounded server-side by ``statement_timeout``. Directly connected,
    the timeout is a session setting, set only when it differs from what the session has, and the
    call runs alone in autocommit: one statement, one round trip. Behind a transaction pooler, with
    ``PG_LEASE_LISTEN = False`` as docs/installation.md explains, a session setting would stay on
    whichever server session PgBouncer lent, or be lost. There the timeout is ``SET LOCAL`` in a
    transaction of its own around the call, as before.
    """

    def __init__(self, alias: str, *, io_timeout: float) -> None:
        source = operations.require_postgresql(connections[alias]).settings_dict  # the test database's name in tests
        options: dict[str, Any] = dict(source.get("OPTIONS") or {})
        settings = {**source, "OPTIONS": options, "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False, "CONN_MAX_AGE": 0}
        options.pop("pool", None)
        # The lease functions assume READ COMMITTED (spec 8): under a stricter default a contended
        # acquire would fail with a serialization error instead of being refused.
        options["isolation_level"] = IsolationLevel.READ_COMMITTED
        options["application_name"] = APPLICATION_NAME
        whole = max(1, math.ceil(io_timeout))
        options.setdefault("connect_timeout", max(2, whole))
        options.setdefault("keepalives", 1)
        options.setdefault("keepalives_idle", whole)
        options.setdefault("keepalives_interval", whole)
        options.setdefault("keepalives_count", 3)
        options.setdefault("tcp_user_timeout", max(1000, int(io_timeout * 1000)))
        self.wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias)
        # Lent to the thread that enters a hold, to renewal workers and to the thread that exits it.
        self.wrapper.inc_thread_sharing()
        self.pid = os.getpid()
        #: Behind a transaction pooler: no session state, SET LOCAL per renewal.
        self.per_transaction = not conf.listen_enabled()
        #: The session's statement_timeout in ms as we set it; None: the session's default.
        self.timeout_ms: int | None = None
        #: time.monotonic() just before the last statement was sent.
        self.sent_at = 0.0
        #: Serialises `interrupt` with lending and closing (see there); `_lends` counts the lendings.
        self._guard = threading.Lock()
        self._lends = 0

    def acquire(
        self,
        key: str,
        owner: str,
        ttl: timedelta,
        *,
        blocking: bool,
        wait: timedelta | None,
        call: InFlight | None = None,
    ) -> Grant:
        """One acquire, or a blocking wait of at most ``wait``, in autocommit: the grant is committed when this returns.

        It runs under the session's default statement_timeout, as Django's own connections do. An
        interruption is any exception but a refusal. It may be raised in this thread by a signal handler,
        or come from ``call.interrupt()`` in another thread. It cancels the attempt in flight on the
        server and settles it before it goes on: `settling.settle` releases a grant the attempt committed.

        Raises:
            NotAcquirableError: not blocking, and another owner holds the key, named in the error.
            AcquireInterrupted: ``call`` was interrupted before an attempt was sent.
        """
        attempts = 0

        def interrupted() -> bool:
            return call is not None and call.interrupted

        def sending() -> None:
            nonlocal attempts
            attempts += 1
            if call is not None:
                call.check()
            self._sending()

        try:
            self.reset_timeout()
            if blocking:
                grant = sync_driver.wait_and_acquire(
                    self.wrapper, key, owner, ttl, wait, before_attempt=sending, interrupted=interrupted
                )
                if attempts > 1 and conf.listen_enabled():
                    try:
                        self._check_not_listening()  # waiting UNLISTENs on every way out: make sure
                    except BaseException:
                        # The grant will not be returned (an interrupt, a LISTEN left): it is nobody's.
                        settling.settle(self.wrapper, key, owner, None)
                        raise
                return grant
            in_flight = settling.attempt_in_flight(self.wrapper)
            sending()
            try:
                return operations.acquire_or_raise(self.wrapper, key, owner, ttl, in_flight.marker)
            except NotAcquirableError:
                raise
            except BaseException as exc:
                # The blocking wait settles its own. A lost connection is not settled (no server to
                # settle on; the outcome is unknown, as for any lost call) unless an interrupt shut it;
                # nor is a refusal (out of scope, no grant): the server answered, nothing was granted.
                raw = self.wrapper.connection
                if interrupted() or not (raw is None or raw.closed or run.refused_by_server(exc)):
                    settling.settle(self.wrapper, key, owner, in_flight)
                raise
        except NotAcquirableError:
            raise  # a refusal: the connection is fine
        except BaseException:
            self._discard()
            raise

    def renew(self, key: str, owner: str, epoch: int, ttl: timedelta, *, timeout: float) -> operations.Renewal:
        """Renew, giving up server-side after ``timeout`` seconds (statement_timeout)."""
        with self._bounded(timeout):
            self._sending()
            return operations.renew(self.wrapper, key, owner, epoch, ttl)

    def release(self, key: str, owner: str, epoch: int, *, timeout: float) -> None:
        """Release ``(owner, epoch)`` only, giving up server-side after ``timeout`` seconds.

        It may be interrupted in this thread at any of its statements by a signal, KeyboardInterrupt or
        SystemExit, none of them an error of the call. The release is then completed on a fresh session
        by `settling.complete_release`, as ``Lease.objects.release`` does, before the interruption goes on.
        """
        try:
            with self._bounded(timeout):
                self._sending()
                operations.release(self.wrapper, key, owner, epoch)
        except Exception:
            raise  # a verdict, a timeout, a lost connection, an interrupt from another thread: reported
        except BaseException:
            settling.complete_release(self.wrapper, key, owner, epoch)
            self._discard()  # the fresh session is not what the pool lent (its statement_timeout)
            raise

    def settle(self, key: str, owner: str) -> None:
        """Release a grant of ``key`` found in ``owner``'s name (`settling.settle`), then drop the session."""
        settling.settle(self.wrapper, key, owner, None)
        self._discard()  # a fresh session: not the statement_timeout this connection says it has

    def lend(self) -> int:
        """Count a new lending: an interrupt meant for an earlier one never touches this one."""
        with self._guard:
            self._lends += 1
            return self._lends

    def interrupt(self, lend: int, done: threading.Event, *, grace: float) -> None:
        """End the call in flight on this connection from another thread, for a hold's bounded exit.

        First it sends a cancel request, which also ends a commit's wait for a synchronous standby, where
        a ``statement_timeout`` does not. The call may still be blocked ``grace`` seconds later, because
        the server cannot be reached over a dead network. Then the socket is shut down, so that the
        blocked call fails at once instead of after the TCP keepalives. This happens only while the
        connection is still in the same lending, ``lend``, and its call has not returned, ``done``. The
        guard keeps it from being lent again, or closed, meanwhile. The call's own error handling
        discards it.

        With no statement in flight, the socket is shut down at once; that is a blocking acquire waiting
        for a release notification. The wait ends now, and the acquire checks ``InFlight.check`` before it
        would send another attempt.
        """
        with self._guard:
            cancelled = self._in_call(lend, done)
            if cancelled is None:
                return
            if cancelled.info.transaction_status != TransactionStatus.ACTIVE:
                _shut(cancelled)
                return
            with suppress(Exception):
                cancelled.cancel_safe(timeout=grace)
        if done.wait(grace):
            return
        with self._guard:
            raw = self._in_call(lend, done)
            if raw is None or raw is not cancelled:  # reconnected meanwhile: to settle (settling.settle)
                return
            _shut(raw)

    def _in_call(self, lend: int, done: threading.Event) -> Any:  # with self._guard held
        raw = self.wrapper.connection
        if self._lends != lend or done.is_set() or raw is None or raw.closed:
            return None
        return raw

    def close(self) -> None:
        """Close the connection for good (never in a process that did not open it: see `forget`)."""
        if self.pid != os.getpid():
            return
        self._discard()
        with suppress(RuntimeError):
            self.wrapper.dec_thread_sharing()

    def backend_pid(self) -> int | None:
        """The server process of the open session, or None."""
        raw = self.wrapper.connection
        return None if raw is None or raw.closed else int(raw.info.backend_pid)

    def clean(self) -> bool:
        """True when the connection may be lent again: open, ours, autocommit, idle (no transaction, no statement)."""
        raw = self.wrapper.connection
        return (
            self.pid == os.getpid()
            and raw is not None
            and not raw.closed
            and raw.info.transaction_status == TransactionStatus.IDLE
            and self.wrapper.get_autocommit()
            and not self.wrapper.in_atomic_block
        )

    def _sending(self) -> None:
        # The trust window starts just before the statement that succeeds is sent: the server's
        # grant or renewal happens after this instant, so its expiry is at least this + TTL.
        self.sent_at = time.monotonic()

    def reset_timeout(self) -> None:
        """Back to the session's default statement_timeout (a renewal's may be set), as Django's own connections run."""
        if self.timeout_ms is not None and not self.per_transaction:
            run.run(self.wrapper, statements.STATEMENT_TIMEOUT_RESET)
            self.timeout_ms = None

    def _check_not_listening(self) -> None:
        if run.one(self.wrapper, statements.LISTENING):
            raise RuntimeError("a LISTEN outlived the blocking acquire")  # discarded by the caller

    @contextmanager
    def _bounded(self, seconds: float) -> Iterator[None]:
        # On any failure but a verdict the connection is dropped: its state is unknown (a
        # terminated backend, a cancelled statement, a half-sent query); the next call reconnects.
        wrapper = self.wrapper
        ms = statement_timeout_ms(seconds)
        try:
            if self.per_transaction:
                # SET LOCAL (set_config(..., true)) in a transaction of its own: the timeout cannot
                # leak into a pooled server session behind PgBouncer in transaction mode.
                wrapper.set_autocommit(False)
                run.run(wrapper, statements.STATEMENT_TIMEOUT_LOCAL, timeout=f"{ms}ms")
                try:
                    yield
                except LeaseLostError:
                    wrapper.commit()
                    wrapper.set_autocommit(True)
                    raise
                with confirmed_commit(wrapper):  # the commit here is what waits for a standby
                    wrapper.commit()
                wrapper.set_autocommit(True)
                return
            if self.timeout_ms != ms:
                run.run(wrapper, statements.STATEMENT_TIMEOUT_SESSION, timeout=f"{ms}ms")
                self.timeout_ms = ms
            yield
        except LeaseLostError:
            raise  # a verdict: the statement ran to its end, the connection is clean
        except BaseException:
            self._discard()
            raise

    def discard(self) -> None:
        """Close the session (the pool then closes the connection instead of lending it again)."""
        self._discard()

    def _discard(self) -> None:
        with self._guard:
            try:
                self.wrapper.close()
            except Exception:
                logger.debug("closing a lease connection failed", exc_info=True)
                self.wrapper.connection = None
