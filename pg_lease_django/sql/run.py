"""The sync executor: a `Statement` on a Django connection, and on a psycopg one for the Patroni callback.

`one`, `first`, `rows` and `run` send a statement with its parameters as keywords and decode its
rows with the decoders of ``sql.rows``. A statement on the ``fast_path``, a lease call, is sent on a
cursor of the psycopg connection itself when nothing but Django stands in between
(`_nothing_in_between`). For one that also ``confirms``, a lease write, the notice handler kept on
the connection turns the server's WARNING of an unconfirmed commit into `UnconfirmedCommitError`,
at once or when the caller's ``atomic()`` commits. Every other statement goes through Django's
cursor.

Errors are Django's ``DatabaseError`` and its subclasses, as for any ORM call. `_execute` is the one
place that reads them, and it raises the package's error instead in two cases. The first is when
the statement's maps in ``sql.errors`` name one for the server's answer, a SQLSTATE or a verdict.
The second is a lease statement whose connection was lost in flight: its outcome is unknown, so it
raises `OutcomeUnknownError`.

A statement is rendered here for its connection's database. `schema_name` finds the lease schema
once per alias, with the statements ``relation_exists`` and ``schema_lookup`` sent like any other.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import DatabaseError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.dispatch import receiver
from psycopg import sql as pgsql
from psycopg.types.datetime import TimestamptzLoader

from pg_lease_django import conf
from pg_lease_django.exceptions import MissingRowError, OutcomeUnknownError

from . import Positional, Statement, errors, positional, statements
from .confirmation import UnconfirmedCommitNotices, check_caller_commit

T = TypeVar("T")
#: Django's PostgreSQL backend, named rather than imported: importing it loads the ORM (its test
#: database creation imports the serializers), which the Patroni hook, a user of `on_psycopg`, never needs.
_POSTGRESQL_BACKEND = ("django.db.backends.postgresql.base", "DatabaseWrapper")
_MARKER = re.compile(r"[A-Za-z0-9_ ]+")
Parts = Mapping[str, pgsql.Composable] | None


def one(
    connection: BaseDatabaseWrapper,
    statement: Statement[T],
    *,
    marker: str | None = None,
    parts: Parts = None,
    **params: Any,
) -> T:
    """Send ``statement`` with ``params``; its one row, decoded. ``marker``: see `first`.

    Raises:
        MissingRowError: it answered no row, which a statement sent through `one` always answers.
    """
    found = _execute(connection, statement, params, parts, marker, _fetch_one)
    if found is None:
        raise MissingRowError(f"the statement {statement.name!r} answered no row, where it always answers one")
    return statement.decode(found, **params)


def first(
    connection: BaseDatabaseWrapper,
    statement: Statement[T],
    *,
    marker: str | None = None,
    parts: Parts = None,
    **params: Any,
) -> T | None:
    """Send ``statement`` with ``params``; its first row decoded, or None when it answers none.

    ``marker`` is for a lease statement: a comment put at the start of its text, as `_marked`
    spells it. It is the identity an interrupted attempt is found by in ``pg_stat_activity``
    (`wait.settling`). It may hold only ASCII letters, digits, underscores and spaces, so it can
    never end the comment, nor its quotes when bound. ``parts`` are the
    identifiers and fragments the statement is composed with, as `Statement.parts` names them.
    """
    found = _execute(connection, statement, params, parts, marker, _fetch_one)
    return None if found is None else statement.decode(found, **params)


def rows(connection: BaseDatabaseWrapper, statement: Statement[T], *, parts: Parts = None, **params: Any) -> list[T]:
    """Send ``statement`` with ``params``; every row, decoded."""
    found = _execute(connection, statement, params, parts, None, _fetch_all)
    return [statement.decode(row, **params) for row in found]


def run(connection: BaseDatabaseWrapper, statement: Statement[object], *, parts: Parts = None, **params: Any) -> None:
    """Send ``statement`` with ``params``, which answers nothing worth reading."""
    _execute(connection, statement, params, parts, None, _fetch_nothing)


def _fetch_one(cursor: Any) -> Any:
    return cursor.fetchone()


def _fetch_all(cursor: Any) -> Any:
    return cursor.fetchall()


def _fetch_nothing(cursor: Any) -> None:
    return None


def _execute(
    connection: BaseDatabaseWrapper,
    statement: Statement[object],
    params: dict[str, Any],
    parts: Parts,
    marker: str | None,
    fetch: Callable[[Any], Any],
) -> Any:
    """Send ``statement`` and ``fetch`` what it answered.

    This is the one place this executor turns the database's answer into the package's error: a
    SQLSTATE through the statement's error map, a verdict through its verdict map.
    """
    raw: psycopg.Connection[Any] | None = None
    try:
        if not statement.fast_path:
            sent = _sent(connection, statement, parts)
            with connection.cursor() as cursor:
                cursor.execute(sent.text, sent.arguments(statement.name, params))
                found = fetch(cursor)
        else:
            sent = _sent(connection, statement, None)
            if marker is not None and not _MARKER.fullmatch(marker):
                raise ValueError(f"a statement marker is ASCII letters, digits, underscores and spaces: {marker!r}")
            # kept_on runs Django's health check and connects: once a call.
            notices = UnconfirmedCommitNotices.kept_on(connection)
            raw = connection.connection
            text, arguments = sent.text, sent.arguments(statement.name, params)
            if marker is not None:
                text, arguments = _marked(raw, text, arguments, marker)
            notices.seen.clear()
            found = _send(connection, raw, text, arguments, fetch)
            if statement.confirms:
                notices.raise_if_unconfirmed()
                check_caller_commit(connection)
    except DatabaseError as exc:
        if raw is not None and raw.closed and type(exc) is OperationalError:
            # Open when sent (health-checked above): lost in flight, the outcome unknown.
            raise OutcomeUnknownError(
                f"the connection was lost during a lease statement: its outcome is unknown ({exc})"
            ) from exc
        errors.raise_mapped(exc, statement.errors, params)
        raise
    if statement.verdicts and found is not None:
        # A verdict is the database's answer too: raised here, after the commit was confirmed, as before.
        for row in found if fetch is _fetch_all else (found,):
            errors.raise_verdict(row, statement.verdicts, params)
    return found


def _marked(raw: psycopg.Connection[Any], text: str, arguments: list[Any], marker: str) -> tuple[str, list[Any]]:
    """``text`` and its ``arguments`` with ``marker`` in a comment at the start of the text.

    Sent through a cursor that binds client-side, psycopg's ``ClientCursor`` and Django's default,
    the marker is a parameter inside the comment. The text then stays the same from call to call, so
    psycopg converts it from its cache; a unique text costs a parse, ~6.5 µs. The text the server runs
    carries the marker quoted, ``/* 'pg_lease_django attempt …' */``, where ``strpos`` finds it all
    the same. A cursor that binds server-side, ``OPTIONS={"server_side_binding": True}``, would send
    ``$1`` there: the marker is written into the text. ``raw``'s cursor class decides, which is the
    class of both ways `_send` sends on.
    """
    if issubclass(raw.cursor_factory, psycopg.ClientCursor):
        return f"/* %s */ {text}", [marker, *arguments]
    return f"/* {marker} */ {text}", arguments


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


def on_psycopg(
    conn: psycopg.Connection[Any],
    statement: Statement[T],
    *,
    schema: str | None = None,
    parts: Parts = None,
    **params: Any,
) -> list[T]:
    """Send ``statement`` with ``params`` on a plain psycopg connection, for the Patroni callback.

    There is no Django here. It answers the rows decoded, or none for a statement that returns
    nothing. ``schema`` is the lease app's, when the statement names it. The statement's maps in
    ``sql.errors`` apply here too, to psycopg's errors and to the rows' verdicts.
    """
    try:
        cursor = conn.execute(statement.compose(schema, **(parts or {})), params)
    except psycopg.Error as exc:
        errors.raise_mapped(exc, statement.errors, params)
        raise
    if not cursor.description:
        return []
    found = cursor.fetchall()
    for row in found if statement.verdicts else ():
        errors.raise_verdict(row, statement.verdicts, params)
    return [statement.decode(row, **params) for row in found]


def _send(
    connection: BaseDatabaseWrapper,
    raw: psycopg.Connection[Any],
    statement: str,
    params: list[Any],
    fetch: Callable[[Any], Any],
) -> Any:
    """Send ``statement`` on ``raw`` the cheapest way Django's connection allows.

    ``raw`` is ``connection``'s psycopg connection, open and health-checked. The statement goes
    through Django's cursor whenever anything may see or change what it sends
    (`_nothing_in_between`). Otherwise it goes on a cursor of ``raw``, after the checks Django's cursor
    makes for thread sharing and a broken transaction, and with its error wrapping. That is the same
    session, the same cursor class and the same binding, with about 10 µs less Python per call, as
    docs/performance.md measures. That cursor is kept on ``connection`` for the next call while
    ``raw`` is its psycopg connection: one made and closed per call cost ~1.6 µs more.
    """
    if _nothing_in_between(connection) and _loads_in_django_time_zone(connection, raw):
        connection.validate_thread_sharing()
        connection.validate_no_broken_transaction()
        # The kept cursor is taken out while it is used, so that a call in between (a signal
        # handler's, another thread's on a shared connection) makes a cursor of its own.
        cursor = connection.__dict__.pop("_pg_lease_cursor", None)
        if cursor is None or cursor.connection is not raw:
            cursor = _direct_cursor(connection, raw)
        with connection.wrap_database_errors:
            cursor.execute(statement, params)
            found = fetch(cursor)
        connection._pg_lease_cursor = cursor  # type: ignore[attr-defined]  # noqa: SLF001 (our own attribute)
        return found
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return fetch(cursor)


_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


def _direct_cursor(connection: BaseDatabaseWrapper, raw: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A cursor of ``raw`` for the direct path, which loads each value as Django's cursor would.

    Django's timestamptz loader parses in Python and then sets Django's zone on the result: ~2-5 µs
    a timestamp, and an acquire answers two. Where the session's zone, which Django set when it
    connected, is the very zone Django would set (``timezone.utc`` by default), psycopg's own loader,
    in C where psycopg has it, gives the same value with the same ``tzinfo`` in ~0.2 µs.
    `_send` takes the direct path only while ``raw``'s loader is in Django's zone.
    """
    cursor = raw.cursor()
    if raw.info.timezone == connection.timezone:
        cursor.adapters.register_loader(_TIMESTAMPTZ, TimestamptzLoader)
    return cursor


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
    """Whether nothing but Django's own code stands between a call and psycopg.

    That holds when all of these do:

    - the connection is Django's PostgreSQL backend itself, since a subclass may set a search_path or
      instrument its cursors;
    - there is no execute wrapper, another app's or `CallerCommitCheck`;
    - there is no query log, as ``DEBUG`` and ``assertNumQueries`` keep;
    - ``connection.cursor`` is not patched, as django-debug-toolbar does;
    - ``CursorWrapper`` is not patched, as APM agents do.
    """
    return (
        (type(connection).__module__, type(connection).__qualname__) == _POSTGRESQL_BACKEND
        and not connection.execute_wrappers
        and not connection.queries_logged
        and "cursor" not in vars(connection)
        and CursorWrapper.execute.__module__ == CursorWrapper.__module__
    )


