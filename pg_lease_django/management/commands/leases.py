"""``manage.py leases``: see who holds what, and break a stuck lease safely.

Subcommands: ``list`` (the default), ``show KEY``, ``watch`` (a live view, `pg_lease_django.watch`),
``release KEY --force [--operator NAME]``,
``handoff KEY`` (ask the holder to step down at its next renewal), ``history KEY`` (the recorded
tenures of a key, `pg_lease_django.timeline`), ``prune-history [--older-than 30d]``,
``prune --free-for 30d`` (delete rows of leases free that long; epochs never go back),
``advance-epochs --by N`` (after a failover to a standby that may have missed lease writes: raise
every epoch and the epoch floor by N, fencing current holders), and
``run KEY --ttl SECONDS -- COMMAND``, which runs a command while holding a lease (``flock(1)`` for a
whole cluster; see `pg_lease_django.supervisor`). Every state shown is computed in SQL from the
database server's clock with ``pg_lease_status`` (the rule the lease functions use), in one
statement, whatever the number of leases (`LeaseQuerySet.listing`).

This module parses the arguments, dispatches and prints: reading is `LeaseQuerySet`'s, watching
``run``'s COMMAND is `Supervisor`'s. The exit-code tables below (also in docs/operations.md) are
generated from `ExitCode`, like the help texts.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import re
import socket
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO, cast

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections, router

from pg_lease_django import conf, privileges
from pg_lease_django import sql as lease_sql
from pg_lease_django.display import LeaseRow, format_duration
from pg_lease_django.exceptions import (
    AlreadyFreeError,
    EpochMismatchError,
    InvalidInputError,
    LapsedError,
    NeverAcquiredError,
)
from pg_lease_django.models import Lease, LeaseTenure
from pg_lease_django.status import LeaseStatus
from pg_lease_django.supervisor import DEFAULT_GRACE, ExitCode, RunError, Supervisor
from pg_lease_django.timeline import History, read_history
from pg_lease_django.validation import MAX_ADVANCE, MAX_EPOCH, MAX_TTL, MAX_WAIT, MIN_TTL, check_name
from pg_lease_django.watch import Watcher, watch

__doc__ = f"""{__doc__ or ""}
Exit codes:

{ExitCode.table(run=False)}

``run`` exits with its COMMAND's status (128 + N when a signal N killed it, as a shell reports
it), or with one of these, kept clear of 0-6 above and of the shell's 126, 127 and 128 + N:

