"""Whether a lease write's commit reached the synchronous standby: PostgreSQL's WARNING, read as an error.

A commit may wait for a synchronous standby, and that wait may be cancelled, for example when the
standby is gone or a cancel request arrives. PostgreSQL has then committed locally and answers
success with a WARNING of SQLSTATE ``01000``. After a failover the write may be lost.

The sync executor, ``sql.run``, sends each lease statement with a notice handler kept on the
connection (`UnconfirmedCommitNotices`) and turns that WARNING into `UnconfirmedCommitError`. It
raises at once for a statement that committed on its own. For one inside the caller's ``atomic()``
it raises when that block commits, through `CallerCommitCheck`. `confirmed_commit` does the same
around any block, such as ``prune`` or a renewal's own ``COMMIT`` behind a transaction pooler.

The handler itself takes any psycopg connection, sync or async. The async executor, ``sql.arun``,
applies the same rule through `UnconfirmedCommitNotices.confirmed`; its `Session` is the
``AsyncConnection`` of the async blocking wait in `wait.async_driver`. See docs/FAILURE-MODEL.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django.exceptions import UnconfirmedCommitError

#: The server's answer to a commit whose wait for a synchronous standby was cancelled: a WARNING with
#: this SQLSTATE (and "canceling wait for synchronous replication" as its, possibly translated, message).
UNCONFIRMED_COMMIT_SQLSTATE = "01000"


class UnconfirmedCommitNotices:
    """A notice handler on a psycopg connection (sync or async) keeping the WARNINGs of SQLSTATE ``01000`` it sees."""

    def __init__(self, raw: Any) -> None:
        self.raw = weakref.ref(raw)  # the connection holds its handler: no cycle through it
        self.seen: list[tuple[str | None, str | None, str | None]] = []
        raw.add_notice_handler(self.on_notice)

    @classmethod
    def kept_on(cls, connection: BaseDatabaseWrapper) -> UnconfirmedCommitNotices:
        """The handler kept on ``connection``'s psycopg connection for its life, connecting first if
        need be (so a new connection's first statement is checked too). Added on first use: adding
        and removing one around every call costs more than the call's own Python."""
        connection.close_if_health_check_failed()  # reconnects now, not between here and the statement
        connection.ensure_connection()
        raw = connection.connection
        kept: UnconfirmedCommitNotices | None = connection.__dict__.get("_pg_lease_notices")
        if kept is None or kept.raw() is not raw:
            kept = connection._pg_lease_notices = cls(raw)  # type: ignore[attr-defined]  # noqa: SLF001 (our own attribute on Django's connection)
        return kept

    def on_notice(self, diagnostic: Any) -> None:
        # A Diagnostic is valid only inside the handler: keep its fields.
        if diagnostic.sqlstate == UNCONFIRMED_COMMIT_SQLSTATE and diagnostic.severity_nonlocalized == "WARNING":
            self.seen.append((diagnostic.severity, diagnostic.message_primary, diagnostic.message_detail))

    @contextmanager
    def confirmed(self) -> Iterator[None]:
        """Raise `UnconfirmedCommitError` after the block if the connection got the WARNING meanwhile
        (the block ran: what it committed is on the primary, its result not returned)."""
        self.seen.clear()
        yield
        self.raise_if_unconfirmed()

    def remove(self) -> None:
        raw = self.raw()
        if raw is not None:
            with suppress(ValueError):
                raw.remove_notice_handler(self.on_notice)

    def raise_if_unconfirmed(self) -> None:
        if self.seen:
            severity, notice, detail = self.seen[0]
            raise UnconfirmedCommitError(
                "the commit was not confirmed by the synchronous standby (its outcome after a failover is "
                f"unknown): {notice}" + (f" ({detail})" if detail else ""),
                severity=severity,
                notice=notice,
                detail=detail,
            )


@contextmanager
def confirmed_commit(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """Raise `UnconfirmedCommitError` after the block if the server sent a WARNING of SQLSTATE ``01000``.

    Such a WARNING means a commit the server could not confirm on the synchronous standby: the block
    ran, but its result may be lost. Any generic WARNING counts, since the message may be translated.
    None of the lease functions sends one, and taking a confirmed write for an unconfirmed one only
    costs a retry. This is Python only, with no round trip: it reads the handler kept on the open
    psycopg connection by `UnconfirmedCommitNotices.kept_on`.
    """
    with UnconfirmedCommitNotices.kept_on(connection).confirmed():
        yield


class CallerCommitCheck:
    """Inside the caller's ``atomic()``, the caller's COMMIT is what waits for the synchronous standby.

    From the first lease call of a transaction to its end, a notice handler keeps the WARNINGs of
    SQLSTATE ``01000`` and an execute wrapper forgets them after each statement, so that only those
    of the COMMIT count (a trigger's ``RAISE WARNING`` in a statement does not); an ``on_commit`` hook
    raises `UnconfirmedCommitError` out of the caller's ``atomic()`` when there is one. Like any
    failing hook, it keeps the hooks registered after it from running: the transaction may be lost.
    One check per transaction; a rolled-back transaction's is dropped by the next statement.
    """

    def __init__(self, connection: BaseDatabaseWrapper, raw: Any) -> None:
        self.connection = connection
        self.notices = UnconfirmedCommitNotices(raw)
        connection.execute_wrappers.append(self.forget_statement_notices)

    def forget_statement_notices(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        if not self.may_commit():  # rolled back: its hook was dropped, nothing would remove this wrapper
            self.end()
            return execute(sql, params, many, context)
        try:
            return execute(sql, params, many, context)
        finally:
            self.notices.seen.clear()

    def may_commit(self) -> bool:
        """Whether the transaction may still commit: it is open, or its hooks, ours among them, are running."""
        return self.connection.in_atomic_block or any(entry[1] == self.check for entry in self.connection.run_on_commit)

    def end(self) -> None:
        self.notices.remove()
        with suppress(ValueError):
            self.connection.execute_wrappers.remove(self.forget_statement_notices)
        if getattr(self.connection, "_pg_lease_caller_commit", None) is self:
            del self.connection._pg_lease_caller_commit  # noqa: SLF001 (our own attribute on Django's connection)

    def check(self) -> None:
        self.end()
        self.notices.raise_if_unconfirmed()

    @classmethod
    def arm(cls, connection: BaseDatabaseWrapper) -> None:
        current: CallerCommitCheck | None = getattr(connection, "_pg_lease_caller_commit", None)
        if current is not None:
            if any(entry[1] == current.check for entry in connection.run_on_commit):
                return  # this transaction's COMMIT is checked already
            current.end()  # a transaction that rolled back (its hooks were dropped)
        raw = connection.connection
        if raw is None:
            return
        check = cls(connection, raw)
        connection._pg_lease_caller_commit = check  # type: ignore[attr-defined]  # noqa: SLF001 (our own attribute)
        connection.on_commit(check.check)


def check_caller_commit(connection: BaseDatabaseWrapper) -> None:
    """After a lease statement: inside the caller's ``atomic()``, check its COMMIT (armed once per
    transaction); outside, drop the check of a transaction that rolled back."""
    if connection.in_atomic_block:
        CallerCommitCheck.arm(connection)
    elif (stale := connection.__dict__.get("_pg_lease_caller_commit")) is not None:
        stale.end()
