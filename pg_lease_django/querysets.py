"""How leases are read: `LeaseQuerySet` (``Lease.objects``), for the admin, ``manage.py leases`` and ``leases run``.

Every state is computed in SQL by ``pg_lease_status(owner, expires_at, now)`` of
``sql/schema.sql``: free without an owner, held until ``expires_at``, lapsed after. It is the rule
the lease functions apply, against the database server's clock. Python's clock is never used, as
it may disagree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from django.db import connections
from django.db.models import (
    BooleanField,
    CharField,
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    FloatField,
    Func,
    QuerySet,
    Value,
    Window,
)
from django.db.models.lookups import In

from .display import LeaseRow
from .sql import run, statements
from .status import LeaseStatus

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models.sql.compiler import SQLCompiler

    from .models import Lease  # noqa: F401  (named in the QuerySet["Lease"] base)

__all__ = [
    "LeaseQuerySet",
    "Listing",
    "ServerNow",
    "StatusAt",
    "collation_is_bytewise",
    "glob_to_like",
    "key_collation",
    "lease_state",
    "prefix_upper_bound",
]

# Collations in which text sorts by code point (UTF-8 byte order), so that every key starting
# with a prefix lies in one contiguous range of the primary-key index.
_BYTEWISE_LIBC_LOCALES = {"c", "posix", "c.utf-8", "c.utf8"}
# ISO 8601 in UTC, always with microseconds: the stable JSON form of every time the command shows.
_ISO = """'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'"""


class ServerNow(Func):
    """The database server's clock: ``(SELECT clock_timestamp())``.

    An uncorrelated sub-select is evaluated once per statement, as an InitPlan. So every row is
    judged against the same instant, read after the statement's snapshot was taken: no row it sees
    was written later. It reads ``clock_timestamp()`` rather than ``now()``, which is frozen at the
    start of the transaction. Each ServerNow of a statement is read on its own, microseconds apart.
    """

    template = "(SELECT clock_timestamp())"
    output_field = DateTimeField()


class StatusAt(Func):
    """``pg_lease_status(owner, expires_at, at)``, named with its schema like every call the package sends."""

    output_field = CharField()

    def as_postgresql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, Any]:
        function = run.render(connection, statements.STATUS_FUNCTION)
        return self.as_sql(compiler, connection, function=function, **extra_context)


def lease_state() -> Func:
    """``pg_lease_status(owner, expires_at, server now)``: the lease functions' own status rule, in SQL."""
    return StatusAt(F("owner"), F("expires_at"), ServerNow())


class _UtcText(Func):
    """A timestamp as ``_ISO`` text: formatted by the server, not parsed and re-printed in Python."""

    template = f"to_char(%(expressions)s AT TIME ZONE 'UTC', {_ISO})"
    output_field = CharField()


class _Seconds(Func):
    """An interval in seconds, as a float."""

    template = "extract(epoch FROM %(expressions)s)::float8"
    output_field = FloatField()


class _StartsWith(Func):
    """``starts_with(text, prefix)``: the prefix is literal text (``%`` and ``_`` are no wildcards)."""

    function = "starts_with"
    output_field = BooleanField()


class _Like(Func):
    """``text LIKE pattern`` (``\\`` escapes), for a pattern `glob_to_like` wrote."""

    arg_joiner = " LIKE "
    template = "(%(expressions)s)"
    output_field = BooleanField()


@dataclass(frozen=True)
class Listing:
    """What `LeaseQuerySet.listing` read: the rows, how many matched in all, the server time."""

    rows: list[LeaseRow]
    count: int
    server_time: str


