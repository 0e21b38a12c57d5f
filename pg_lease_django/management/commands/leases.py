"""``manage.py leases``: see who holds what, and break a stuck lease safely.

Subcommands: ``list`` (the default), ``show KEY``, ``release KEY --force``. Every state shown is
computed in SQL from the database server's clock with ``pg_lease_status`` (the rule the lease
functions use), in one statement, whatever the number of leases.

Exit codes (also in docs/operations.md):

==  ==========================================================================================
0   success
1   database error (the message says which)
2   bad arguments: unknown option, bad key, epoch or limit, unknown or non-PostgreSQL database
3   no such lease: the key was never acquired
4   ``release`` refused: ``--force`` not given
5   ``release`` refused: the lease moved on (``--epoch`` is not the current epoch, or it
    changed hands while being released)
6   ``release``: nothing to release, the lease is already free
==  ==========================================================================================
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django.exceptions import EpochMismatchError, InvalidInputError, NotOwnerError
from pg_lease_django.management import describe_expiry
from pg_lease_django.models import Lease
from pg_lease_django.validation import MAX_EPOCH, check_name

EXIT_OK = 0
EXIT_DATABASE_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_NOT_FORCED = 4
EXIT_MOVED_ON = 5
EXIT_ALREADY_FREE = 6

STATES = ("held", "lapsed", "free")

# Times leave the server as ISO 8601 text in UTC, always with microseconds: the stable JSON form,
# and ~20x cheaper for 100k rows than parsing timestamps into datetimes only to print them again.
_ISO = """'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'"""

# One statement for list and show. The server clock is read once (a MATERIALIZED CTE), so every
# row's state and "expires in" are relative to the same instant. pg_lease_status is inlined by
# the planner; no per-row function call, no per-row query. count(*) OVER () gives the number of
# matching rows even when --limit cuts the output.
_SELECT = f"""
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT l.key, pg_lease_status(l.owner, l.expires_at, clock.now), l.owner, l.epoch,
       to_char(l.acquired_at AT TIME ZONE 'UTC', {_ISO}), to_char(l.expires_at AT TIME ZONE 'UTC', {_ISO}),
       extract(epoch FROM l.expires_at - clock.now)::float8, to_char(clock.now AT TIME ZONE 'UTC', {_ISO}),
       count(*) OVER ()
  FROM {{table}} l CROSS JOIN clock
 WHERE {{where}}
 ORDER BY l.key
 {{limit}}
"""
_NOW = f"SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', {_ISO})"

# Collations in which text sorts by code point (UTF-8 byte order), so that every key starting
# with a prefix lies in one contiguous range of the primary-key index.
_BYTEWISE_LIBC_LOCALES = {"c", "posix", "c.utf-8", "c.utf8"}


@dataclass(frozen=True)
class LeaseRow:
    """One lease as the operator sees it, all times from the server clock.

    Attributes:
        key: the lease key.
        state: ``"held"``, ``"lapsed"`` or ``"free"``.
        owner: the holder (the former holder when lapsed), None when free.
        epoch: the current epoch.
        acquired_at: when the current or lapsed grant was made (ISO 8601, UTC); None when free.
        expires_at: when it lapses (lapsed) (ISO 8601, UTC); None when free.
        expires_in: seconds from ``server_time`` to ``expires_at`` (negative when lapsed); None when free.
        server_time: the server clock the state was computed at (ISO 8601, UTC).
    """

    key: str
    state: str
    owner: str | None
    epoch: int
    acquired_at: str | None
    expires_at: str | None
    expires_in: float | None
    server_time: str

    def as_json(self) -> dict[str, Any]:
        """The stable JSON form: these field names, ISO 8601 times, ``expires_in_seconds`` as a float."""
        return {
            "key": self.key,
            "state": self.state,
            "owner": self.owner,
            "epoch": self.epoch,
            "acquired_at": self.acquired_at,
            "expires_at": self.expires_at,
            "expires_in_seconds": self.expires_in,
        }

    @property
    def expiry(self) -> str:
        """When it expires, for people: ``in 29s``, ``lapsed 3m 05s ago``, ``-``."""
        return describe_expiry(self.state, None if self.expires_in is None else timedelta(seconds=self.expires_in))


def _shown(iso: str | None) -> str:
    """A time for people: UTC, to the second (``2026-05-01 12:00:03Z``)."""
    return "-" if iso is None else f"{iso[:10]} {iso[11:19]}Z"


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
    """Translate a glob (``*`` any run, ``?`` one character) to a LIKE pattern (escape ``\\``).

    Returns:
        The LIKE pattern and the glob's literal prefix (the text before its first wildcard).
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
    """Whether a collation (rows of ``pg_collation`` / ``pg_database`` as JSON) sorts by code point.

    The builtin provider (PostgreSQL 17+) always does; libc does for C, POSIX and C.UTF-8; ICU
    never does. Anything unknown counts as not bytewise (the slower, always-correct path).
    """
    provider = settings.get("provider") or "c"
    if provider == "b":
        return True
    if provider != "c":
        return False
    return str(settings.get("collate") or "").lower() in _BYTEWISE_LIBC_LOCALES