# ---- the lease schema of a connection's database, and statements rendered for it ---------------------

# The lease table's schema per database alias, looked up once per process (one catalog query).
_schemas: dict[str, str] = {}
# (alias, PG_LEASE_SCHEMA) pairs whose schema was seen to hold the lease table.
_verified: set[tuple[str, str]] = set()


def schema_name(connection: BaseDatabaseWrapper) -> str:
    """The schema of the lease functions in ``connection``'s database, unquoted.

    ``PG_LEASE_SCHEMA`` names it outright, checked once per database alias to hold the lease table.
    Otherwise it is the one schema of the search_path that has the ``pg_lease_django_lease`` table,
    looked up once per database alias.

    Raises:
        ImproperlyConfigured: no schema of the search_path has the lease table, or not the one
            ``PG_LEASE_SCHEMA`` names, because the app is not migrated. Or several do: then set
            ``PG_LEASE_SCHEMA``.
    """
    configured = conf.schema()
    if configured is not None:
        # Checked as the lookup is, so that an unmigrated database names migrate, not "function ... does not exist".
        if (connection.alias, configured) not in _verified:
            if not one(connection, statements.RELATION_EXISTS, namespace=configured, relation="pg_lease_django_lease"):
                raise ImproperlyConfigured(
                    f"database {connection.alias!r} has no lease table in schema {configured!r} (PG_LEASE_SCHEMA): "
                    f"run `manage.py migrate pg_lease_django --database {connection.alias}`"
                )
            _verified.add((connection.alias, configured))
        return configured
    name = _schemas.get(connection.alias)
    if name is None:
        name = remember_schema(connection.alias, rows(connection, statements.SCHEMA_LOOKUP))
    return name


