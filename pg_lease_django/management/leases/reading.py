"""The reading subcommands of ``manage.py leases``: list, show, history, watch.

Keys, owners and the names in the history are other roles' data: the human-readable outputs show
them through `printable` (escaped, never obeyed by the terminal), ``--json`` as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TextIO, cast

from django.core.management.base import BaseCommand, CommandError

from pg_lease_django.display import LeaseRow, format_duration, json_text, printable
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.leases.common import (
    iso,
    not_found,
    pattern,
    positive_int,
    seconds,
    shown,
)
from pg_lease_django.management.leases.live_view import Watcher, watch
from pg_lease_django.models import Lease
from pg_lease_django.status import LeaseStatus
from pg_lease_django.timeline import History, read_history
from pg_lease_django.validation import check_name


class ReadingSubcommands(BaseCommand):
    """The reading subcommands of ``manage.py leases``: list, show, history, watch."""

    # -- list ----------------------------------------------------------------------------------------

    def _list(self, alias: str, options: dict[str, Any]) -> None:
        prefix = pattern("--prefix", options.get("prefix"))
        glob = pattern("--glob", options.get("glob"))
        owner = options.get("owner")
        if owner is not None:
            check_name("owner", owner)
        limit = positive_int("--limit", options.get("limit"))
        leases = Lease.objects.db_manager(alias).matching(
            prefix=prefix, glob=glob, owner=owner, states=options.get("state")
        )
        listing = leases.listing(limit)
        rows, total, server_time = listing.rows, listing.count, listing.server_time
        if options.get("json"):
            document = {"server_time": server_time, "count": total, "leases": [r.as_json() for r in rows]}
            self.stdout.write(json_text(document))
            return
        self._table(rows)
        summary = f"{total} lease{'' if total == 1 else 's'}"
        if len(rows) < total:
            summary = f"showing {len(rows)} of {summary}"
        self.stdout.write(f"{summary} (server time {shown(server_time)})")

    def _table(self, rows: Sequence[LeaseRow]) -> None:
        if not rows:
            return
        header = ("KEY", "STATE", "OWNER", "EPOCH", "EXPIRES", "ACQUIRED AT")
        # Escaped before the widths are measured: a row is one line, its columns aligned as shown.
        cells = [
            (
                printable(row.key),
                row.state,
                "-" if row.owner is None else printable(row.owner),
                str(row.epoch),
                row.expiry,
                shown(row.acquired_at),
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
            raise CommandError(not_found(key), returncode=ExitCode.NOT_FOUND)
        if options.get("json"):
            self.stdout.write(json_text({**row.as_json(), "server_time": row.server_time}))
            return
        expires = "-" if row.expires_at is None else f"{shown(row.expires_at)} ({row.expiry})"
        facts = [
            ("key", printable(row.key)),
            ("state", self._state_style(row.state, row.state)),
            ("owner", "-" if row.owner is None else printable(row.owner)),
            ("epoch", str(row.epoch)),
            ("acquired at", shown(row.acquired_at)),
            ("expires at", expires),
            ("server time", shown(row.server_time)),
        ]
        self.stdout.write("\n".join(f"{name + ':':<13}{value}" for name, value in facts))

    # -- history, handoff, prune-history ------------------------------------------------------------

    def _history(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        limit = positive_int("--limit", options.get("limit"))
        history = read_history(key, using=alias, limit=limit)
        if history.count == 0 and Lease.objects.db_manager(alias).row(key) is None:
            raise CommandError(not_found(key), returncode=ExitCode.NOT_FOUND)
        if options.get("json"):
            self.stdout.write(json_text(history.as_json()))
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
        self.stdout.write(f"{summary} of {key!r} (server time {shown(iso(history.server_time))})")

    def _history_table(self, history: History) -> None:
        header = ("EPOCH", "OWNER", "GRANTED AT", "ENDED AT", "HOW IT ENDED", "ENDED BY", "DB ROLE", "DURATION")
        now = history.server_time
        cells = [
            (
                str(row.epoch),
                printable(row.owner),
                shown(iso(row.granted_at)),
                shown(iso(row.ended_at)),
                printable(row.describe(now)),  # an unknown end_reason is shown as written
                printable(row.ended_by) if row.ended_by else "-",
                printable(row.ended_by_role) if row.ended_by_role else "-",
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

    # -- watch ---------------------------------------------------------------------------------------

    def _watch(self, alias: str, options: dict[str, Any]) -> None:
        prefix = pattern("--prefix", options.get("prefix"))
        glob = pattern("--glob", options.get("glob"))
        limit = positive_int("--limit", options.get("limit") or "50")
        text = options.get("transitions")
        transitions = 10 if text is None else 0 if text == "0" else positive_int("--transitions", text, 1000)
        interval = 1.0
        if options.get("interval") is not None:
            interval = seconds("--interval", options["interval"], timedelta(milliseconds=100), timedelta(hours=1))
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