class LeaseQuerySet(QuerySet["Lease"]):
    """``Lease.objects``' queries: the state on the server clock and the operators' filters."""

    def with_state(self) -> Self:
        """Annotate ``state``, a `LeaseStatus` value, and the timedeltas ``expires_in`` and ``held_for``.

        All three come from the server clock. ``expires_in`` is ``expires_at`` minus now, negative
        when lapsed. ``held_for`` is now minus ``acquired_at``. Both are None when free. Filter and
        order by ``state`` freely.
        """
        return self.annotate(
            state=lease_state(),
            expires_in=ExpressionWrapper(F("expires_at") - ServerNow(), output_field=DurationField()),
            held_for=ExpressionWrapper(ServerNow() - F("acquired_at"), output_field=DurationField()),
        )

    def matching(
        self,
        *,
        prefix: str | None = None,
        glob: str | None = None,
        owner: str | None = None,
        states: Iterable[str] | None = None,
    ) -> Self:
        """The leases matching every filter given; None is no filter.

        Args:
            prefix: keys starting with this text, taken literally: ``%`` and ``_`` are no wildcards.
            glob: keys matching this pattern: ``*`` any text, ``?`` one character.
            owner: leases held, or last held if lapsed, by this owner.
            states: leases in one of these `LeaseStatus` states, on the server clock.

        ``starts_with`` and ``LIKE`` decide what matches. When the key column sorts by code point, a
        prefix or a glob's literal start also becomes a range on the key. PostgreSQL then walks the
        primary-key index instead of the table. Knowing the sort order costs one catalog query, made
        here.
        """
        queryset = self
        index_prefix = prefix or ""
        if prefix is not None:
            queryset = queryset.filter(_StartsWith(F("key"), Value(prefix)))
        if glob is not None:
            like, literal = glob_to_like(glob)
            queryset = queryset.filter(_Like(F("key"), Value(like)))
            index_prefix = max(index_prefix, literal, key=len)  # both must hold: the longer narrows more
        if index_prefix:
            queryset = queryset._index_range(index_prefix)  # noqa: SLF001 (a queryset of this class)
        if owner is not None:
            queryset = queryset.filter(owner=owner)
        if states is not None:
            requested = {LeaseStatus(state) for state in states}  # ValueError for a state that does not exist
            if len(requested) < len(LeaseStatus):
                queryset = queryset.filter(
                    In(lease_state(), [state.value for state in LeaseStatus if state in requested])
                )
        return queryset

    def _index_range(self, prefix: str) -> Self:
        # key >= prefix AND key < the next string: the planner walks the primary-key index instead
        # of the table. That means "starts with prefix" only when the key column sorts by code point
        # (C, C.UTF-8, builtin); in other collations keys sharing a prefix are not contiguous, so
        # there we add nothing (a sequential scan, still correct). LIKE 'prefix%' would not do:
        # PostgreSQL uses the index for it only under "C" or "POSIX".
        connection = connections[self.db]
        if not collation_is_bytewise(key_collation(connection, connection.ops.quote_name(self.model._meta.db_table))):
            return self
        upper = prefix_upper_bound(prefix)
        return self.filter(key__gte=prefix) if upper is None else self.filter(key__gte=prefix, key__lt=upper)

    def listing(self, limit: int | None = None) -> Listing:
        """The operator's view in one statement: rows, the count of every match and the server time.

        The rows are sorted by key, at most ``limit`` of them. The count is ``count(*) OVER ()``,
        which ignores the limit.

        No per-row query and no per-row function call: ``pg_lease_status`` is inlined by the planner.
        """
        rows, count = self._read(limit)
        if not rows:
            return Listing([], 0, _server_time(connections[self.db]))
        return Listing(rows, count, rows[0].server_time)

    def row(self, key: str) -> LeaseRow | None:
        """The lease ``key`` as `listing` shows it, or None when it has no row (never acquired)."""
        rows, _count = self.filter(key=key)._read()  # noqa: SLF001 (a queryset of this class)
        return rows[0] if rows else None

    def _read(self, limit: int | None = None) -> tuple[list[LeaseRow], int]:
        queryset = (
            self.with_state()
            .annotate(
                acquired_text=_UtcText("acquired_at"),
                expires_text=_UtcText("expires_at"),
                expires_in_seconds=_Seconds(
                    ExpressionWrapper(F("expires_at") - ServerNow(), output_field=DurationField())
                ),
                server_time=_UtcText(ServerNow()),
                total=Window(Count("*")),
            )
            .order_by("key")
            .values_list(
                "key",
                "state",
                "owner",
                "epoch",
                "acquired_text",
                "expires_text",
                "expires_in_seconds",
                "server_time",
                "total",
            )
        )
        raw = list(queryset if limit is None else queryset[:limit])
        rows = [
            LeaseRow(key, LeaseStatus(state), owner, epoch, acquired_at, expires_at, expires_in, server_time)
            for key, state, owner, epoch, acquired_at, expires_at, expires_in, server_time, _total in raw
        ]
        return rows, raw[0][-1] if raw else 0


def _server_time(connection: BaseDatabaseWrapper) -> str:
    return run.one(connection, statements.SERVER_NOW_TEXT)


def prefix_upper_bound(prefix: str) -> str | None:
    """The smallest string above every string that starts with ``prefix``, in code point order.

    None when there is none (the prefix is made of U+10FFFF only): then the range is open-ended.
    """
    chars = list(prefix)
    while chars:
        code = ord(chars.pop()) + 1
        if 0xD800 <= code <= 0xDFFF:  # surrogates cannot be stored: skip to the next real character
            code = 0xE000
        if code <= 0x10FFFF:
            return "".join(chars) + chr(code)
    return None


def glob_to_like(pattern: str) -> tuple[str, str]:
    """Translate a glob to a LIKE pattern that escapes with ``\\``: ``*`` is any run, ``?`` one character.

    Returns:
        The LIKE pattern and the glob's literal prefix: the text before its first wildcard.
    """
    like: list[str] = []
    literal: list[str] = []
    in_prefix = True
    for char in pattern:
        if char == "*":
            like.append("%")
            in_prefix = False
        elif char == "?":
            like.append("_")
            in_prefix = False
        else:
            like.append("\\" + char if char in "\\%_" else char)
            if in_prefix:
                literal.append(char)
    return "".join(like), "".join(literal)


def collation_is_bytewise(settings: dict[str, Any]) -> bool:
    """Whether a collation, given as rows of ``pg_collation`` / ``pg_database`` in JSON, sorts by code point.

    The builtin provider of PostgreSQL 17+ always does; libc does for C, POSIX and C.UTF-8; ICU
    never does. Anything unknown counts as not bytewise, which takes the slower, always-correct
    path.
    """
    provider = settings.get("provider") or "c"
    if provider == "b":
        return True
    if provider != "c":
        return False
    return str(settings.get("collate") or "").lower() in _BYTEWISE_LIBC_LOCALES


def key_collation(connection: BaseDatabaseWrapper, table: str) -> dict[str, Any]:
    """The collation of ``table``'s key column as ``{"provider": ..., "collate": ...}``, or {} if unknown.

    "default" means the database's. to_jsonb() reads pg_database whatever columns this server
    version has; datlocprovider appeared in 15.
    """
    row = run.first(connection, statements.KEY_COLLATION, table=table)
    if row is None:
        return {}
    return json.loads(row) if isinstance(row, str) else dict(row)