def known_schema(alias: str) -> str | None:
    """The schema of the lease functions in ``alias``'s database if known without asking the server
    (``PG_LEASE_SCHEMA``, or looked up before in this process), else None."""
    return conf.schema() or _schemas.get(alias)


def remember_schema(alias: str, found: list[str]) -> str:
    """The schema the ``schema_lookup`` statement ``found`` for ``alias``, remembered for the process.

    Raises:
        ImproperlyConfigured: none was found, or several: as `schema_name`.
    """
    if not found:
        raise ImproperlyConfigured(
            f"database {alias!r} has no lease table (pg_lease_django_lease): "
            f"run `manage.py migrate pg_lease_django --database {alias}`"
        )
    if len(found) > 1:
        raise ImproperlyConfigured(
            f"several schemas on the search_path of database {alias!r} have a "
            f"pg_lease_django_lease table ({', '.join(sorted(found))}): set PG_LEASE_SCHEMA to the one "
            "`manage.py migrate` installed the lease functions in"
        )
    name = _schemas[alias] = found[0]
    return name


def schema(connection: BaseDatabaseWrapper) -> str:
    """`schema_name`, quoted."""
    return pgsql.Identifier(schema_name(connection)).as_string(None)


# Rendered statements per (alias, file, name): a call renders nothing after its first.
_rendered: dict[tuple[str, str, str], str] = {}
# The same, made positional as the executor sends them: one lookup a call.
_sendable: dict[tuple[str, str, str], Positional] = {}


