"""``manage.py leases``: see who holds what, and break a stuck lease safely.

Subcommands: ``list`` (the default), ``show KEY``, ``release KEY --force``,
``prune --free-for 30d`` (delete rows of leases free that long; epochs never go back), and
``run KEY --ttl SECONDS -- COMMAND``, which runs a command while holding a lease (``flock(1)`` for a
whole cluster). Every state shown is computed in SQL from the database server's clock with
``pg_lease_status`` (the rule the lease functions use), in one statement, whatever the number of
leases.

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

``run`` exits with its COMMAND's status (128 + N when a signal N killed it, as a shell reports
it), or with one of these, kept clear of 0-6 above and of the shell's 126, 127 and 128 + N:

===  =========================================================================================
75   busy: the lease is held by another owner; COMMAND was not run (sysexits' EX_TEMPFAIL:
     "try again later", which is what a caller should do)
76   lost: the lease was lost while COMMAND ran (it was sent SIGTERM, then SIGKILL after
     ``--grace``), or at its end the lease turned out to have moved on
77   timed out: ``--wait`` passed and the lease was still held; COMMAND was not run
126  COMMAND could not be executed (permission denied, not an executable)
127  COMMAND was not found
===  =========================================================================================
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections, router
from django.db.backends.base.base import BaseDatabaseWrapper

from pg_lease_django import sql as lease_sql
from pg_lease_django.exceptions import (
    EpochMismatchError,
    InvalidInputError,
    LeaseTimeoutError,
    NotAcquirableError,
    NotOwnerError,
)
from pg_lease_django.jobs import HeldLease, hold
from pg_lease_django.management import describe_expiry, format_duration
from pg_lease_django.models import Lease
from pg_lease_django.validation import MAX_EPOCH, MAX_TTL, MAX_WAIT, MIN_TTL, check_name

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_DATABASE_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_NOT_FORCED = 4
EXIT_MOVED_ON = 5
EXIT_ALREADY_FREE = 6
# leases run (see the module docstring for why these numbers).
EXIT_BUSY = 75
EXIT_LOST = 76
EXIT_TIMED_OUT = 77
EXIT_CANNOT_EXECUTE = 126
EXIT_COMMAND_NOT_FOUND = 127

#: Seconds between the SIGTERM sent to COMMAND when the lease is lost and the SIGKILL that follows.
DEFAULT_GRACE = 10.0
#: Signals ``leases run`` passes on to COMMAND.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# How often the "waiting for KEY held by OWNER" line on a terminal is refreshed, and how long a
# wait must last before it first appears (an acquire that succeeds at once shows nothing).
_STATUS_REFRESH = 0.25

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
SELECT l.key, {{schema}}.pg_lease_status(l.owner, l.expires_at, clock.now), l.owner, l.epoch,
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


class SubcommandParser(CommandParser):
    """The parser of each subcommand; ``run``'s also splits its argument list at the first ``--``.

    argparse cannot take "options, then ``--``, then a command line with options of its own": a
    ``REMAINDER`` positional swallows the options after KEY, a ``*`` one is matched empty before
    them. So ``run`` parses what precedes ``--`` itself and stores what follows, untouched, in
    ``command``. Arguments it does not know end up in ``unexpected`` (reported as one line) rather
    than in argparse's usage-and-exit error.
    """

    #: Set on the ``run`` subparser only.
    command_after_dashes = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse as argparse does; for ``run``, everything after the first ``--`` is COMMAND."""
        if not self.command_after_dashes or args is None:
            return super().parse_known_args(args, namespace)
        words = list(args)
        command: list[str] = []
        if "--" in words:
            split = words.index("--")
            words, command = words[:split], words[split + 1 :]
        parsed, unexpected = super().parse_known_args(words, namespace)
        parsed.command = command
        parsed.unexpected = unexpected
        return parsed, []


