"""The statement layer: every statement the package sends, in one home, and what runs them.

``queries.sql`` holds each statement once, under its name, and ``fence_triggers.sql`` the DDL a
fenced table's ``FenceTrigger`` runs in users' migrations; `Statement` is one of them as a value
(its name, how many rows it answers, its row decoder, whether its commit must be confirmed), and
``sql.statements`` lists them all. Two executors send them: ``sql.run`` on a Django connection (the
notice handler and commit confirmation of ``sql.confirmation``, Django's error mapping) and
``sql.arun`` on a psycopg async connection (the same handler); ``sql.run.on_psycopg`` serves the
Patroni callback's plain psycopg connections. No module outside ``sql/`` calls ``execute()``.

Every lease function is schema-qualified and each argument cast: PostgreSQL resolves an
unqualified call to an exact-type match anywhere on the search_path before a function that needs a
cast, so a role that may CREATE in an earlier (or the same) schema could otherwise answer for
``pg_lease_fence``. The schema is the one the lease table lives in (where the migrations installed
the functions); it, and every other identifier, is composed with psycopg.sql, never formatted in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db.backends.base.base import BaseDatabaseWrapper
from django.dispatch import receiver
from psycopg import sql as pgsql

from pg_lease_django import conf

T = TypeVar("T")
#: This directory: the statements' files are read from it here, not through ``sql.files``, whose
#: migration operation imports Django's migration machinery (the Patroni hook needs none of it).
_DIRECTORY = Path(__file__).resolve().parent

# procrastinate's file format: a line `-- name --`, its comment lines, then the statement.
_HEADER = re.compile(r"^-- ([a-z0-9_]+) --$", re.MULTILINE)


@cache
def named(source: str) -> dict[str, str]:
    """Every statement of the file ``source`` (``queries.sql``, ``fence_triggers.sql``) by name, its
    comment lines left out (a fragment is composed into other statements, where a comment would
    swallow the rest of the line)."""
    text = (_DIRECTORY / source).read_text(encoding="utf-8")
    parts = _HEADER.split(text)[1:]
    found: dict[str, str] = {}
    for name, body in zip(parts[::2], parts[1::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        found[name] = "\n".join(lines).strip()
    return found


def queries() -> dict[str, str]:
    """Every statement of ``queries.sql`` by name (`named`)."""
    return named("queries.sql")


def _whole_row(row: Sequence[Any], params: Sequence[Any] | dict[str, Any]) -> Any:
    return tuple(row)


@dataclass(frozen=True)
class Statement(Generic[T]):
    """A statement of ``queries.sql`` as a value.

    Attributes:
        name: its name in ``queries.sql``.
        decode: each row's meaning, given the row and the parameters sent (a verdict that is an
            error raises it); the whole row as a tuple by default.
        confirms: a lease write whose commit must reach the synchronous standby: the executors turn
            the server's WARNING of an unconfirmed commit into `UnconfirmedCommitError`.
        errors: SQLSTATE -> the package's error for it (``sql.errors``), applied by both executors.
        parts: the names of the identifiers and fragments besides ``schema`` it is composed with.
        source: the file of this directory it is written in.
    """

    name: str
    decode: Callable[[Sequence[Any], Any], T] = field(default=_whole_row, compare=False)
    confirms: bool = False
    parts: tuple[str, ...] = ()
    errors: Mapping[str, Callable[[Any, Any], BaseException]] = field(default_factory=dict, compare=False)
    source: str = "queries.sql"

    @property
    def text(self) -> str:
        """Its SQL, with ``{schema}`` and its parts unfilled."""
        return named(self.source)[self.name]

    def compose(self, schema: str | None, **parts: pgsql.Composable) -> pgsql.Composed:
        """Its SQL with ``schema`` (unquoted; None when it names none) and ``parts`` composed in:
        ``{schema}`` as an identifier, ``{schema_name}`` as a string literal (for the catalogs)."""
        if schema is not None:
            parts["schema"] = pgsql.Identifier(schema)
            parts["schema_name"] = pgsql.Literal(schema)
        # The package's own SQL, from its own file: as safe as a literal in the code (procrastinate's vouch).
        return pgsql.SQL(self.text).format(**parts)


#: The channel release and force release notify, with the key as payload, when a waiter registered for
#: the key (``acquire_or_register``); spelled in the SQL functions (pg_lease_wake_waiters) and in the
#: ``listen`` statement too.
NOTIFY_CHANNEL = "pg_lease_django"

# The lease table's schema per database alias, looked up once per process (one catalog query).
_schemas: dict[str, str] = {}
# (alias, PG_LEASE_SCHEMA) pairs whose schema was seen to hold the lease table.
_verified: set[tuple[str, str]] = set()


def schema_name(connection: BaseDatabaseWrapper) -> str:
    """The schema of the lease functions in ``connection``'s database, unquoted.

    ``PG_LEASE_SCHEMA`` names it outright (checked once per database alias to hold the lease table);
    otherwise it is the one schema of the search_path that has the ``pg_lease_django_lease`` table,
    looked up once per database alias.

    Raises:
        ImproperlyConfigured: no schema of the search_path (or not ``PG_LEASE_SCHEMA``) has the
            lease table (the app is not migrated), or several do (set ``PG_LEASE_SCHEMA``).
    """
    configured = conf.schema()
    if configured is not None:
        # Checked as the lookup is, so that an unmigrated database names migrate, not "function ... does not exist".
        if (connection.alias, configured) not in _verified:
            with connection.cursor() as cursor:
                cursor.execute(queries()["relation_exists"], (configured, "pg_lease_django_lease"))
                if not cursor.fetchone()[0]:
                    raise ImproperlyConfigured(
                        f"database {connection.alias!r} has no lease table in schema {configured!r} (PG_LEASE_SCHEMA): "
                        f"run `manage.py migrate pg_lease_django --database {connection.alias}`"
                    )
            _verified.add((connection.alias, configured))
        return configured
    name = _schemas.get(connection.alias)
    if name is None:
        with connection.cursor() as cursor:
            cursor.execute(queries()["schema_lookup"], ())
            name = remember_schema(connection.alias, [row[0] for row in cursor.fetchall()])
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


@receiver(setting_changed)
def _forget_rendered(*, setting: str, **kwargs: Any) -> None:
    """``PG_LEASE_SCHEMA`` changed (``override_settings``): render again."""
    if setting == "PG_LEASE_SCHEMA":
        _rendered.clear()


def render(connection: BaseDatabaseWrapper, statement: Statement[Any], **parts: pgsql.Composable) -> str:
    """``statement``'s SQL for ``connection``: its schema and ``parts`` composed in (cached without parts)."""
    if parts:
        return statement.compose(_schema_if_named(connection, statement), **parts).as_string(None)
    found = _rendered.get((connection.alias, statement.source, statement.name))
    if found is None:
        found = _rendered[connection.alias, statement.source, statement.name] = statement.compose(
            _schema_if_named(connection, statement)
        ).as_string(None)
    return found


def _schema_if_named(connection: BaseDatabaseWrapper, statement: Statement[Any]) -> str | None:
    return schema_name(connection) if "{schema" in statement.text else None