def _key_collation(connection: BaseDatabaseWrapper, table: str) -> dict[str, Any]:
    # The key column's collation; "default" means the database's. to_jsonb() reads pg_database
    # whatever columns this server version has (datlocprovider appeared in 15).
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT CASE WHEN c.collname = 'default'
                        THEN (SELECT jsonb_build_object('provider', coalesce(to_jsonb(d)->>'datlocprovider', 'c'),
                                                        'collate', d.datcollate)
                                FROM pg_database d WHERE d.datname = current_database())
                        ELSE jsonb_build_object('provider', c.collprovider::text, 'collate', c.collcollate)
                   END
              FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
             WHERE a.attrelid = %s::regclass AND a.attname = 'key'
            """,
            [table],
        )
        row = cursor.fetchone()
    if row is None:
        return {}
    value = row[0]
    return json.loads(value) if isinstance(value, str) else dict(value)


class Command(BaseCommand):
    """``manage.py leases [list|show|release] ...``: the operators' view of the lease table."""

    help = (
        "Inspect leases and break stuck ones. Subcommands: list (default), show KEY, "
        "release KEY --force. Exit codes: 0 ok, 1 database error, 2 bad arguments, 3 no such lease, "
        "4 release without --force, 5 lease moved on, 6 already free."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Declare the subcommands; ``--database`` and ``--no-color`` are accepted before or after them."""
        parser.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, help="Database alias holding the leases (default: %(default)s)."
        )
        subparsers = parser.add_subparsers(dest="subcommand", title="subcommands", metavar="{list,show,release}")

        list_parser = subparsers.add_parser("list", help="Table of leases, sorted by key (the default).")
        list_parser.add_argument(
            "--state", action="append", choices=STATES, help="Only leases in this state (repeatable)."
        )
        list_parser.add_argument("--prefix", help="Only keys starting with this text (uses the primary-key index).")
        list_parser.add_argument("--glob", help="Only keys matching this glob: * any text, ? one character.")
        list_parser.add_argument("--owner", help="Only leases held (or last held, if lapsed) by this owner.")
        list_parser.add_argument("--limit", help="Show at most this many leases (the count still covers all).")
        list_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        show_parser = subparsers.add_parser("show", help="One lease in detail.")
        show_parser.add_argument("key", help="The lease key.")
        show_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        release_parser = subparsers.add_parser(
            "release", help="Force-release a lease: the epoch goes up and its holder is fenced."
        )
        release_parser.add_argument("key", help="The lease key.")
        release_parser.add_argument("--force", action="store_true", help="Required: this overrides the holder.")
        release_parser.add_argument("--epoch", help="Release only if this is still the current epoch.")
        release_parser.add_argument("--dry-run", action="store_true", help="Say what would happen; change nothing.")
        release_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        for sub in (list_parser, show_parser, release_parser):
            # SUPPRESS: a subcommand that is not given these must not overwrite the top-level value.
            sub.add_argument("--database", default=argparse.SUPPRESS, help="Database alias holding the leases.")
            sub.add_argument("--no-color", action="store_true", default=argparse.SUPPRESS, help="Don't colorize.")
            sub.add_argument("--force-color", action="store_true", default=argparse.SUPPRESS, help="Force colors.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the subcommand; every failure becomes a one-line :class:`CommandError` with its exit code."""
        alias = self._database(options["database"])
        subcommand = options.get("subcommand") or "list"
        try:
            if subcommand == "show":
                self._show(alias, options)
            elif subcommand == "release":
                self._release(alias, options)
            else:
                self._list(alias, options)
        except InvalidInputError as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        except DatabaseError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(f"database error: {first_line}", returncode=EXIT_DATABASE_ERROR) from None

    # -- arguments -------------------------------------------------------------------------------

    @staticmethod
    def _database(alias: str) -> str:
        if alias not in connections:
            raise CommandError(f"unknown database alias {alias!r}", returncode=EXIT_USAGE)
        vendor = connections[alias].vendor
        if vendor != "postgresql":
            raise CommandError(f"database {alias!r} is {vendor}, not PostgreSQL", returncode=EXIT_USAGE)
        return alias

    @staticmethod
    def _positive_int(name: str, text: str | None) -> int | None:
        if text is None:
            return None
        try:
            value = int(text, 10)
        except ValueError:
            raise CommandError(f"{name} must be a whole number, got {text!r}", returncode=EXIT_USAGE) from None
        if not 1 <= value <= MAX_EPOCH:
            raise CommandError(f"{name} must be between 1 and {MAX_EPOCH}, got {value}", returncode=EXIT_USAGE)
        return value

    @staticmethod
    def _pattern(name: str, text: str | None) -> str | None:
        if text is None:
            return None
        if not text or "\x00" in text:
            raise CommandError(f"{name} must be non-empty text without NUL characters", returncode=EXIT_USAGE)
        return text

    # -- reading -----------------------------------------------------------------------------------

    def _fetch(
        self, alias: str, where: Sequence[str], params: Sequence[Any], limit: int | None = None
    ) -> tuple[list[LeaseRow], int, str]:
        connection = connections[alias]
        table = connection.ops.quote_name(Lease._meta.db_table)
        sql = _SELECT.format(
            table=table,
            where=" AND ".join(where) or "true",
            limit="" if limit is None else "LIMIT %s",
        )
        query_params = [*params] if limit is None else [*params, limit]
        with connection.cursor() as cursor:
            cursor.execute(sql, query_params)
            raw = cursor.fetchall()
            if raw:
                total, server_time = raw[0][8], raw[0][7]
            else:
                cursor.execute(_NOW)
                (server_time,) = cursor.fetchone()
                total = 0
        rows = [LeaseRow(*row[:8]) for row in raw]
        return rows, total, server_time

    def _fetch_one(self, alias: str, key: str) -> LeaseRow | None:
        rows, _total, _server_time = self._fetch(alias, ["l.key = %s"], [key])
        return rows[0] if rows else None

    def _index_range(self, alias: str, prefix: str) -> tuple[list[str], list[Any]]:
        # A range on the key (key >= prefix AND key < next string) lets the planner walk the
        # primary-key index instead of the whole table. It only means "starts with prefix" when the
        # key column sorts by code point (C, C.UTF-8, builtin); in other collations keys sharing a
        # prefix are not contiguous, so there we add nothing (a sequential scan, still correct).
        # LIKE 'prefix%' would not do: PostgreSQL uses the index for it only under "C" or "POSIX".
        connection = connections[alias]
        if not collation_is_bytewise(_key_collation(connection, connection.ops.quote_name(Lease._meta.db_table))):
            return [], []
        where, params = ["l.key >= %s"], [prefix]
        upper = prefix_upper_bound(prefix)
        if upper is not None:
            where.append("l.key < %s")
            params.append(upper)
        return where, params

    # -- list ----------------------------------------------------------------------------------------

    def _list(self, alias: str, options: dict[str, Any]) -> None:
        prefix = self._pattern("--prefix", options.get("prefix"))
        glob = self._pattern("--glob", options.get("glob"))
        owner = options.get("owner")
        if owner is not None:
            check_name("owner", owner)
        limit = self._positive_int("--limit", options.get("limit"))
        states = sorted(set(options.get("state") or []), key=STATES.index)

        # starts_with / LIKE decide what matches; the index range only makes it fast.
        where: list[str] = []
        params: list[Any] = []
        index_prefix = prefix or ""
        if prefix is not None:
            where.append("starts_with(l.key, %s)")
            params.append(prefix)
        if glob is not None:
            like, glob_prefix = glob_to_like(glob)
            where.append("l.key LIKE %s")
            params.append(like)
            index_prefix = max(index_prefix, glob_prefix, key=len)  # both must hold: the longer narrows more
        if index_prefix:
            range_where, range_params = self._index_range(alias, index_prefix)
            where += range_where
            params += range_params
        if owner is not None:
            where.append("l.owner = %s")
            params.append(owner)
        if states and len(states) < len(STATES):
            where.append("pg_lease_status(l.owner, l.expires_at, clock.now) = ANY(%s)")
            params.append(states)

        rows, total, server_time = self._fetch(alias, where, params, limit)
        if options.get("json"):
            document = {"server_time": server_time, "count": total, "leases": [r.as_json() for r in rows]}
            self.stdout.write(json.dumps(document, indent=2, ensure_ascii=False))
            return
        self._table(rows)
        summary = f"{total} lease{'' if total == 1 else 's'}"
        if len(rows) < total:
            summary = f"showing {len(rows)} of {summary}"
        self.stdout.write(f"{summary} (server time {_shown(server_time)})")

    def _table(self, rows: Sequence[LeaseRow]) -> None:
        if not rows:
            return
        header = ("KEY", "STATE", "OWNER", "EPOCH", "EXPIRES", "ACQUIRED AT")
        cells = [
            (
                row.key,
                row.state,
                row.owner or "-",
                str(row.epoch),
                row.expiry,
                _shown(row.acquired_at),
            )
            for row in rows
        ]
        widths = [max(len(header[i]), *(len(c[i]) for c in cells)) for i in range(len(header))]
        right = {3}  # the epoch column is right-aligned

        def line(values: Sequence[str]) -> list[str]:
            return [
                v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
            ]

        out = [self.style.MIGRATE_HEADING("  ".join(line(header)).rstrip())]
        for values in cells:
            padded = line(values)
            padded[1] = self._state_style(values[1], padded[1])
            out.append("  ".join(padded).rstrip())
        self.stdout.write("\n".join(out))

    def _state_style(self, state: str, text: str) -> str:
        if state == "held":
            return self.style.SUCCESS(text)
        if state == "lapsed":
            return self.style.WARNING(text)
        return text

    # -- show ----------------------------------------------------------------------------------------

    def _show(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        row = self._fetch_one(alias, key)
        if row is None:
            raise CommandError(f"no lease with key {key!r} (never acquired)", returncode=EXIT_NOT_FOUND)
        if options.get("json"):
            self.stdout.write(json.dumps({**row.as_json(), "server_time": row.server_time}, indent=2))
            return
        expires = "-" if row.expires_at is None else f"{_shown(row.expires_at)} ({row.expiry})"
        facts = [
            ("key", row.key),
            ("state", self._state_style(row.state, row.state)),
            ("owner", row.owner or "-"),
            ("epoch", str(row.epoch)),
            ("acquired at", _shown(row.acquired_at)),
            ("expires at", expires),
            ("server time", _shown(row.server_time)),
        ]
        self.stdout.write("\n".join(f"{name + ':':<13}{value}" for name, value in facts))

    # -- release -------------------------------------------------------------------------------------

    def _release(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        expected = self._positive_int("--epoch", options.get("epoch"))
        row = self._fetch_one(alias, key)
        if row is None:
            raise CommandError(f"no lease with key {key!r} (never acquired)", returncode=EXIT_NOT_FOUND)
        if row.state == "free":
            raise CommandError(
                f"lease {key!r} is already free (epoch {row.epoch}): nothing to release", returncode=EXIT_ALREADY_FREE
            )
        holder = f"{row.state} by {row.owner!r}, expires {row.expiry}"
        if expected is not None and expected != row.epoch:
            raise CommandError(
                f"lease {key!r} has moved on: its epoch is {row.epoch} ({holder}), not {expected}; nothing released",
                returncode=EXIT_MOVED_ON,
            )
        if options.get("dry_run"):
            self._report(options, row, row.epoch + 1, dry_run=True)
            return
        if not options.get("force"):
            raise CommandError(
                f"refusing to release {key!r} (epoch {row.epoch}, {holder}) without --force",
                returncode=EXIT_NOT_FORCED,
            )
        try:
            # The epoch we looked at, not "whatever is there now": we report who we released.
            new_epoch = Lease.objects.db_manager(alias).force_release(key, epoch=row.epoch)
        except EpochMismatchError as exc:
            raise CommandError(f"{exc}; nothing released", returncode=EXIT_MOVED_ON) from None
        except NotOwnerError as exc:
            raise CommandError(str(exc), returncode=EXIT_ALREADY_FREE) from None
        self._report(options, row, new_epoch, dry_run=False)

    def _report(self, options: dict[str, Any], row: LeaseRow, new_epoch: int, *, dry_run: bool) -> None:
        if options.get("json"):
            document = {
                "key": row.key,
                "released": not dry_run,
                "dry_run": dry_run,
                "previous_owner": row.owner,
                "previous_state": row.state,
                "previous_epoch": row.epoch,
                "epoch": new_epoch,
            }
            self.stdout.write(json.dumps(document, indent=2))
            return
        was = f"{row.state} by {row.owner!r} at epoch {row.epoch}"
        if dry_run:
            self.stdout.write(f"Dry run: would release {row.key!r} ({was}); its epoch would become {new_epoch}.")
        else:
            self.stdout.write(self.style.SUCCESS(f"Released {row.key!r} ({was}). New epoch: {new_epoch}"))
