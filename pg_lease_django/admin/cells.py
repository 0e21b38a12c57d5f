"""How the admin's cells show a lease's text and times: others' data escaped and wrapped, server times in UTC.

Keys, owners and operators are other roles' data: Django escapes their HTML, and a cell here also
shows them through `printable`, since a bidi override or a control character survives HTML
escaping and reorders or hides the text beside it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.utils.html import format_html
from django.utils.safestring import SafeString

from pg_lease_django.display import printable

__all__ = ["nowrap", "utc", "wrapping"]


def wrapping(text: str, min_width: str = "6em") -> SafeString:
    """A cell of other roles' data, such as a key or an owner, escaped through `printable`.

    Keys and owners have no spaces to break at, so a long one is broken anywhere. The cell is yet at
    least ``min_width`` wide, so that a long one is a few lines, not a column of syllables.
    """
    text = printable(text)
    return format_html(
        '<span style="display:inline-block;min-width:min({},{}ch);overflow-wrap:anywhere">{}</span>',
        min_width,
        len(text),
        text,
    )


def nowrap(text: str, title: str = "") -> SafeString:
    """A changelist cell on one line (at 1280 px the default wrapping cut or tripled the row)."""
    return format_html('<span style="white-space:nowrap" title="{}">{}</span>', title, text)


def utc(moment: datetime | None) -> str:
    """A server time for a table cell: UTC, to the millisecond."""
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
