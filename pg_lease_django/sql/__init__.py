"""The statement layer: every statement the package sends, in one home, and what runs them.

``queries.sql`` holds each statement once, under its name. ``fence_triggers.sql`` holds the DDL that a
fenced table's ``FenceTrigger`` runs in users' migrations. `Statement` is one of them as a value: its
name, its parameters by name, its row decoder, its maps from SQLSTATE and verdict to error, and
whether its commit must be confirmed. ``sql.statements`` lists them all.

Two executors send them. ``sql.run`` sends on a Django connection, with the notice handler and commit
confirmation of ``sql.confirmation`` and Django's error mapping. ``sql.arun`` sends on a psycopg async
connection with the same handler. ``sql.run.on_psycopg`` serves the Patroni callback's plain psycopg
connections. No module outside ``sql/`` calls ``execute()``.

Every lease function is schema-qualified and each argument cast. PostgreSQL resolves an unqualified
call to an exact-type match anywhere on the search_path before a function that needs a cast. So a
role that may CREATE in an earlier schema, or in the same one, could otherwise answer for
``pg_lease_fence``. The schema is the one the lease table lives in, where the migrations installed the
functions. It and every other identifier are composed with psycopg.sql, never formatted in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from psycopg import sql as pgsql

#: What a statement's rows decode to: covariant, so that `Statement[object]` takes any statement.
T = TypeVar("T", covariant=True)
#: This directory: the statements' files are read from it here, not through ``sql.files``, whose
#: migration operation imports Django's migration machinery (the Patroni hook needs none of it).
_DIRECTORY = Path(__file__).resolve().parent

# procrastinate's file format: a line `-- name --`, its comment lines, then the statement.
_HEADER = re.compile(r"^-- ([a-z0-9_]+) --$", re.MULTILINE)


@cache
def named(source: str) -> dict[str, str]:
    """Every statement of the file ``source`` by name, such as ``queries.sql`` or ``fence_triggers.sql``.

    Comment lines are left out: a fragment is composed into other statements, where a comment would
    swallow the rest of the line.
    """
    text = (_DIRECTORY / source).read_text(encoding="utf-8")
    parts = _HEADER.split(text)[1:]
    found: dict[str, str] = {}
    for name, body in zip(parts[::2], parts[1::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        found[name] = "\n".join(lines).strip()
    return found


#: A statement's parameters by name, as its ``%(name)s`` placeholders spell them.
_PLACEHOLDER = re.compile(r"%\(([a-z_]+)\)s")
#: A placeholder, or an escaped percent sign, which is no placeholder.
_PERCENT = re.compile(r"%%|%\(([a-z_]+)\)s")


def _no_row(row: Sequence[Any], **params: Any) -> Any:
    return None


@dataclass(frozen=True)
class Statement(Generic[T]):
    """A statement of ``queries.sql`` as a value.

    Attributes:
        name: its name in ``queries.sql``.
        decode: each row's meaning, a typed row of ``sql.rows``, given the row and, as keywords, the
            parameters sent. By default it decodes to None, for a statement that answers no row
            worth reading.
        confirms: a lease write whose commit must reach the synchronous standby: the executors turn
            the server's WARNING of an unconfirmed commit into `UnconfirmedCommitError`. A statement
            that confirms also takes the fast path.
        fast_path: a lease call sent on the psycopg connection itself when nothing but Django stands
            in between. It may carry a marker, and a connection lost in flight leaves its outcome
            unknown, which the sync executor raises as `OutcomeUnknownError`.
        errors: SQLSTATE -> the package's error for it, given the driver's error and the parameters
            sent as keywords (``sql.errors``), applied by both executors.
        verdicts: a lease function's verdict -> the package's error for it. The statement answers its
            verdict in its first column; both executors raise the mapped error for any verdict but
            ``ok``, given the row and the parameters sent as keywords, before the decoder sees the row.
        parts: the names of the identifiers and fragments besides ``schema`` it is composed with.
        source: the file of this directory it is written in.
    """

    name: str
    decode: Callable[..., T] = field(default=_no_row, compare=False)
    confirms: bool = False
    fast_path: bool = False
    parts: tuple[str, ...] = ()
    errors: Mapping[str, Callable[..., BaseException]] = field(default_factory=dict, compare=False)
    verdicts: Mapping[str, Callable[..., BaseException]] = field(default_factory=dict, compare=False)
    source: str = "queries.sql"

    def __post_init__(self) -> None:
        if self.confirms and not self.fast_path:
            raise ValueError(f"{self.name}: a statement that confirms its commit takes the fast path")

    @property
    def text(self) -> str:
        """Its SQL, with ``{schema}`` and its parts unfilled."""
        return named(self.source)[self.name]

    @property
    def parameters(self) -> frozenset[str]:
        """The names of its parameters, which a call passes as keywords."""
        return frozenset(_PLACEHOLDER.findall(self.text))

    def compose(self, schema: str | None, **parts: pgsql.Composable) -> pgsql.Composed:
        """Its SQL with ``schema`` and ``parts`` composed in.

        ``schema`` is unquoted, or None when the statement names none. ``{schema}`` becomes an identifier and
        ``{schema_name}`` a string literal, for the catalogs.
        """
        if schema is not None:
            parts["schema"] = pgsql.Identifier(schema)
            parts["schema_name"] = pgsql.Literal(schema)
        # The package's own SQL, from its own file: as safe as a literal in the code (procrastinate's vouch).
        return pgsql.SQL(self.text).format(**parts)


@dataclass(frozen=True)
class Positional:
    """A rendered statement as the executors send it: each ``%(name)s`` written ``%s``, with the
    names in the order they stand, so that the execute wrappers of other apps, which add a
    parameter of their own by position (django-pgtrigger's ``ignore``), work around it too."""

    text: str
    names: tuple[str, ...]
    distinct: int  # how many names, each once: how many parameters a call passes

    def arguments(self, statement: str, params: Mapping[str, Any]) -> list[Any]:
        """``params`` in the order of the placeholders of ``statement`` (its name, for the error).

        Raises:
            TypeError: a parameter is missing, or one is given that the statement does not name.
        """
        try:
            found = [params[name] for name in self.names]
        except KeyError as missing:
            raise TypeError(f"the statement {statement!r} needs the parameter {missing}") from None
        if len(params) != self.distinct:
            raise TypeError(f"the statement {statement!r} takes {sorted(set(self.names))}, not {sorted(params)}")
        return found


@lru_cache(maxsize=512)
def positional(text: str) -> Positional:
    """``text``, a rendered statement, as the executors send it (`Positional`)."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "%%"
        names.append(match.group(1))
        return "%s"

    sendable = _PERCENT.sub(placeholder, text)
    return Positional(sendable, tuple(names), len(set(names)))


#: The channel release and force release notify, with the key as payload, when a waiter registered for
#: the key (``acquire_or_register``); spelled in the SQL functions (pg_lease_wake_waiters) and in the
#: ``listen`` statement too.
NOTIFY_CHANNEL = "pg_lease_django"
