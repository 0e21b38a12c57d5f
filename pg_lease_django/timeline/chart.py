"""A lease's history drawn as an SVG timeline chart by `draw_timeline`, one lane per owner.

Drawn server-side, as a plain SVG string with no script. Keys and owners are user data, so every
text is escaped. The owners and operators are shown through `printable`, since a bidi override or
a control character would reorder or hide what is drawn beside it. The key is quoted with ``!r``.
The ``data-owner`` attributes keep the exact owner. It reads nothing:
`pg_lease_django.timeline.reading.read_history` gives it a `History`.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Any

from pg_lease_django.display import format_duration, printable
from pg_lease_django.models import EndReason
from pg_lease_django.timeline.reading import HELD, UNKNOWN, History, TenureRow

# ---- the chart -----------------------------------------------------------------------------------

_LEFT, _RIGHT, _TOP, _LANE, _BAR = 180, 30, 64, 46, 16
_COLOURS = {
    "bar": "#4a90d9",
    "held": "#2e9e44",
    "unknown": "#9b9b9b",
    "lapsed": "#e08e0b",
    "forced": "#d0021b",
    "advanced": "#7b3fb5",
    "handoff": "#1e7b8c",
    "gap": "#f1f1f1",
}
# Characters XML 1.0 cannot carry at all (escaping does not help): shown as U+FFFD.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]


def _text(value: object) -> str:
    """Text for an SVG element or attribute: escaped, quotes too, and without XML-illegal characters."""
    return escape(_NOT_XML.sub("\ufffd", str(value)), quote=True)


def _short(value: str, limit: int = 24) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "\N{HORIZONTAL ELLIPSIS}"


def _clock(moment: datetime, with_date: bool) -> str:
    moment = moment.astimezone(UTC)
    return moment.strftime("%m-%d %H:%M" if with_date else "%H:%M:%S")


def draw_timeline(history: History, *, width: int = 960) -> str:
    """Draw ``history`` as a self-contained SVG document, returned as a string, one lane per owner.

    Bars run along the server clock from grant to end; the gaps between tenures are shaded. How a
    tenure ended is marked at its end: a red cross for a force release, a purple arrow for an epoch
    advance, an orange ring for a lapse, a teal chevron for a hand-off. The current grant is green,
    solid up to now and outlined up to its expiry. Each bar has a ``<title>``, its tooltip. For
    tests and styling it has the classes ``pg-lease-tenure``, ``pg-lease-outcome-<outcome>`` and
    ``pg-lease-mark-<outcome>``, and ``data-epoch`` / ``data-owner`` attributes.
    """
    if not history.tenures:
        return _empty_chart(history, width)
    tenures = history.tenures
    now = history.server_time
    owners = list(dict.fromkeys(t.owner for t in tenures))
    start = min(t.granted_at for t in tenures)
    happened = max([now, *(t.ended_at or now for t in tenures)])
    # A long TTL would squeeze the past into a corner: show a current expiry only a little ahead.
    ahead = happened + max((happened - start) / 4, timedelta(seconds=1))
    end = max([happened, *(min(t.expires_at, ahead) for t in tenures if t.expires_at)])
    span = max((end - start).total_seconds(), 1.0) * 1.03
    scale = (width - _LEFT - _RIGHT) / span
    lanes_bottom = _TOP + _LANE * len(owners)
    height = lanes_bottom + 92

    def x(moment: datetime) -> float:
        return round(_LEFT + (moment - start).total_seconds() * scale, 1)

    noun = "tenure" if history.count == 1 else "tenures"
    shown = f"{history.count} {noun}" if len(tenures) == history.count else f"last {len(tenures)} of {history.count}"
    title = f"Lease {history.key!r}: {shown}, server time {_clock(now, False)} UTC"
    # The heading fits the width (15 px bold: about 9 px a character); the tooltip keeps the key whole.
    rest = len(title) - len(repr(history.key))
    fitted = _short(history.key, max(12, (width - 20) // 9 - rest - 2))  # 2: the quotes of repr
    heading = f"Lease {fitted!r}: {shown}, server time {_clock(now, False)} UTC"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="pg-lease-timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_text(title)}" '
        'font-family="sans-serif" font-size="12">',
        f"<title>{_text(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text class="pg-lease-heading" x="10" y="22" font-size="15" font-weight="bold">{_text(heading)}</text>',
    ]
    out += _gaps(tenures, now, x, lanes_bottom)
    out += _axis(start, end, x, lanes_bottom)
    for row, owner in enumerate(owners):
        y = _TOP + row * _LANE
        out.append(f'<line x1="{_LEFT}" y1="{y + _LANE}" x2="{width - _RIGHT}" y2="{y + _LANE}" stroke="#e4e4e4"/>')
        lane = printable(owner)
        out.append(
            f"<g><title>{_text(lane)}</title>"
            f'<text class="pg-lease-lane" x="10" y="{y + 32}" font-weight="bold">{_text(_short(lane))}</text></g>'
        )
    label_edges: dict[str, float] = {}
    for tenure in tenures:
        out += _bar(tenure, now, end, x, _TOP + owners.index(tenure.owner) * _LANE, label_edges)
    if any(t.outcome == HELD for t in tenures):
        out.append(
            f'<line class="pg-lease-now" x1="{x(now)}" y1="{_TOP - 6}" x2="{x(now)}" y2="{lanes_bottom}" '
            'stroke="#333" stroke-dasharray="2,3"/>'
        )
        out.append(f'<text x="{x(now)}" y="{_TOP - 9}" text-anchor="middle" fill="#333">now</text>')
    out += _legend(lanes_bottom + 50)
    out.append("</svg>")
    return "\n".join(out)


def _empty_chart(history: History, width: int) -> str:
    message = f"No recorded tenures of lease {history.key!r} (is it in PG_LEASE_HISTORY?)"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="pg-lease-timeline" width="{width}" height="40" '
        f'viewBox="0 0 {width} 40" role="img" aria-label="{_text(message)}" font-family="sans-serif" font-size="13">'
        f'<text class="pg-lease-heading" x="10" y="24" fill="#555">{_text(message)}</text></svg>'
    )


def _gaps(tenures: list[TenureRow], now: datetime, x: Any, bottom: int) -> list[str]:
    """Shade the stretches of server time when nobody held the lease."""
    out = []
    covered_until: datetime | None = None
    for tenure in sorted(tenures, key=lambda t: t.granted_at):
        if covered_until is not None and tenure.granted_at > covered_until:
            left, right = x(covered_until), x(tenure.granted_at)
            if right - left >= 1:
                free_for = format_duration(tenure.granted_at - covered_until)
                out.append(
                    f'<rect class="pg-lease-gap" x="{left}" y="{_TOP}" width="{round(right - left, 1)}" '
                    f'height="{bottom - _TOP}" fill="{_COLOURS["gap"]}"><title>no holder for {free_for}</title></rect>'
                )
        tenure_end = tenure.ended_at or tenure.expires_at or now
        covered_until = tenure_end if covered_until is None else max(covered_until, tenure_end)
    return out


def _axis(start: datetime, end: datetime, x: Any, bottom: int) -> list[str]:
    """Ticks on round server times (UTC), about eight of them."""
    span = (end - start).total_seconds()
    step = next((s for s in _STEPS if span / s <= 8), math.ceil(span / 8 / 86400) * 86400)
    with_date = span > 86400
    first = math.ceil(start.timestamp() / step) * step
    out = []
    tick = first
    while tick <= end.timestamp():
        moment = datetime.fromtimestamp(tick, UTC)
        out.append(f'<line x1="{x(moment)}" y1="{_TOP}" x2="{x(moment)}" y2="{bottom + 4}" stroke="#ddd"/>')
        out.append(
            f'<text class="pg-lease-tick" x="{x(moment)}" y="{bottom + 18}" text-anchor="middle" fill="#555">'
            f"{_clock(moment, with_date)}</text>"
        )
        tick += step
    out.append(f'<text x="10" y="{bottom + 18}" fill="#555">server time (UTC)</text>')
    return out


def _bar(tenure: TenureRow, now: datetime, end: datetime, x: Any, y: int, label_edges: dict[str, float]) -> list[str]:
    """One tenure: its bar, its epoch label, the mark of how it ended, and its tooltip."""
    top = y + 18
    left = x(tenure.granted_at)
    solid_end = tenure.ended_at or (now if tenure.outcome == HELD else tenure.granted_at)
    right = max(x(solid_end), left + 3)
    colour = _COLOURS["held" if tenure.outcome == HELD else "unknown" if tenure.outcome == UNKNOWN else "bar"]
    out = [
        f'<g class="pg-lease-tenure pg-lease-outcome-{_text(tenure.outcome)}" data-epoch="{tenure.epoch}" '
        f'data-owner="{_text(tenure.owner)}">',
        f"<title>{_text(_tooltip(tenure, now))}</title>",
        f'<rect class="pg-lease-bar" x="{left}" y="{top}" width="{round(right - left, 1)}" height="{_BAR}" rx="2" '
        f'fill="{colour}"/>',
    ]
    if tenure.outcome == HELD and tenure.expires_at is not None and x(tenure.expires_at) > right:
        until = x(min(tenure.expires_at, end))
        out.append(
            f'<rect class="pg-lease-until-expiry" x="{right}" y="{top}" width="{round(until - right, 1)}" '
            f'height="{_BAR}" fill="{colour}" fill-opacity="0.25" stroke="{colour}" stroke-dasharray="3,2"/>'
        )
        if tenure.expires_at > end:  # cut at the chart's edge: say when it ends
            left_in = format_duration(tenure.expires_at - now)
            out.append(
                f'<text class="pg-lease-expiry" x="{until}" y="{top + _BAR + 12}" font-size="10" text-anchor="end" '
                f'fill="{_COLOURS["held"]}">expires in {left_in} \N{RIGHTWARDS ARROW}</text>'
            )
    if tenure.handoff_requested_at is not None:
        at = x(tenure.handoff_requested_at)
        out.append(
            f'<path class="pg-lease-mark pg-lease-mark-handoff-requested" d="M{at} {top - 4} l4 -6 h-8 z" '
            f'fill="{_COLOURS["handoff"]}"/>'
        )
    label = f"#{tenure.epoch}"
    if left >= label_edges.get(tenure.owner, 0):
        out.append(f'<text class="pg-lease-epoch" x="{left}" y="{top - 3}" font-size="11" fill="#333">{label}</text>')
        label_edges[tenure.owner] = left + 7 * len(label) + 4
    out += _mark(tenure, right, top)
    out.append("</g>")
    return out


def _mark(tenure: TenureRow, at: float, top: int) -> list[str]:
    """How it ended, drawn at its end: a shape (colour-blind safe) and a word under the bar."""
    mid, bottom = top + _BAR / 2, top + _BAR
    outcome = tenure.outcome
    cls = f"pg-lease-mark pg-lease-mark-{outcome}"
    if outcome == EndReason.FORCE_RELEASED:
        colour = _COLOURS["forced"]
        shape = (
            f'<path class="{cls}" d="M{at - 5} {mid - 5} l10 10 M{at + 5} {mid - 5} l-10 10" stroke="{colour}" '
            'stroke-width="3"/>'
        )
    elif outcome == EndReason.EPOCHS_ADVANCED:
        colour = _COLOURS["advanced"]
        shape = f'<path class="{cls}" d="M{at} {top - 3} l6 10 h-12 z" fill="{colour}" stroke="white"/>'
    elif outcome == EndReason.LAPSED:
        colour = _COLOURS["lapsed"]
        shape = f'<circle class="{cls}" cx="{at}" cy="{mid}" r="6" fill="white" stroke="{colour}" stroke-width="3"/>'
    elif outcome == EndReason.HANDED_OFF:
        colour = _COLOURS["handoff"]
        shape = f'<path class="{cls}" d="M{at - 2} {top - 2} l8 {_BAR / 2 + 2} l-8 {_BAR / 2 + 2} z" fill="{colour}"/>'
    else:
        return []
    word = "lapsed" if outcome == EndReason.LAPSED else printable(tenure.outcome_text)
    if tenure.forced and tenure.ended_by:
        word += f" by {_short(printable(tenure.ended_by), 16)}"
    return [
        shape,
        f'<text class="pg-lease-outcome" x="{at}" y="{bottom + 12}" font-size="10" text-anchor="middle" '
        f'fill="{colour}">{_text(word)}</text>',
    ]


def _tooltip(tenure: TenureRow, now: datetime) -> str:
    granted = tenure.granted_at.astimezone(UTC).isoformat(sep=" ", timespec="milliseconds")
    parts = [f"epoch {tenure.epoch}", printable(tenure.owner), f"granted {granted}"]
    if tenure.outcome == HELD and tenure.expires_at is not None:
        parts.append(f"held for {format_duration(tenure.duration(now))}")
        parts.append(f"expires {tenure.expires_at.astimezone(UTC).isoformat(sep=' ', timespec='milliseconds')}")
        if tenure.handoff_requested_at is not None:
            parts.append("hand-off requested")
    elif tenure.ended_at is not None:
        ended = tenure.ended_at.astimezone(UTC).isoformat(sep=" ", timespec="milliseconds")
        how = printable(tenure.describe(now) + (f" by {tenure.ended_by}" if tenure.ended_by else ""))
        parts += [f"ended {ended}", how, f"lasted {format_duration(tenure.duration(now))}"]
    else:
        parts.append(printable(tenure.outcome_text))
    return " \N{MIDDLE DOT} ".join(parts)


def _legend(y: int) -> list[str]:
    c = _COLOURS
    items = [
        f'<rect x="{_LEFT}" y="{y - 10}" width="14" height="10" fill="{c["bar"]}"/>',
        f'<text x="{_LEFT + 18}" y="{y}">tenure</text>',
        f'<rect x="{_LEFT + 80}" y="{y - 10}" width="14" height="10" fill="{c["held"]}"/>',
        f'<text x="{_LEFT + 98}" y="{y}">held now (outlined: until expiry)</text>',
        f'<rect x="{_LEFT + 300}" y="{y - 10}" width="14" height="10" fill="{c["gap"]}" stroke="#ccc"/>',
        f'<text x="{_LEFT + 318}" y="{y}">no holder</text>',
        f'<circle cx="{_LEFT + 400}" cy="{y - 4}" r="5" fill="white" stroke="{c["lapsed"]}" stroke-width="3"/>',
        f'<text x="{_LEFT + 410}" y="{y}">lapsed</text>',
        f'<path d="M{_LEFT + 466} {y - 9} l8 8 M{_LEFT + 474} {y - 9} l-8 8" stroke="{c["forced"]}" stroke-width="3"/>',
        f'<text x="{_LEFT + 480}" y="{y}">force-released</text>',
        f'<path d="M{_LEFT + 578} {y - 11} l6 10 h-12 z" fill="{c["advanced"]}"/>',
        f'<text x="{_LEFT + 588}" y="{y}">epochs advanced</text>',
        f'<path d="M{_LEFT + 692} {y - 11} l7 6 l-7 6 z" fill="{c["handoff"]}"/>',
        f'<text x="{_LEFT + 704}" y="{y}">handed off</text>',
        f'<text x="{_LEFT}" y="{y + 20}" fill="#333">#7</text>',
        f'<text x="{_LEFT + 24}" y="{y + 20}">epoch of the grant (fencing token)</text>',
        f'<path d="M{_LEFT + 304} {y + 18} l4 -6 h-8 z" fill="{c["handoff"]}"/>',
        f'<text x="{_LEFT + 318}" y="{y + 20}">hand-off requested</text>',
    ]
    return ['<g class="pg-lease-legend" font-size="11">', *items, "</g>"]