@receiver(setting_changed)
def _forget_rendered(*, setting: str, **kwargs: Any) -> None:
    """``PG_LEASE_SCHEMA`` changed (``override_settings``): render again."""
    if setting == "PG_LEASE_SCHEMA":
        _rendered.clear()
        _sendable.clear()


def render(connection: BaseDatabaseWrapper, statement: Statement[object], **parts: pgsql.Composable) -> str:
    """``statement``'s SQL for ``connection``: its schema and ``parts`` composed in (cached without parts)."""
    if parts:
        return statement.compose(_schema_if_named(connection, statement), **parts).as_string(None)
    found = _rendered.get((connection.alias, statement.source, statement.name))
    if found is None:
        found = _rendered[connection.alias, statement.source, statement.name] = statement.compose(
            _schema_if_named(connection, statement)
        ).as_string(None)
    return found


def _sent(connection: BaseDatabaseWrapper, statement: Statement[object], parts: Parts) -> Positional:
    """``statement`` as the executor sends it on ``connection`` (`render`, made positional)."""
    if parts:
        return positional(render(connection, statement, **parts))
    name = (connection.alias, statement.source, statement.name)
    found = _sendable.get(name)
    if found is None:
        found = _sendable[name] = positional(render(connection, statement))
    return found


def _schema_if_named(connection: BaseDatabaseWrapper, statement: Statement[object]) -> str | None:
    return schema_name(connection) if "{schema" in statement.text else None