{ExitCode.table(run=True)}
"""

_RUN_USAGE = "leases run KEY --ttl SECONDS -- COMMAND [ARGS ...]"


def _shown(iso: str | None) -> str:
    """A time for people: UTC, to the second (``2026-05-01 12:00:03Z``)."""
    return "-" if iso is None else f"{iso[:10]} {iso[11:19]}Z"


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
    """``manage.py leases [list|show|watch|history|handoff|release|prune|prune-history|advance-epochs|run] ...``:
    the operators' view of the lease table."""

    help = (
        "Inspect leases, break stuck ones, run a command under a lease. Subcommands: list (default), "
        "show KEY, watch [--prefix P | --glob G], history KEY, handoff KEY, release KEY --force, "
        "prune --free-for AGE, prune-history, "
        "advance-epochs --by N, run KEY --ttl SECONDS -- COMMAND. "
        f"Exit codes: {ExitCode.summary(run=False)}; run: COMMAND's status, {ExitCode.summary(run=True)}."
    )
    # An operator's tool, also for incidents: no other app's system-check error may stop it, and its
    # own preconditions (a PostgreSQL database, a migrated one) are each reported in one line.
    requires_system_checks: list[str] = []

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
            metavar="{list,show,watch,history,handoff,release,prune,prune-history,advance-epochs,grant,run}",
            parser_class=SubcommandParser,
        )

        list_parser = subparsers.add_parser("list", help="Table of leases, sorted by key (the default).")
        list_parser.add_argument(
            "--state", action="append", choices=LeaseStatus.values, help="Only leases in this state (repeatable)."
        )
        list_parser.add_argument("--prefix", help="Only keys starting with this text (uses the primary-key index).")
        list_parser.add_argument("--glob", help="Only keys matching this glob: * any text, ? one character.")
        list_parser.add_argument("--owner", help="Only leases held (or last held, if lapsed) by this owner.")
        list_parser.add_argument("--limit", help="Show at most this many leases (the count still covers all).")
        list_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        show_parser = subparsers.add_parser(
            "show", aliases=["inspect"], help="One lease in detail (alias: inspect, as Lease.objects.inspect())."
        )
        show_parser.add_argument("key", help="The lease key.")
        show_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        release_parser = subparsers.add_parser(
            "release", help="Force-release a lease: the epoch goes up and its holder is fenced."
        )
        release_parser.add_argument("key", help="The lease key.")
        release_parser.add_argument("--force", action="store_true", help="Required: this overrides the holder.")
        release_parser.add_argument("--epoch", help="Release only if this is still the current epoch.")
        release_parser.add_argument(
            "--operator", help="Who is releasing, recorded in the lease's history (default: your user@host)."
        )
        release_parser.add_argument("--dry-run", action="store_true", help="Say what would happen; change nothing.")
        release_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        history_parser = subparsers.add_parser(
            "history", help="The recorded tenures of a lease (keys named by PG_LEASE_HISTORY), oldest first."
        )
        history_parser.add_argument("key", help="The lease key.")
        history_parser.add_argument("--limit", help="Show only the newest this many tenures (the count covers all).")
        history_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        handoff_parser = subparsers.add_parser(
            "handoff", help="Ask the holder to step down at its next renewal (advice: the lease stays granted)."
        )
        handoff_parser.add_argument("key", help="The lease key.")
        handoff_parser.add_argument("--epoch", help="Ask only if this is still the current epoch.")
        handoff_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        prune_history_parser = subparsers.add_parser(
            "prune-history", help="Delete the recorded tenures that ended longer ago than --older-than."
        )
        prune_history_parser.add_argument(
            "--older-than",
            help="30d, 12h, 90m, 45s or seconds (default: PG_LEASE_HISTORY_RETENTION, 30 days).",
        )
        prune_history_parser.add_argument("--dry-run", action="store_true", help="Count what would go; change nothing.")
        prune_history_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        prune_parser = subparsers.add_parser(
            "prune",
            help="Delete the rows of leases free for at least --free-for; a key that comes back starts above its past.",
        )
        prune_parser.add_argument(
            "--free-for", required=True, help="How long a lease must have been free: 30d, 12h, 90m, 45s or seconds."
        )
        prune_parser.add_argument("--dry-run", action="store_true", help="List what would go; change nothing.")
        prune_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        advance_parser = subparsers.add_parser(
            "advance-epochs",
            help="After a failover that may have lost lease writes: raise every epoch and the epoch floor by --by "
            "(holders are fenced and must re-acquire).",
        )
        advance_parser.add_argument(
            "--by",
            required=True,
            help="How much to raise every epoch: more than the grants per key the lost primary could have made "
            "since the last replicated point (e.g. 1000000).",
        )
        advance_parser.add_argument("--dry-run", action="store_true", help="Say what would change; change nothing.")
        advance_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

        watch_parser = subparsers.add_parser(
            "watch", help="A live view of the leases matching --prefix or --glob, refreshed in place (Ctrl-C stops)."
        )
        watch_parser.add_argument("--prefix", help="Only keys starting with this text.")
        watch_parser.add_argument("--glob", help="Only keys matching this glob: * any text, ? one character.")
        watch_parser.add_argument("--limit", help="Show at most this many leases (default 50; the count covers all).")
        watch_parser.add_argument("--interval", help="Seconds between refreshes (default 1).")
        watch_parser.add_argument("--transitions", help="How many recent transitions to show (default 10; 0: none).")
        watch_parser.add_argument("--once", action="store_true", help="Show one frame and exit.")
        watch_parser.add_argument("--json", action="store_true", help="JSON for scripts: one document per frame.")
        watch_parser.add_argument("--plain", action="store_true", help="Plain text even when rich is installed.")

        grant_parser = subparsers.add_parser(
            "grant",
            help="Grant the roles of PG_LEASE_WORKER_ROLES and PG_LEASE_OPERATOR_ROLES their lease privileges "
            "(migrate does it too); run as the lease functions' owner.",
        )
        grant_parser.add_argument(
            "--check", action="store_true", help="Only say what is missing; exit 1 if anything is. Change nothing."
        )

        run_parser = subparsers.add_parser(
            "run",
            help="Run COMMAND while holding the lease KEY (renewed by heartbeats, released at the end).",
            usage=(
                "%(prog)s KEY --ttl SECONDS [--wait SECONDS | --campaign] [--owner ID] [--grace SECONDS] "
                "[--database ALIAS] -- COMMAND [ARGS ...]"
            ),
            description=(
                "Acquire KEY, run COMMAND with PG_LEASE_KEY, PG_LEASE_OWNER and PG_LEASE_EPOCH in its environment, "
                "renew the lease while it runs, release it when it ends. If the lease is lost, COMMAND gets SIGTERM, "
                "then SIGKILL after --grace seconds. SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to "
                f"COMMAND. Exit status: COMMAND's (128+N if signal N killed it); {ExitCode.summary(run=True)}."
            ),
        )
        assert isinstance(run_parser, SubcommandParser)
        run_parser.command_after_dashes = True
        run_parser.add_argument("key", help="The lease key.")
        run_parser.add_argument(
            "--ttl", help="Required. How long each grant and renewal lasts (30, 30s, 5m, 2h); renewed every TTL/3."
        )
        run_parser.add_argument(
            "--wait", help="Wait up to this long for the lease (30, 30s, 5m; default: don't wait; busy exits 75)."
        )
        run_parser.add_argument("--owner", help="Owner identity (default: host:pid:random, new for every run).")
        run_parser.add_argument(
            "--campaign",
            action="store_true",
            help="Keep COMMAND running on exactly one machine of many: campaign for KEY, run COMMAND while leading, "
            "campaign again when it exits or the lease is lost or handed off; until SIGTERM/SIGINT/SIGHUP.",
        )
        run_parser.add_argument(
            "--grace",
            help=f"Time between SIGTERM and SIGKILL when the lease is lost (10, 10s, 1m; default: {DEFAULT_GRACE:g}).",
        )

        # run: Django's -v/--verbosity after the subcommand too (2 reports the grant and the release on stderr).
        run_parser.add_argument(
            "-v", "--verbosity", type=int, choices=[0, 1, 2, 3], default=argparse.SUPPRESS, help="Verbosity level."
        )

        for sub in (
            list_parser,
            show_parser,
            history_parser,
            handoff_parser,
            release_parser,
            prune_parser,
            prune_history_parser,
            advance_parser,
            watch_parser,
            grant_parser,
            run_parser,
        ):
            # SUPPRESS: a subcommand that is not given these must not overwrite the top-level value.
            sub.add_argument("--database", default=argparse.SUPPRESS, help="Database alias holding the leases.")
            sub.add_argument("--no-color", action="store_true", default=argparse.SUPPRESS, help="Don't colorize.")
            sub.add_argument("--force-color", action="store_true", default=argparse.SUPPRESS, help="Force colors.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the subcommand; every failure becomes a one-line `CommandError` with its exit code."""
        alias = self._database(options["database"] or router.db_for_write(Lease))
        subcommand = options.get("subcommand") or "list"
        try:
            if subcommand in ("show", "inspect"):
                self._show(alias, options)
            elif subcommand == "history":
                self._history(alias, options)
            elif subcommand == "handoff":
                self._handoff(alias, options)
            elif subcommand == "release":
                self._release(alias, options)
            elif subcommand == "prune":
                self._prune(alias, options)
            elif subcommand == "prune-history":
                self._prune_history(alias, options)
            elif subcommand == "advance-epochs":
                self._advance_epochs(alias, options)
            elif subcommand == "grant":
                self._grant(alias, options)
            elif subcommand == "watch":
                self._watch(alias, options)
            elif subcommand == "run":
                self._run(alias, options)
            else:
                self._list(alias, options)
        except InvalidInputError as exc:
            raise CommandError(str(exc), returncode=ExitCode.USAGE) from None
        except ImproperlyConfigured as exc:  # e.g. no lease table: the message names the migrate command
            raise CommandError(f"database error: {exc}", returncode=ExitCode.DATABASE_ERROR) from None
        except DatabaseError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if getattr(exc.__cause__, "sqlstate", None) == "42P01":  # undefined_table: not migrated (that far)
                first_line += f"; run `manage.py migrate pg_lease_django --database {alias}`"
            raise CommandError(f"database error: {first_line}", returncode=ExitCode.DATABASE_ERROR) from None

    # -- arguments -------------------------------------------------------------------------------

    @staticmethod
    def _database(alias: str) -> str:
        if alias not in connections:
            raise CommandError(f"unknown database alias {alias!r}", returncode=ExitCode.USAGE)
        vendor = connections[alias].vendor
        if vendor != "postgresql":
            raise CommandError(f"database {alias!r} is {vendor}, not PostgreSQL", returncode=ExitCode.USAGE)
        return alias

    @staticmethod
    def _positive_int(name: str, text: str | None, maximum: int = MAX_EPOCH) -> int | None:
        if text is None:
            return None
        try:
            value = int(text, 10)
        except ValueError:
            raise CommandError(f"{name} must be a whole number, got {text!r}", returncode=ExitCode.USAGE) from None
        if not 1 <= value <= maximum:
            raise CommandError(f"{name} must be between 1 and {maximum}, got {value}", returncode=ExitCode.USAGE)
        return value

    @staticmethod
    def _pattern(name: str, text: str | None) -> str | None:
        if text is None:
            return None
        if not text or "\x00" in text:
            raise CommandError(f"{name} must be non-empty text without NUL characters", returncode=ExitCode.USAGE)
        return text

    # -- list ----------------------------------------------------------------------------------------

    def _list(self, alias: str, options: dict[str, Any]) -> None:
        prefix = self._pattern("--prefix", options.get("prefix"))
        glob = self._pattern("--glob", options.get("glob"))
        owner = options.get("owner")
        if owner is not None:
            check_name("owner", owner)
        limit = self._positive_int("--limit", options.get("limit"))
        leases = Lease.objects.db_manager(alias).matching(
            prefix=prefix, glob=glob, owner=owner, states=options.get("state")
        )
        listing = leases.listing(limit)
        rows, total, server_time = listing.rows, listing.count, listing.server_time
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
        if state == LeaseStatus.HELD:
            return self.style.SUCCESS(text)
        if state == LeaseStatus.LAPSED:
            return self.style.WARNING(text)
        return text

    # -- show ----------------------------------------------------------------------------------------

    def _show(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        row = Lease.objects.db_manager(alias).row(key)
        if row is None:
            raise CommandError(_not_found(key), returncode=ExitCode.NOT_FOUND)
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
        operator = options.get("operator")
        operator = check_name("operator", _os_operator() if operator is None else operator)
        manager = Lease.objects.db_manager(alias)
        row = manager.row(key)  # who holds it: for the report, --dry-run and the refusal without --force
        if row is None:  # nothing seen, nothing released: a key acquired since is not ours to break
            raise CommandError(_not_found(key), returncode=ExitCode.NOT_FOUND)
        if options.get("dry_run") or not options.get("force"):
            self._release_not_forced(options, row, expected)
            return
        try:
            # The epoch we looked at, not "whatever is there now": we report who we released.
            new_epoch = manager.force_release(key, epoch=row.epoch if expected is None else expected, operator=operator)
        except NeverAcquiredError:  # pruned since we looked
            raise CommandError(_not_found(key), returncode=ExitCode.NOT_FOUND) from None
        except AlreadyFreeError as exc:
            raise CommandError(str(exc), returncode=ExitCode.ALREADY_FREE) from None
        except EpochMismatchError as exc:
            raise CommandError(f"{exc}; nothing released", returncode=ExitCode.MOVED_ON) from None
        self._report(options, row, new_epoch, dry_run=False)

    def _release_not_forced(self, options: dict[str, Any], row: LeaseRow, expected: int | None) -> None:
        """--dry-run, or the refusal without --force: what a release would do, judged from ``row``."""
        if row.state == LeaseStatus.FREE:
            raise CommandError(
                f"lease {row.key!r} is already free (epoch {row.epoch}): nothing to release",
                returncode=ExitCode.ALREADY_FREE,
            )
        holder = f"{row.state} by {row.owner!r}, expires {row.expiry}"
        if expected is not None and expected != row.epoch:
            raise CommandError(
                f"lease {row.key!r} has moved on: its epoch is {row.epoch} ({holder}), not {expected}; "
                "nothing released",
                returncode=ExitCode.MOVED_ON,
            )
        if options.get("dry_run"):
            self._report(options, row, row.epoch + 1, dry_run=True)
            return
        raise CommandError(
            f"refusing to release {row.key!r} (epoch {row.epoch}, {holder}) without --force",
            returncode=ExitCode.NOT_FORCED,
        )

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

    # -- history, handoff, prune-history ------------------------------------------------------------

    def _history(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        limit = self._positive_int("--limit", options.get("limit"))
        history = read_history(key, using=alias, limit=limit)
        if history.count == 0 and Lease.objects.db_manager(alias).row(key) is None:
            raise CommandError(_not_found(key), returncode=ExitCode.NOT_FOUND)
        if options.get("json"):
            self.stdout.write(json.dumps(history.as_json(), indent=2, ensure_ascii=False))
            return
        if history.count == 0:
            self.stdout.write(
                f"No recorded tenures of {key!r}: its history is recorded only if PG_LEASE_HISTORY names it "
                "(and from then on)."
            )
            return
        self._history_table(history)
        summary = f"{history.count} tenure{'' if history.count == 1 else 's'}"
        if len(history.tenures) < history.count:
            summary = f"showing the last {len(history.tenures)} of {summary}"
        self.stdout.write(f"{summary} of {key!r} (server time {_shown(_iso(history.server_time))})")

    def _history_table(self, history: History) -> None:
        header = ("EPOCH", "OWNER", "GRANTED AT", "ENDED AT", "HOW IT ENDED", "ENDED BY", "DB ROLE", "DURATION")
        now = history.server_time
        cells = [
            (
                str(row.epoch),
                row.owner,
                _shown(_iso(row.granted_at)),
                _shown(_iso(row.ended_at)),
                row.describe(now),
                row.ended_by or "-",
                row.ended_by_role or "-",
                format_duration(row.duration(now)),
            )
            for row in history.tenures
        ]
        widths = [max(len(header[i]), *(len(c[i]) for c in cells)) for i in range(len(header))]
        right = {0, 7}  # epochs and durations are right-aligned

        def line(values: Sequence[str]) -> list[str]:
            return [
                v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
            ]

        out = [self.style.MIGRATE_HEADING("  ".join(line(header)).rstrip())]
        for row, values in zip(history.tenures, cells, strict=True):
            padded = line(values)
            if row.forced:
                padded[4] = self.style.ERROR(padded[4])
            elif row.current:
                padded[4] = self._state_style(row.outcome, padded[4])
            out.append("  ".join(padded).rstrip())
        self.stdout.write("\n".join(out))

    def _handoff(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        epoch = self._positive_int("--epoch", options.get("epoch"))
        try:
            done = Lease.objects.db_manager(alias).request_handoff(key, epoch=epoch)
        except NeverAcquiredError:
            raise CommandError(_not_found(key), returncode=ExitCode.NOT_FOUND) from None
        except (AlreadyFreeError, LapsedError) as exc:  # nobody holds it: nobody to ask
            raise CommandError(f"{exc}; nobody to hand off from", returncode=ExitCode.ALREADY_FREE) from None
        except EpochMismatchError as exc:
            raise CommandError(f"{exc}; nothing requested", returncode=ExitCode.MOVED_ON) from None
        if options.get("json"):
            document = {
                "key": done.key,
                "owner": done.owner,
                "epoch": done.epoch,
                "expires_at": _iso(done.expires_at),
                "requested_at": _iso(done.requested_at),
                "server_time": _iso(done.server_time),
            }
            self.stdout.write(json.dumps(document, indent=2, ensure_ascii=False))
            return
        expires_in = format_duration(max(done.expires_at - done.server_time, timedelta(0)))
        self.stdout.write(
            self.style.SUCCESS(f"Hand-off requested from {done.owner!r} (epoch {done.epoch}) on {done.key!r}")
            + f": it learns at its next renewal and may step down; the lease stays held until then "
            f"(expires in {expires_in} unless renewed)."
        )

    def _prune_history(self, alias: str, options: dict[str, Any]) -> None:
        text = options.get("older_than")
        older_than = None if text is None else _duration("--older-than", text)
        dry_run = bool(options.get("dry_run"))
        count = LeaseTenure.objects.db_manager(alias).prune(older_than=older_than, dry_run=dry_run)
        if older_than is None:
            older_than = conf.history_retention().total_seconds()
        if options.get("json"):
            document = {"dry_run": dry_run, "older_than_seconds": older_than, "tenures": count}
            self.stdout.write(json.dumps(document, indent=2))
            return
        age = text or format_duration(timedelta(seconds=older_than))
        if dry_run:
            self.stdout.write(f"Dry run: would delete {count} tenure(s) that ended more than {age} ago.")
        else:
            self.stdout.write(self.style.SUCCESS(f"Deleted {count} tenure(s) that ended more than {age} ago."))

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

    # -- watch ---------------------------------------------------------------------------------------

    def _watch(self, alias: str, options: dict[str, Any]) -> None:
        prefix = self._pattern("--prefix", options.get("prefix"))
        glob = self._pattern("--glob", options.get("glob"))
        limit = self._positive_int("--limit", options.get("limit") or "50")
        text = options.get("transitions")
        transitions = 10 if text is None else 0 if text == "0" else self._positive_int("--transitions", text, 1000)
        interval = 1.0
        if options.get("interval") is not None:
            interval = _seconds("--interval", options["interval"], timedelta(milliseconds=100), timedelta(hours=1))
        what = " and ".join(f"{name} {value!r}" for name, value in (("prefix", prefix), ("glob", glob)) if value)
        watcher = Watcher(alias, prefix=prefix, glob=glob, limit=limit or 50, transitions=transitions or 0)
        watch(
            watcher,
            cast(TextIO, getattr(self.stdout, "_out", self.stdout)),  # the stream: rich writes escapes, not lines
            what=what or "any key",
            interval=interval,
            once=bool(options.get("once")),
            as_json=bool(options.get("json")),
            plain=bool(options.get("plain")),
        )

    # -- grant -----------------------------------------------------------------------------------------

    def _grant(self, alias: str, options: dict[str, Any]) -> None:
        declared = privileges.declared()
        quote = connections[alias].ops.quote_name
        if options.get("check"):
            absent, lacking = privileges.missing(alias)
            extra = privileges.undeclared(alias)
            scopes_differ = privileges.stored_key_scopes(alias) not in (None, conf.key_scopes())
            for role in absent:
                self.stdout.write(f"role {role} does not exist")
            for needed in lacking:
                self.stdout.write(needed.statement(quote))
            for held in extra:
                self.stdout.write(
                    f"REVOKE {held.privilege} ON {held.kind} {held.object} FROM {quote(held.role)}  -- not declared"
                )
            if scopes_differ:
                self.stdout.write("the database's key scopes differ from PG_LEASE_KEY_SCOPES")
            if absent or lacking or extra or scopes_differ:
                raise CommandError(  # exit 1, as for any database state that stops the leases working
                    f"{len(absent)} declared role(s) missing, {len(lacking)} grant(s) missing, "
                    f"{len(extra)} undeclared grant(s){', key scopes differ' if scopes_differ else ''}: "
                    f"run `manage.py leases grant --database {alias}` as the lease functions' owner",
                    returncode=ExitCode.DATABASE_ERROR,
                )
            self.stdout.write(f"Every declared role holds its lease privileges in {alias!r}.")
            return
        granted = privileges.grant(alias)
        for needed in granted:
            self.stdout.write(needed.statement(quote))
        roles = ", ".join(f"{role} ({kind})" for role, kind in sorted(declared.items())) or (
            "none (PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES): only the lease functions' owner may use them"
        )
        self.stdout.write(self.style.SUCCESS(f"Granted {len(granted)} privilege(s); declared roles: {roles}."))

    # -- advance-epochs ------------------------------------------------------------------------------

    def _advance_epochs(self, alias: str, options: dict[str, Any]) -> None:
        by = self._positive_int("--by", options["by"], maximum=MAX_ADVANCE)
        assert by is not None
        dry_run = bool(options.get("dry_run"))
        done = Lease.objects.db_manager(alias).advance_epochs(by=by, dry_run=dry_run)
        if options.get("json"):
            document = {
                "dry_run": done.dry_run,
                "by": done.by,
                "leases": done.leases,
                "held": done.held,
                "epoch_floor": done.epoch_floor,
                "max_epoch": done.max_epoch,
                "server_time": done.server_time.isoformat(),
            }
            self.stdout.write(json.dumps(document, indent=2))
            return
        what = (
            f"{done.leases} lease(s) by {done.by} ({done.held} held: their holders are fenced and must re-acquire); "
            f"epoch floor {done.epoch_floor}, highest epoch {done.max_epoch}."
        )
        if dry_run:
            self.stdout.write(f"Dry run: would advance the epochs of {what}")
        else:
            self.stdout.write(self.style.SUCCESS(f"Advanced the epochs of {what}"))

    # -- run -----------------------------------------------------------------------------------------

    def _run(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        if options.get("ttl") is None:
            raise CommandError("--ttl is required: how many seconds each grant lasts", returncode=ExitCode.USAGE)
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
                f"unexpected argument {unexpected[0]!r}: COMMAND goes after --, as in {_RUN_USAGE}",
                returncode=ExitCode.USAGE,
            )
        if not command or not command[0]:
            raise CommandError(f"missing COMMAND: {_RUN_USAGE}", returncode=ExitCode.USAGE)
        if threading.current_thread() is not threading.main_thread():
            raise CommandError(
                "leases run must be called from the main thread (it handles signals)", returncode=ExitCode.USAGE
            )
        # An unmigrated database in one line, before anything starts: a campaign would otherwise
        # retry its failing attempts until stopped (a configuration error is not a transient one).
        lease_sql.schema(connections[alias])
        supervisor = Supervisor(
            key,
            command,
            ttl=ttl,
            wait=wait or None,
            grace=grace,
            owner=owner,
            using=alias,
            verbosity=options.get("verbosity", 1),
            stdout=self.stdout,
            stderr=self.stderr,
            campaign=bool(options.get("campaign")),
        )
        try:
            status = supervisor.run()
        except RunError as exc:
            raise CommandError(str(exc), returncode=exc.exit_code) from None
        if status:
            # Like Django's own `test` and `makemigrations --check`: the status is the whole message.
            raise SystemExit(status)


def _not_found(key: str) -> str:
    """The message for a key with no row: never acquired, or pruned (``leases prune`` deletes rows)."""
    return f"no lease with key {key!r} (never acquired, or pruned)"


def _iso(moment: datetime | None) -> str | None:
    """A server time as the stable JSON text: ISO 8601 in UTC, with microseconds (as `LeaseRow`'s)."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def _os_operator() -> str:
    """Who runs the command, for the history of a forced release: ``user@host``."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
        user = f"uid-{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def _seconds(name: str, text: str, minimum: timedelta, maximum: timedelta) -> float:
    """Parse a command-line duration within ``[minimum, maximum]``: seconds (``30``, ``0.5``), or with a
    unit as ``--free-for`` takes them (``30s``, ``1.5m``, ``2h``, ``1d``)."""
    match = _DURATION.fullmatch(text.strip())
    try:
        value = float(match["number"]) * _UNIT_SECONDS[match["unit"]] if match is not None else float(text)
    except ValueError:
        raise CommandError(
            f"{name} must be a number of seconds or a duration such as 30s, 5m or 2h, got {text!r}",
            returncode=ExitCode.USAGE,
        ) from None
    low, high = minimum.total_seconds(), maximum.total_seconds()
    if not math.isfinite(value) or not low <= value <= high:
        raise CommandError(
            f"{name} must be between {low:.15g} and {high:.15g} seconds, got {text!r}", returncode=ExitCode.USAGE
        )
    return value


_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(name: str, text: str) -> float:
    """Parse ``30d``, ``12h``, ``90m``, ``45s`` or plain seconds, up to ten years, into seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise CommandError(
            f"{name} must be a duration such as 30d, 12h, 90m or 45s, got {text!r}", returncode=ExitCode.USAGE
        )
    seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    if seconds > 3650 * 86400:
        raise CommandError(f"{name} must be at most 3650d, got {text!r}", returncode=ExitCode.USAGE)
    return seconds
