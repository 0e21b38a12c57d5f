"""The demo's timeline chart (issue 28, item 8), measured in Chromium: no two labels overlap, every
label stays inside the chart, every operator action (act 4's force release, act 5's hand-off) is
marked, a short bar's epoch is not cut, and the time axis uses the width (no empty quarter).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from demo.chart import Lane, Timeline, render
from tests.cluster.test_admin_browser import CHROMIUM, CHROMIUM_ARGS
from tests.cluster.test_history_browser import overlapping

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="playwright is not installed"),
]


def story() -> Timeline:
    """A run shaped like `make demo`'s: three lanes, a pause, a kill, two operator actions close to
    each other and to the end, short holds, rejections near the right edge."""
    a, b, c = Lane("worker-a"), Lane("worker-b"), Lane("worker-c")
    a.holds += [(0.2, 6.0, 1, 3.0), (17.4, 17.7, 7, 17.7)]
    a.writes += [(0.5, 1), (1.0, 1)]
    a.paused.append((1.2, 5.8))
    a.rejected.append((6.0, 1, "epoch_mismatch"))
    b.holds += [(3.1, 8.0, 2, 8.0), (13.0, 13.3, 5, 13.3)]
    b.writes += [(3.5, 2), (6.5, 2)]
    b.killed = 8.0
    c.holds += [(10.2, 12.1, 3, 12.1), (12.3, 12.6, 4, 12.6), (15.0, 17.2, 6, 17.2)]
    c.rejected.append((17.3, 6, "not_owner"))
    return Timeline({"worker-a": a, "worker-b": b, "worker-c": c}, [(12.0, 12.2, "leases release --force"),
                    (16.9, 17.1, "leases handoff")], end=17.8)  # fmt: skip


def test_the_demo_chart_is_readable(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    svg = render(story(), "pg_lease_django demo: lease 'demo:counter', TTL 2s")
    page_file = tmp_path / "timeline.html"
    page_file.write_text(f"<!doctype html><body style='margin:0'>{svg}</body>", encoding="utf-8")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 600})
            page.goto(page_file.as_uri())
            texts = page.evaluate(
                "[...document.querySelectorAll('svg text')].map(t => { const b = t.getBBox();"
                " return {text: t.textContent, x: b.x, y: b.y, width: b.width, height: b.height,"
                " fill: t.getAttribute('fill')}; })"
            )
            bars = page.evaluate(
                "[...document.querySelectorAll('svg rect[fill=\"#4a90d9\"][rx]')].map(r => { const b = r.getBBox();"
                " return {x: b.x, y: b.y, width: b.width, height: b.height}; })"
            )
            width = page.evaluate("document.querySelector('svg').width.baseVal.value")
            page.screenshot(path=str(tmp_path / "timeline.png"))
        finally:
            browser.close()
    labels = [t for t in texts if not t["text"].endswith("s") or not t["text"][:-1].isdigit()]  # not the axis
    clashes = [(labels[i]["text"], labels[j]["text"]) for i, j in overlapping(labels)]
    assert clashes == [], clashes
    outside = [t["text"] for t in texts if t["x"] < 0 or t["x"] + t["width"] > width]
    assert outside == [], outside
    names = [t["text"] for t in texts]
    assert "operator: leases release --force" in names and "operator: leases handoff" in names, names
    assert [name for name in names if name.startswith("epoch ")] == [f"epoch {n}" for n in (1, 7, 2, 5, 3, 4, 6)]
    inside_bars = [t for t in texts if t["fill"] == "white"]  # an epoch drawn on its bar must fit in it
    cut = [
        t["text"]
        for t in inside_bars
        if not any(b["x"] <= t["x"] and t["x"] + t["width"] <= b["x"] + b["width"] for b in bars)
    ]
    assert cut == [], f"epoch labels cut at their bar's end: {cut}"
    last_second = max(t["x"] + t["width"] for t in texts if t["text"] == "17s")
    assert last_second > width * 0.85, f"the time axis ends at {last_second:.0f} of {width:.0f} px"