class Command(BaseCommand):
    """``manage.py leases [list|show|release|run] ...``: the operators' view of the lease table."""

    help = (
        "Inspect leases, break stuck ones, run a command under a lease. Subcommands: list (default), "
        "show KEY, release KEY --force, run KEY --ttl SECONDS -- COMMAND. Exit codes: 0 ok, 1 database "
        "error, 2 bad arguments, 3 no such lease, 4 release without --force, 5 lease moved on, 6 already "
        "free; run: COMMAND's status, 75 busy, 76 lease lost, 77 timed out waiting, 126/127 COMMAND "
        "not executable/not found."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Declare the subcommands; ``--database`` and ``--no-color`` are accepted before or after them."""
        parser.add_argument(
            "--database",
            default=None,
            help="Database alias holding the leases (default: where DATABASE_ROUTERS send writes of leases).",
        )
        subparsers = parser.add_subparsers(
            dest="subcommand",
            title="subcommands",
            metavar="{list,show,release,prune,run}",
            parser_class=SubcommandParser,
        )

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

        prune_parser = subparsers.add_parser(
            "prune",
            help="Delete the rows of leases free for at least --free-for; a key that comes back starts above its past.",
        )
        prune_parser.add_argument(
            "--free-for", required=True, help="How long a lease must have been free: 30d, 12h, 90m, 45s or seconds."
        )
        prune_parser.add_argument("--dry-run", action="store_true", help="List what would go; change nothing.")
        prune_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        run_parser = subparsers.add_parser(
            "run",
            help="Run COMMAND while holding the lease KEY (renewed by heartbeats, released at the end).",
            usage=(
                "%(prog)s KEY --ttl SECONDS [--wait SECONDS] [--owner ID] [--grace SECONDS] [--database ALIAS] "
                "-- COMMAND [ARGS ...]"
            ),
            description=(
                "Acquire KEY, run COMMAND with PG_LEASE_KEY, PG_LEASE_OWNER and PG_LEASE_EPOCH in its environment, "
                "renew the lease while it runs, release it when it ends. If the lease is lost, COMMAND gets SIGTERM, "
                "then SIGKILL after --grace seconds. SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to "
                "COMMAND. Exit status: COMMAND's (128+N if signal N killed it); 75 busy, 76 lease lost, 77 timed out "
                "waiting, 126 cannot execute, 127 not found."
            ),
        )
        assert isinstance(run_parser, SubcommandParser)
        run_parser.command_after_dashes = True
        run_parser.add_argument("key", help="The lease key.")
        run_parser.add_argument(
            "--ttl", help="Required. Seconds each grant and renewal lasts; renewed every TTL/3 while COMMAND runs."
        )
        run_parser.add_argument(
            "--wait", help="Wait up to this many seconds for the lease (default: don't wait; busy exits 75)."
        )
        run_parser.add_argument("--owner", help="Owner identity (default: host:pid:random, new for every run).")
        run_parser.add_argument(
            "--grace",
            help=f"Seconds between SIGTERM and SIGKILL when the lease is lost (default: {DEFAULT_GRACE:g}).",
        )

        # run: Django's -v/--verbosity after the subcommand too (2 reports the grant and the release on stderr).
        run_parser.add_argument(
            "-v", "--verbosity", type=int, choices=[0, 1, 2, 3], default=argparse.SUPPRESS, help="Verbosity level."
        )

        for sub in (list_parser, show_parser, release_parser, prune_parser, run_parser):
            # SUPPRESS: a subcommand that is not given these must not overwrite the top-level value.
            sub.add_argument("--database", default=argparse.SUPPRESS, help="Database alias holding the leases.")
            sub.add_argument("--no-color", action="store_true", default=argparse.SUPPRESS, help="Don't colorize.")
            sub.add_argument("--force-color", action="store_true", default=argparse.SUPPRESS, help="Force colors.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the subcommand; every failure becomes a one-line `CommandError` with its exit code."""
        alias = self._database(options["database"] or router.db_for_write(Lease))
        subcommand = options.get("subcommand") or "list"
        try:
            if subcommand == "show":
                self._show(alias, options)
            elif subcommand == "release":
                self._release(alias, options)
            elif subcommand == "prune":
                self._prune(alias, options)
            elif subcommand == "run":
                self._run(alias, options)
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
        schema = lease_sql.schema(connection)
        sql = _SELECT.format(
            schema=schema,
            table=table,
            where=(" AND ".join(where) or "true").replace("{schema}", schema),
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
            where.append("{schema}.pg_lease_status(l.owner, l.expires_at, clock.now) = ANY(%s)")
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

    def _prune(self, alias: str, options: dict[str, Any]) -> None:
        free_for = _duration("--free-for", options["free_for"])
        dry_run = bool(options.get("dry_run"))
        keys = Lease.objects.db_manager(alias).prune(free_for=free_for, dry_run=dry_run)
        if options.get("json"):
            self.stdout.write(json.dumps({"dry_run": dry_run, "free_for_seconds": free_for, "keys": keys}, indent=2))
            return
        listing = "".join(f"\n  {key}" for key in keys)
        if dry_run:
            self.stdout.write(
                f"Dry run: would prune {len(keys)} lease(s) free for at least {options['free_for']}.{listing}"
            )
        else:
            self.stdout.write(
                self.style.SUCCESS(f"Pruned {len(keys)} lease(s) free for at least {options['free_for']}.") + listing
            )

    # -- run -----------------------------------------------------------------------------------------

    def _run(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        if options.get("ttl") is None:
            raise CommandError("--ttl is required: how many seconds each grant lasts", returncode=EXIT_USAGE)
        ttl = _seconds("--ttl", options["ttl"], MIN_TTL, MAX_TTL)
        wait = None if options.get("wait") is None else _seconds("--wait", options["wait"], timedelta(0), MAX_WAIT)
        grace = DEFAULT_GRACE
        if options.get("grace") is not None:
            grace = _seconds("--grace", options["grace"], timedelta(0), MAX_TTL)
        owner = options.get("owner")
        if owner is not None:
            check_name("owner", owner)
        unexpected: list[str] = options.get("unexpected") or []
        command: list[str] = options.get("command") or []
        if unexpected:
            raise CommandError(
                f"unexpected argument {unexpected[0]!r}: COMMAND goes after --, as in "
                "leases run KEY --ttl SECONDS -- COMMAND [ARGS ...]",
                returncode=EXIT_USAGE,
            )
        if not command or not command[0]:
            raise CommandError(
                "missing COMMAND: leases run KEY --ttl SECONDS -- COMMAND [ARGS ...]", returncode=EXIT_USAGE
            )
        if threading.current_thread() is not threading.main_thread():
            raise CommandError(
                "leases run must be called from the main thread (it handles signals)", returncode=EXIT_USAGE
            )
        runner = _Runner(
            self,
            alias,
            key,
            command,
            ttl=ttl,
            wait=wait or None,
            grace=grace,
            owner=owner,
            verbosity=options.get("verbosity", 1),
        )
        status = runner.run()
        if status:
            # Like Django's own `test` and `makemigrations --check`: the status is the whole message.
            raise SystemExit(status)


def _seconds(name: str, text: str, minimum: timedelta, maximum: timedelta) -> float:
    """Parse a command-line duration in seconds (``30``, ``0.5``) within ``[minimum, maximum]``."""
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"{name} must be a number of seconds, got {text!r}", returncode=EXIT_USAGE) from None
    low, high = minimum.total_seconds(), maximum.total_seconds()
    if not math.isfinite(value) or not low <= value <= high:
        raise CommandError(
            f"{name} must be between {low:.15g} and {high:.15g} seconds, got {text!r}", returncode=EXIT_USAGE
        )
    return value


_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(name: str, text: str) -> float:
    """Parse ``30d``, ``12h``, ``90m``, ``45s`` or plain seconds, up to ten years, into seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise CommandError(
            f"{name} must be a duration such as 30d, 12h, 90m or 45s, got {text!r}", returncode=EXIT_USAGE
        )
    seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    if seconds > 3650 * 86400:
        raise CommandError(f"{name} must be at most 3650d, got {text!r}", returncode=EXIT_USAGE)
    return seconds


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(returncode: int) -> str:
    """``exited with status 3`` / ``was killed by SIGKILL``, from a Popen return code."""
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    return f"exited with status {returncode}"


def _terminal_foreground() -> bool:
    """Whether this process group is the foreground group of the terminal on stdin/stdout/stderr.

    Then COMMAND stays in our process group, so that it can use the terminal, and Ctrl-C reaches
    it straight from the terminal (passing that SIGINT on would deliver it twice).
    """
    for fd in (0, 1, 2):
        with suppress(OSError):
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
    return False


class _Interrupted(BaseException):
    """A forwarded signal arrived before COMMAND started: stop waiting, release, exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _WaitStatus(threading.Thread):
    """On a terminal: one line on stderr, rewritten in place, while ``--wait`` waits for the lease.

    Reads the lease with the same query as ``leases show`` on a connection of this thread's own
    (the waiting acquire has its own too), and never blocks the wait: any failure only ends the
    status line.
    """

    def __init__(self, command: Command, alias: str, key: str, wait: float) -> None:
        super().__init__(name=f"leases run status {key}"[:100], daemon=True)
        self.command, self.alias, self.key, self.wait = command, alias, key, wait
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._shown = False

    def run(self) -> None:
        started = time.monotonic()
        try:
            while not self._stopped.wait(_STATUS_REFRESH):
                row = self.command._fetch_one(self.alias, self.key)
                waited = format_duration(timedelta(seconds=time.monotonic() - started))
                if row is None or row.state == "free":
                    text = f"waiting for {self.key} (free now)"
                elif row.state == "lapsed":
                    text = f"waiting for {self.key} (lapsed, last held by {row.owner})"
                else:
                    text = f"waiting for {self.key} held by {row.owner}, expires {row.expiry}"
                self._show(f"{text} (waited {waited} of {format_duration(timedelta(seconds=self.wait))})")
        except Exception:
            logger.debug("the wait status line for %r failed", self.key, exc_info=True)
        finally:
            connections.close_all()  # this thread's own

    def _show(self, text: str) -> None:
        with self._lock:
            if not self._stopped.is_set():
                self.command.stderr.write(f"\r\x1b[K{text}", style_func=str, ending="")
                self.command.stderr.flush()
                self._shown = True

    def stop(self) -> None:
        """Stop refreshing and erase the line (idempotent)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if self._shown:
                self.command.stderr.write("\r\x1b[K", style_func=str, ending="")
                self.command.stderr.flush()


class _Runner:
    """One ``leases run``: acquire with ``hold()``, run COMMAND, supervise it, release.

    The lease is held with `pg_lease_django.hold` (its heartbeat thread renews it on a
    connection of its own); this class only watches ``HeldLease.lost`` and the child. The main
    thread sleeps in one ``select()`` on the child's pidfd (it becomes readable when the child
    exits) and a pipe the hold's ``on_lost`` writes to, with a timeout at the end of the trust
    window and of the grace period. Signals are handled in the main thread: before COMMAND starts
    they interrupt the wait; afterwards they are passed on to COMMAND.
    """

    def __init__(
        self,
        command: Command,
        alias: str,
        key: str,
        argv: list[str],
        *,
        ttl: float,
        wait: float | None,
        grace: float,
        owner: str | None,
        verbosity: int,
    ) -> None:
        self.command, self.alias, self.key, self.argv = command, alias, key, argv
        self.verbosity = verbosity
        self.ttl, self.wait, self.grace, self.owner = ttl, wait, grace, owner
        self.child: subprocess.Popen[bytes] | None = None
        self._started = False  # from here on signals are forwarded, not raised
        self._interrupted = False  # a signal already stopped the wait: further ones must not cut the release short
        self._terminated_at_loss = False
        self._killed = False
        self._own_group = False
        self._pending: list[int] = []  # forwarded signals that arrived while COMMAND was being started
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- messages ------------------------------------------------------------------------------------

    def _say(self, text: str, *, level: int = 1) -> None:
        if self.verbosity >= level:
            self.command.stderr.write(f"leases run: {text}")
            self.command.stderr.flush()

    @property
    def _name(self) -> str:
        return os.path.basename(self.argv[0]) or self.argv[0]

    # -- signals -------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._started:
            if not self._interrupted:
                self._interrupted = True
                raise _Interrupted(signum)
            return
        if self.child is None:
            self._pending.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self.child
        # returncode is set only by poll()/wait() in this (the main) thread, where this handler
        # runs too: while it is None the child has not been reaped, so its pid is still its own.
        if child is None or child.returncode is not None:
            return
        if signum == signal.SIGINT and not self._own_group and _terminal_foreground():
            return  # Ctrl-C: the terminal sent it to COMMAND as well (same process group)
        self._signal(child, signum)

    def _signal(self, child: subprocess.Popen[bytes], signum: int) -> None:
        # COMMAND's whole process group when it has one of its own: a shell's children too.
        with suppress(ProcessLookupError, PermissionError):
            if self._own_group:
                os.killpg(child.pid, signum)
            else:
                os.kill(child.pid, signum)

    def _wake(self, lease: HeldLease) -> None:
        # on_lost of the hold, called once from its heartbeat thread.
        with self._wake_lock, suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    # -- the run -------------------------------------------------------------------------------------

    def run(self) -> int:
        """Acquire, run COMMAND, release; return the exit status (raise CommandError for 75/76/77)."""
        previous: dict[int, Any] = {}
        try:
            for signum in FORWARDED_SIGNALS:
                handler = signal.getsignal(signum)
                if handler == signal.SIG_IGN:
                    continue  # ignored when we started: stays ignored, for COMMAND too (as in a shell)
                previous[signum] = handler
                signal.signal(signum, self._on_signal)
            try:
                return self._hold_and_run()
            except _Interrupted as exc:
                self._say(f"{_signal_name(exc.signum)} before {self._name} started: not run, lease not held")
                return 128 + exc.signum
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _hold_and_run(self) -> int:
        holding = hold(
            self.key,
            self.ttl,
            owner=self.owner,
            blocking=self.wait is not None,
            timeout=self.wait,
            on_lost=self._wake,
            using=self.alias,
        )
        status: _WaitStatus | None = None
        if self.wait is not None and self.command.stderr.isatty():
            status = _WaitStatus(self.command, self.alias, self.key, self.wait)
            status.start()
        try:
            with holding as lease:
                if status is not None:
                    status.stop()
                returncode = self._supervise(lease)
        except NotAcquirableError:
            raise CommandError(f"{self._holder()}; {self._name} was not run", returncode=EXIT_BUSY) from None
        except LeaseTimeoutError:
            raise CommandError(
                f"timed out after waiting {self.wait:g}s: {self._holder()}; {self._name} was not run",
                returncode=EXIT_TIMED_OUT,
            ) from None
        finally:
            if status is not None:
                status.stop()
                status.join(timeout=1.0)

        # The hold has ended: released, or found lost (a release refused at exit counts as a loss).
        error = lease.error
        if error is not None:
            what = (
                f"{self._name} {_describe_exit(returncode)}"
                if not self._terminated_at_loss
                else self._kill_report(returncode)
            )
            raise CommandError(
                f"lease {self.key!r} (epoch {lease.epoch}) was lost while {self._name} ran ({error.code}): {what}",
                returncode=EXIT_LOST,
            )
        self._say(f"released {self.key!r} (epoch {lease.epoch}); {self._name} {_describe_exit(returncode)}", level=2)
        return returncode if returncode >= 0 else 128 - returncode

    def _holder(self) -> str:
        row = self.command._fetch_one(self.alias, self.key)
        connections[self.alias].close()  # no idle connection left behind by a status query
        if row is None or row.state != "held":
            return f"lease {self.key!r} was held by another owner"
        return f"lease {self.key!r} is held by {row.owner!r} (epoch {row.epoch}, expires {row.expiry})"

    def _supervise(self, lease: HeldLease) -> int:
        """Start COMMAND and wait for it, signalling it if the lease is lost; its Popen return code."""
        if lease.lost:
            raise CommandError(
                f"lease {self.key!r} (epoch {lease.epoch}) was lost before {self._name} started; it was not run",
                returncode=EXIT_LOST,
            )
        env = {
            **os.environ,
            "PG_LEASE_KEY": lease.key,
            "PG_LEASE_OWNER": lease.owner,
            "PG_LEASE_EPOCH": str(lease.epoch),
        }
        self._say(f"acquired {self.key!r} as {lease.owner!r} at epoch {lease.epoch}; running {self._name}", level=2)
        connections.close_all()  # the hold has a connection of its own: keep no idle one for COMMAND's lifetime
        self.command.stdout.flush()
        self.command.stderr.flush()
        self._started = True
        try:
            # A process group of its own unless we run in the foreground of a terminal: then a
            # signal (forwarded, or sent on loss) reaches the processes COMMAND started as well. In
            # the foreground COMMAND must share our group to read the terminal (as with `timeout
            # --foreground`); there only COMMAND itself is signalled.
            self._own_group = not _terminal_foreground()
            self.child = subprocess.Popen(self.argv, env=env, process_group=0 if self._own_group else None)
        except FileNotFoundError:
            raise CommandError(f"{self.argv[0]}: command not found", returncode=EXIT_COMMAND_NOT_FOUND) from None
        except OSError as exc:
            raise CommandError(
                f"{self.argv[0]}: cannot execute: {exc.strerror or exc}", returncode=EXIT_CANNOT_EXECUTE
            ) from None
        for signum in self._pending:
            self._forward(signum)
        return self._watch(lease, self.child)

    def _watch(self, lease: HeldLease, child: subprocess.Popen[bytes]) -> int:
        pidfd = -1
        with suppress(AttributeError, OSError):  # no pidfd (not Linux, or before 5.3): poll the child
            pidfd = os.pidfd_open(child.pid)
        terminated_at: float | None = None
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._wake_r, selectors.EVENT_READ)
                if pidfd >= 0:
                    selector.register(pidfd, selectors.EVENT_READ)
                while (returncode := child.poll()) is None:
                    now = time.monotonic()
                    if terminated_at is None and (error := lease.error) is not None:
                        terminated_at = now
                        self._terminated_at_loss = True
                        self._say(
                            f"lease {self.key!r} lost ({error.code}): "
                            f"sending SIGTERM to {self._name} (pid {child.pid}), SIGKILL in {self.grace:g}s"
                        )
                        self._signal(child, signal.SIGTERM)
                    if terminated_at is not None and not self._killed and now >= terminated_at + self.grace:
                        self._killed = True
                        self._say(f"{self._name} (pid {child.pid}) still running after {self.grace:g}s: SIGKILL")
                        self._signal(child, signal.SIGKILL)
                    if terminated_at is None:
                        timeout: float | None = max(lease.trust_remaining, 0.001)  # wake when trust ends
                    elif not self._killed:
                        timeout = max(terminated_at + self.grace - now, 0.0)
                    else:
                        timeout = None
                    if pidfd < 0:
                        timeout = 0.05 if timeout is None else min(timeout, 0.05)
                    for ready, _events in selector.select(timeout):
                        if ready.fd == self._wake_r:
                            with suppress(BlockingIOError):
                                os.read(self._wake_r, 64)
            if terminated_at is not None and self._own_group:
                # The lease is gone and COMMAND has ended: whatever it left behind in its group
                # must not go on working without the lease either.
                self._signal(child, signal.SIGKILL)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return returncode

    def _kill_report(self, returncode: int) -> str:
        sent = f"sent {self._name} SIGTERM" + (f", then SIGKILL after {self.grace:g}s" if self._killed else "")
        return f"{sent}; it {_describe_exit(returncode)}"
