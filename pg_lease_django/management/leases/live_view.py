"""``manage.py leases watch``: a live view of the leases matching a prefix or a glob, refreshing in place.

Each refresh is two statements. The first reads the leases with `LeaseQuerySet.listing`: state,
owner, epoch and time left on the server clock. The second reads the recent transitions of the same
keys from the history in `LeaseTenure`, when ``PG_LEASE_HISTORY`` records them. The database keeps
no renewal time, so "since renewal" is what the watch saw: the server time of the first refresh at
which a grant's expiry moved or at which the grant first appeared, accurate to the refresh interval,
and ``-`` until it has seen one. With rich installed from the ``watch`` extra and a terminal, the
view is drawn by ``rich.live``. Otherwise it is a plain table, redrawn with two ANSI escapes on a
terminal, or appended frame after frame when piped. Ctrl-C ends it with status 0. Keys and owners
are shown through `printable` in both views, and rich gets them as `rich.text.Text`, never as
markup; ``--json`` gives them as they are.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TextIO

from django.db import connections

from pg_lease_django.display import LeaseRow, format_duration, printable
from pg_lease_django.querysets import glob_to_like
from pg_lease_django.sql import run, statements
from pg_lease_django.sql.rows import Transition
from pg_lease_django.status import LeaseStatus

__all__ = ["Frame", "Transition", "Watcher", "draw_plain", "watch"]

# Clear the screen and home the cursor: what the plain view redraws with on a terminal.
_REDRAW = "\x1b[H\x1b[2J"


@dataclass
class Frame:
    """One refresh: the leases (with what the watch saw of their renewals) and the recent transitions."""

    server_time: str
    count: int
    leases: list[LeaseRow]
    renewed_ago: dict[str, float | None] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The stable JSON form: the listing's fields plus ``renewed_seconds_ago``, and the transitions."""
        return {
            "server_time": self.server_time,
            "count": self.count,
            "leases": [{**row.as_json(), "renewed_seconds_ago": self.renewed_ago.get(row.key)} for row in self.leases],
            "transitions": [transition.as_json() for transition in self.transitions],
        }


class Watcher:
    """Reads frames of the leases matching ``prefix`` / ``glob`` on database ``using``."""

    def __init__(
        self, using: str, *, prefix: str | None = None, glob: str | None = None, limit: int = 50, transitions: int = 10
    ) -> None:
        self.using = using
        self.prefix = prefix
        self.glob = glob
        self.limit = limit
        self.transitions = transitions
        self._first = True
        # (key, owner, epoch) -> (expires_at seen last, server time of the last grant or renewal seen).
        self._seen: dict[tuple[str, str | None, int], tuple[str | None, datetime | None]] = {}

    def read(self) -> Frame:
        """One refresh (two statements)."""
        from pg_lease_django.models import Lease

        listing = Lease.objects.db_manager(self.using).matching(prefix=self.prefix, glob=self.glob).listing(self.limit)
        now = datetime.fromisoformat(listing.server_time)
        frame = Frame(listing.server_time, listing.count, listing.rows)
        seen: dict[tuple[str, str | None, int], tuple[str | None, datetime | None]] = {}
        for row in listing.rows:
            if row.state == LeaseStatus.FREE:
                continue
            ident = (row.key, row.owner, row.epoch)
            before = self._seen.get(ident)
            if before is None:
                # New to the watch: a grant made since the last refresh counts as its last confirmation.
                renewed_at = None if self._first or row.acquired_at is None else datetime.fromisoformat(row.acquired_at)
            elif before[0] != row.expires_at:
                renewed_at = now  # the expiry moved since the last refresh: renewed in between
            else:
                renewed_at = before[1]
            seen[ident] = (row.expires_at, renewed_at)
            frame.renewed_ago[row.key] = None if renewed_at is None else max(0.0, (now - renewed_at).total_seconds())
        self._seen = seen
        self._first = False
        if self.transitions:
            frame.transitions = self._read_transitions()
        return frame

    def _read_transitions(self) -> list[Transition]:
        connection = connections[self.using]
        like = None if self.glob is None else glob_to_like(self.glob)[0]
        # The recent grants and ends of the watched keys, newest first. Not an index scan: the history's
        # index is (key, epoch); a watch reads it once per refresh, an operator's tool.
        return run.rows(connection, statements.TRANSITIONS, prefix=self.prefix, like=like, limit=self.transitions)


def _since(seconds: float | None) -> str:
    return "-" if seconds is None else f"{format_duration(timedelta(seconds=seconds))} ago"


