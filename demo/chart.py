"""Draw the demo's timeline as a self-contained SVG: who held the lease when, epochs, writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape


@dataclass
class Lane:
    """One worker's row in the chart."""

    name: str
    # start, end (the worker stopped believing it held), epoch, valid_until (server-side end of the lease)
    holds: list[tuple[float, float, int, float]] = field(default_factory=list)
    writes: list[tuple[float, int]] = field(default_factory=list)  # t, epoch
    rejected: list[tuple[float, int, str]] = field(default_factory=list)  # t, epoch, cause
    paused: list[tuple[float, float]] = field(default_factory=list)
    killed: float | None = None


@dataclass
class Timeline:
    """Everything the chart shows; times are seconds since the demo started."""

    lanes: dict[str, Lane]
    marks: list[tuple[float, float, str]] = field(default_factory=list)  # operator actions: start, end, label
    end: float = 0.0


def _text_width(text: str) -> float:
    """A generous estimate of a label's width at 12 px sans-serif (to keep it inside the chart)."""
    return 7.0 * len(text)


def render(timeline: Timeline, title: str) -> str:
    """Return the SVG document."""
    left, right, lane_h, top = 110, 30, 76, 76
    width = 1180
    scale = (width - left - right) / max(timeline.end, 1.0)
    height = top + lane_h * len(timeline.lanes) + 60

    def x(t: float) -> float:
        return left + t * scale

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="24" font-size="16" font-weight="bold">{escape(title)}</text>',
    ]
    for second in range(int(timeline.end) + 1):
        out.append(f'<line x1="{x(second)}" y1="{top - 8}" x2="{x(second)}" y2="{height - 50}" stroke="#eee"/>')
        out.append(f'<text x="{x(second)}" y="{height - 36}" text-anchor="middle" fill="#666">{second}s</text>')
    for row, lane in enumerate(timeline.lanes.values()):
        y = top + row * lane_h
        out.append(f'<text x="10" y="{y + 30}" font-weight="bold">{escape(lane.name)}</text>')
        for start, end in lane.paused:
            out.append(
                f'<rect x="{x(start)}" y="{y + 4}" width="{max(x(end) - x(start), 1)}" height="{lane_h - 16}" '
                'fill="#ddd"/>'
            )
            out.append(f'<text x="{x(start) + 4}" y="{y + 56}" fill="#555">SIGSTOP … SIGCONT</text>')
        for start, end, epoch, valid_until in lane.holds:
            if end > valid_until:  # still believed held after the lease had ended on the server
                out.append(
                    f'<rect x="{x(valid_until)}" y="{y + 14}" width="{x(end) - x(valid_until)}" height="22" '
                    'fill="none" stroke="#4a90d9" stroke-dasharray="4,3"/>'
                )
            out.append(
                f'<rect x="{x(start)}" y="{y + 14}" width="{max(x(min(end, valid_until)) - x(start), 2)}" height="22" '
                'rx="3" fill="#4a90d9" fill-opacity="0.85"/>'
            )
            if x(min(end, valid_until)) - x(start) >= _text_width(f"epoch {epoch}") + 8:
                out.append(f'<text x="{x(start) + 4}" y="{y + 30}" fill="white">epoch {epoch}</text>')
            else:  # a short bar: the label above it, in the bar's colour, not cut at its end
                out.append(f'<text x="{x(start)}" y="{y + 11}" fill="#2a6db0">epoch {epoch}</text>')
        for t, _epoch in lane.writes:
            out.append(f'<circle cx="{x(t)}" cy="{y + 44}" r="3" fill="#2e9e44"/>')
        for t, epoch, cause in lane.rejected:
            out.append(f'<text x="{x(t)}" y="{y + 50}" fill="#d0021b" font-size="16" text-anchor="middle">✗</text>')
            label = f"write at epoch {epoch} rejected ({cause})"
            if x(t) + 8 + _text_width(label) <= width - 4:
                out.append(f'<text x="{x(t) + 8}" y="{y + 70}" fill="#d0021b">{escape(label)}</text>')
            else:  # near the right edge: the label ends at the mark instead of running off the chart
                out.append(f'<text x="{x(t) - 8}" y="{y + 70}" fill="#d0021b" text-anchor="end">{escape(label)}</text>')
        if lane.killed is not None:
            out.append(f'<text x="{x(lane.killed)}" y="{y + 10}" fill="black" text-anchor="middle">kill -9</text>')
            out.append(
                f'<line x1="{x(lane.killed)}" y1="{y + 12}" x2="{x(lane.killed)}" y2="{y + 40}" stroke="black" '
                'stroke-width="2"/>'
            )
    for n, (start, end, label) in enumerate(timeline.marks):
        out.append(
            f'<rect x="{x(start)}" y="{top - 8}" width="{max(x(end) - x(start), 2)}" height="{height - 42 - top}" '
            'fill="#f5a623" fill-opacity="0.25" stroke="#f5a623" stroke-dasharray="5,4"/>'
        )
        text = f"operator: {label}"
        anchor = "start" if x(start) + 4 + _text_width(text) <= width - 4 else "end"
        at = x(start) + 4 if anchor == "start" else x(end) - 4
        # Two rows, alternating: marks close in time do not write over each other.
        out.append(
            f'<text x="{at}" y="{top - 12 - 14 * (n % 2)}" fill="#b36b00" text-anchor="{anchor}">{escape(text)}</text>'
        )
    legend_y = height - 14
    out.append(f'<rect x="{left}" y="{legend_y - 10}" width="14" height="10" fill="#4a90d9"/>')
    out.append(f'<text x="{left + 18}" y="{legend_y}">lease held (epoch)</text>')
    out.append(f'<circle cx="{left + 160}" cy="{legend_y - 4}" r="3" fill="#2e9e44"/>')
    out.append(f'<text x="{left + 168}" y="{legend_y}">fenced write accepted</text>')
    out.append(f'<text x="{left + 320}" y="{legend_y}" fill="#d0021b">✗ fenced write rejected</text>')
    out.append(
        f'<rect x="{left + 480}" y="{legend_y - 10}" width="14" height="10" fill="none" stroke="#4a90d9" '
        'stroke-dasharray="4,3"/>'
    )
    out.append(f'<text x="{left + 498}" y="{legend_y}">worker still believes it holds; the server says no</text>')
    out.append("</svg>")
    return "\n".join(out)
