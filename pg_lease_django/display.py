"""How a lease is shown to people, the same in ``manage.py leases``, ``leases run`` and the admin."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .status import LeaseStatus

__all__ = ["LeaseRow", "describe_expiry", "format_duration", "json_text", "printable"]

#: Unicode categories a person must never be shown raw: controls (escape sequences, carriage
#: returns, newlines), formatting characters (bidi overrides and isolates, zero-width joiners, soft
#: hyphens, tags), the line and paragraph separators, and private-use, surrogate and unassigned code
#: points (a font or a later Unicode may draw them as anything). Keys and owners may hold any of them
#: (any non-empty text, as the spec says): every view escapes them instead.
_ACTED_ON = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})


def printable(text: str) -> str:
    """``text`` as a terminal shows it and never obeys it.

    Each control, bidi or other formatting character becomes a Python-style escape, such as
    ``\\x1b`` or ``\\u202e``. ``\\`` is doubled so an escape is never ambiguous. Keys, owners and
    error texts are data from other roles: every human-readable output passes them through this.
    ``--json`` stays exact.
    """
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text  # the usual case: nothing to look at character by character
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif unicodedata.category(char) in _ACTED_ON:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def json_text(document: Any, *, indent: int | None = 2) -> str:
    """``document`` as JSON text that shows no character a terminal could obey: readable text stays
    as it is, and every character `printable` escapes is written ``\\uXXXX`` (a surrogate pair past
    U+FFFF), so the JSON still decodes to the exact strings."""
    text = json.dumps(document, indent=indent, ensure_ascii=False)
    if text.isascii():
        return text  # json.dumps escapes every ASCII control already
    # Past ASCII only: the layout's newlines are JSON's own, and json.dumps escaped the ASCII controls of strings.
    return "".join(
        _json_escape(char) if not char.isascii() and unicodedata.category(char) in _ACTED_ON else char for char in text
    )


def _json_escape(char: str) -> str:
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def format_duration(delta: timedelta) -> str:
    """Render a non-negative duration compactly: ``0.4s``, ``29s``, ``4m 05s``, ``2h 03m``, ``3d 04h``.

    Negative durations are rendered by their magnitude; callers say "ago" themselves.
    """
    seconds = abs(delta.total_seconds())
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def describe_expiry(state: str, expires_in: timedelta | None) -> str:
    """Say when a lease expires relative to the server clock: ``in 29s``, ``lapsed 3m 05s ago``, ``-``.

    Args:
        state: a `LeaseStatus`, as ``pg_lease_status`` computed it.
        expires_in: ``expires_at`` minus the server time the state was computed at (None when free).
    """
    if state == LeaseStatus.FREE or expires_in is None:
        return "-"
    if state == LeaseStatus.HELD:
        return f"in {format_duration(max(expires_in, timedelta(0)))}"
    return f"lapsed {format_duration(min(expires_in, timedelta(0)))} ago"


@dataclass(frozen=True)
class LeaseRow:
    """One lease as the operator sees it, all times from the server clock, read by `LeaseQuerySet.rows`.

    Times stay the text the server wrote: ISO 8601 in UTC, always with microseconds. That is the
    stable JSON form, and far cheaper for 100k rows than datetimes parsed only to be printed again.

    Attributes:
        key: the lease key.
        state: held, lapsed or free.
        owner: the holder, or the former holder when lapsed; None when free.
        epoch: the current epoch.
        acquired_at: when the current or lapsed grant was made; None when free.
        expires_at: when it lapses, or lapsed; None when free.
        expires_in: seconds from ``server_time`` to ``expires_at``, negative when lapsed; None when free.
        server_time: the server clock the state was computed at.
    """

    key: str
    state: LeaseStatus
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