def _cells(frame: Frame) -> list[tuple[str, ...]]:
    # Escaped before any width is measured: a row is one line, its columns aligned as shown.
    return [
        (
            printable(row.key),
            str(row.state),
            "-" if row.owner is None else printable(row.owner),
            str(row.epoch),
            row.expiry,
            _since(frame.renewed_ago.get(row.key)) if row.state != LeaseStatus.FREE else "-",
        )
        for row in frame.leases
    ]


_HEADER = ("KEY", "STATE", "OWNER", "EPOCH", "EXPIRES", "RENEWED")


def _summary(frame: Frame, what: str) -> str:
    shown = f"{len(frame.leases)} of {frame.count}" if len(frame.leases) < frame.count else str(frame.count)
    return f"{shown} lease{'' if frame.count == 1 else 's'} matching {what} (server time {frame.server_time[:19]}Z)"


def _transition_cells(t: Transition) -> tuple[str, ...]:
    return (f"{t.at[:19]}Z", printable(t.key), f"#{t.epoch}", printable(t.owner), printable(t.event.replace("_", " ")))


def draw_plain(frame: Frame, what: str, *, live: bool = False) -> str:
    """The frame as plain text: a lease table, then the recent transitions (``live``: and how to stop)."""
    cells = _cells(frame)
    lines = [_summary(frame, what)]
    if cells:
        widths = [max(len(_HEADER[i]), *(len(c[i]) for c in cells)) for i in range(len(_HEADER))]
        for values in (_HEADER, *cells):
            lines.append("  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip())
    if frame.transitions:
        lines.append("")
        lines.append("Recent transitions (newest first):")
        lines.extend(f"  {'  '.join(_transition_cells(t))}" for t in frame.transitions)
    if live:
        lines.extend(("", "Ctrl-C to stop."))
    return "\n".join(lines)


def _draw_rich(frame: Frame, what: str) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    # Every cell a Text: rich reads a plain str as markup ("[bold]" in a key would style the row, and
    # "[/]" raise), and the escaped text is what is measured and drawn.
    styles = {LeaseStatus.HELD: "green", LeaseStatus.LAPSED: "yellow"}
    table = Table(title=Text(_summary(frame, what)), title_justify="left", expand=False)
    for name in _HEADER:
        table.add_column(name, justify="right" if name == "EPOCH" else "left", no_wrap=name != "OWNER")
    for row, values in zip(frame.leases, _cells(frame), strict=True):
        table.add_row(*map(Text, values), style=styles.get(row.state))
    parts: list[Any] = [table]
    if frame.transitions:
        recent = Table(title="Recent transitions (newest first)", title_justify="left", show_header=False, box=None)
        for t in frame.transitions:
            style = "red" if t.event == "force_released" else None
            recent.add_row(*map(Text, _transition_cells(t)), style=style)
        parts.append(recent)
    parts.append(Text("Ctrl-C to stop."))
    return Group(*parts)


def rich_available() -> bool:
    """rich (the ``watch`` extra) can be imported."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def watch(
    watcher: Watcher,
    out: TextIO,
    *,
    what: str,
    interval: float = 1.0,
    once: bool = False,
    as_json: bool = False,
    plain: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """Show frames on ``out`` every ``interval`` seconds until Ctrl-C or ``stop``; ``once`` shows one frame.

    ``as_json`` writes one JSON document per frame, on one line each unless ``once``. A terminal gets
    rich's live view, unless ``plain`` or rich is missing, or else the plain view redrawn in place.
    """
    stop = stop or threading.Event()
    terminal = bool(getattr(out, "isatty", lambda: False)())
    try:
        if once:
            frame = watcher.read()
            out.write((json.dumps(frame.as_json(), indent=2) if as_json else draw_plain(frame, what)) + "\n")
            return
        if as_json:
            _loop(watcher, stop, interval, lambda frame: _line(out, json.dumps(frame.as_json())))
        elif terminal and not plain and rich_available():
            _live(watcher, out, what, interval, stop)
        else:
            prefix = _REDRAW if terminal else ""
            _loop(watcher, stop, interval, lambda frame: _line(out, prefix + draw_plain(frame, what, live=True)))
    except KeyboardInterrupt:
        out.write("\nstopped\n")
        out.flush()


def _line(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


def _loop(watcher: Watcher, stop: threading.Event, interval: float, show: Callable[[Frame], None]) -> None:
    while not stop.is_set():
        show(watcher.read())
        stop.wait(interval)  # the refresh period (a Ctrl-C interrupts it)


def _live(watcher: Watcher, out: TextIO, what: str, interval: float, stop: threading.Event) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console(file=out, force_terminal=True)
    with Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live:
        _loop(watcher, stop, interval, lambda frame: live.update(_draw_rich(frame, what), refresh=True))
