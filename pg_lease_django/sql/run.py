"""The sync executor: a `Statement` on a Django connection (and, for the Patroni callback, on a psycopg one).

`one`, `first`, `rows` and `run` send a statement and decode its rows (``sql.rows``). A statement
that ``confirms`` (a lease operation) goes the hot path: the notice handler kept on the connection
turns the server's WARNING of an unconfirmed commit into `UnconfirmedCommitError` (at once, or out
of the caller's ``atomic()``), and it is sent on a cursor of the psycopg connection itself when
nothing but Django stands in between (`_nothing_in_between`). Every other statement goes through Django's cursor.
Errors are Django's (``DatabaseError`` and its subclasses), as for any ORM call, except where the
statement's map (``sql.errors``) names the package's error for the server's answer, and a lease
statement whose connection was lost in flight, whose outcome is unknown (`OutcomeUnknownError`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import psycopg
from django.db import DatabaseError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from psycopg import sql as pgsql

from pg_lease_django.exceptions import OutcomeUnknownError

from . import Statement, errors, render
from .confirmation import UnconfirmedCommitNotices, check_caller_commit

T = TypeVar("T")
#: Django's PostgreSQL backend, named rather than imported: importing it loads the ORM (its test
#: database creation imports the serializers), which the Patroni hook, a user of `on_psycopg`, never needs.
_POSTGRESQL_BACKEND = ("django.db.backends.postgresql.base", "DatabaseWrapper")
_MARKER = re.compile(r"[A-Za-z0-9_ ]+")
Params = Sequence[Any] | dict[str, Any]


def one(
    connection: BaseDatabaseWrapper,
    statement: Statement[T],
    params: Params = (),
    *,
    marker: str | None = None,
    **parts: pgsql.Composable,
) -> T:
    """Send ``statement``; its one row, decoded. ``marker``: see `first`."""
    found = first(connection, statement, params, marker=marker, **parts)
    return found  # type: ignore[return-value]  # a statement `one` is used for answers a row


def first(
    connection: BaseDatabaseWrapper,
    statement: Statement[T],
    params: Params = (),
    *,
    marker: str | None = None,
    **parts: pgsql.Composable,
) -> T | None:
    """Send ``statement``; its first row decoded, or None when it answers none.

    ``marker`` (a lease statement's): a comment put at the start of its text, the identity an
    interrupted attempt is found by in ``pg_stat_activity`` (`wait.settling`): ASCII letters, digits,
    underscores and spaces only, so it can never end the comment."""
    try:
        if statement.confirms:
            text = render(connection, statement)
            if marker is not None:
                if not _MARKER.fullmatch(marker):
                    raise ValueError(f"a statement marker is ASCII letters, digits, underscores and spaces: {marker!r}")
                text = f"/* {marker} */ {text}"
            row = _confirmed(connection, text, params, all_rows=False)
        else:
            with connection.cursor() as cursor:
                cursor.execute(render(connection, statement, **parts), params)
                row = cursor.fetchone()
    except DatabaseError as exc:
        errors.raise_mapped(exc, statement.errors, params)
        raise
    return None if row is None else statement.decode(row, params)


def rows(
    connection: BaseDatabaseWrapper, statement: Statement[T], params: Params = (), **parts: pgsql.Composable
) -> list[T]:
    """Send ``statement``; every row, decoded."""
    try:
        if statement.confirms:
            found = _confirmed(connection, render(connection, statement), params, all_rows=True)
        else:
            with connection.cursor() as cursor:
                cursor.execute(render(connection, statement, **parts), params)
                found = cursor.fetchall()
    except DatabaseError as exc:
        errors.raise_mapped(exc, statement.errors, params)
        raise
    return [statement.decode(row, params) for row in found]


#: The SQLSTATE classes of a statement the server refused before it could write anything: a bad
#: argument (22), a name out of the caller's scope or a missing privilege or function (42), a limit
#: reached (53). A lost connection (no SQLSTATE, 08), a shutdown (57P) or a cancel stay unknown.
REFUSED_CLASSES = frozenset({"22", "42", "53"})


def refused_by_server(error: BaseException) -> bool:
    """Whether ``error`` (Django's or psycopg's) is the server refusing a statement outright.

    Such an attempt granted nothing: there is nothing to settle, and a scope refusal or a missing
    grant stays the one line the server wrote, not a settling's failure logged around it.
    """
    return (errors.sqlstate(error) or "")[:2] in REFUSED_CLASSES


def run(
    connection: BaseDatabaseWrapper, statement: Statement[Any], params: Params = (), **parts: pgsql.Composable
) -> None:
    """Send ``statement``, which answers nothing worth reading."""
    try:
        with connection.cursor() as cursor:
            cursor.execute(render(connection, statement, **parts), params)
    except DatabaseError as exc:
        errors.raise_mapped(exc, statement.errors, params)
        raise


def on_psycopg(
    conn: psycopg.Connection[Any],
    statement: Statement[T],
    params: Params = (),
    *,
    schema: str | None = None,
    **parts: pgsql.Composable,
) -> list[T]:
    """Send ``statement`` on a plain psycopg connection (no Django: the Patroni callback); its rows,
    decoded (none for a statement that returns nothing). ``schema``: the lease app's, when it names it."""
    cursor = conn.execute(statement.compose(schema, **parts), params)
    return [statement.decode(row, params) for row in cursor.fetchall()] if cursor.description else []


def _confirmed(connection: BaseDatabaseWrapper, statement: str, params: Params, *, all_rows: bool) -> Any:
    """Send a lease statement: the hot path, with its commit confirmed (``sql.confirmation``).

    Inside the caller's ``atomic()`` the statement does not commit: the caller's COMMIT is checked
    instead, after it returns, by an ``on_commit`` hook that raises out of ``atomic()``.
    """
    # kept_on runs Django's health check and connects: once a call.
    notices = UnconfirmedCommitNotices.kept_on(connection)
    raw = connection.connection
    notices.seen.clear()
    try:
        found = _send(connection, raw, statement, params, all_rows)
    except OperationalError as exc:
        if raw.closed:  # open when sent (health-checked above): lost in flight, the outcome unknown
            raise OutcomeUnknownError(
                f"the connection was lost during a lease statement: its outcome is unknown ({exc})"
            ) from exc
        raise
    notices.raise_if_unconfirmed()
    check_caller_commit(connection)
    return found


def _send(
    connection: BaseDatabaseWrapper, raw: psycopg.Connection[Any], statement: str, params: Params, all_rows: bool
) -> Any:
    """Send ``statement`` on ``raw`` (``connection``'s psycopg connection, open and health-checked), the
    cheapest way Django's connection allows.

    Through Django's cursor whenever anything may see or change what it sends (`_nothing_in_between`);
    otherwise on a cursor of ``raw``, after the checks Django's cursor makes (thread, broken
    transaction) and with its error wrapping: the same session, the same cursor class and binding,
    ~10 µs less Python per call (docs/performance.md).
    """
    if _nothing_in_between(connection) and _loads_in_django_time_zone(connection, raw):
        connection.validate_thread_sharing()
        connection.validate_no_broken_transaction()
        with connection.wrap_database_errors, raw.cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall() if all_rows else cursor.fetchone()
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if all_rows else cursor.fetchone()


_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


def _loads_in_django_time_zone(connection: BaseDatabaseWrapper, raw: psycopg.Connection[Any]) -> bool:
    """Whether ``raw`` loads timestamps in the zone Django's cursor would: it sets its own loader on
    each cursor when the database's time zone setting changed after connecting. Remembered per
    psycopg connection and zone (Django registers a connection's loader only when it connects)."""
    zone = connection.timezone
    known = connection.__dict__.get("_pg_lease_zone")
    if known is not None and known[0]() is raw and known[1] is zone:
        return bool(known[2])
    loader = raw.adapters.get_loader(_TIMESTAMPTZ, psycopg.pq.Format.TEXT)
    agrees = loader is not None and getattr(loader, "timezone", None) == zone
    connection._pg_lease_zone = (weakref.ref(raw), zone, agrees)  # type: ignore[attr-defined]  # noqa: SLF001 (our own attribute)
    return agrees


def _nothing_in_between(connection: BaseDatabaseWrapper) -> bool:
    """Whether nothing but Django's own code stands between a call and psycopg: Django's PostgreSQL
    backend itself (a subclass may set a search_path or instrument its cursors), no execute wrapper
    (another app's, or `CallerCommitCheck`), no query log (``DEBUG``, ``assertNumQueries``), no patched
    ``connection.cursor`` (django-debug-toolbar) and an unpatched ``CursorWrapper`` (APM agents)."""
    return (
        (type(connection).__module__, type(connection).__qualname__) == _POSTGRESQL_BACKEND
        and not connection.execute_wrappers
        and not connection.queries_logged
        and "cursor" not in vars(connection)
        and CursorWrapper.execute.__module__ == CursorWrapper.__module__
    )
