"""A lease's history in a real browser: headless Chromium opens a lease's page after a real life
(release, lapse, force release, hand-off, re-acquire), reads the chart, requests a hand-off and
force-releases through the admin.

Needs Debian's ``chromium`` and Playwright, like ``test_admin_browser`` (skipped otherwise). Set
``PG_LEASE_SCREENSHOT_DIR`` to keep the screenshot.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.urls import reverse

from pg_lease_django import Lease
from pg_lease_django.models import LeaseTenure
from tests.cluster.test_admin_browser import CHROMIUM, CHROMIUM_ARGS, keep
from tests.history_story import STORY, recording, tell

if TYPE_CHECKING:
    from playwright.sync_api import FloatRect

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None, reason="playwright is not installed (pip install playwright)"
    ),
    pytest.mark.django_db(transaction=True),
]

PASSWORD = "correct horse battery staple"


@pytest.fixture
def server(request: pytest.FixtureRequest, settings: Any) -> Any:
    """pytest-django's live_server, its host allowed (as in ``test_admin_browser``)."""
    server = request.getfixturevalue("live_server")
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, urlsplit(server.url).hostname]
    return server


@pytest.fixture
def recorded() -> Iterator[None]:
    with recording():
        yield


def overlapping(boxes: list[FloatRect]) -> list[tuple[int, int]]:
    """Pairs of boxes that overlap (texts drawn over each other are not legible)."""
    return [
        (i, j)
        for i, a in enumerate(boxes)
        for j, b in enumerate(boxes)
        if i < j
        and a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    ]


def test_a_lease_page_draws_its_history_and_requests_a_hand_off(server: Any, recorded: None, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    key = "jobs:nightly-report"
    User.objects.create_superuser("ops", password=PASSWORD)
    epochs = tell(key)
    page_url = server.url + reverse("admin:pg_lease_django_lease_change", args=[quote(key)])
    shot = tmp_path / "admin-lease-history.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{server.url}/admin/login/?next={page_url}")
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")

            chart = page.locator("#pg-lease-history svg.pg-lease-timeline")
            expect(chart).to_be_visible()
            bars = chart.locator("g.pg-lease-tenure")
            expect(bars).to_have_count(len(STORY))
            assert [int(bars.nth(i).get_attribute("data-epoch") or 0) for i in range(len(STORY))] == epochs
            chart_box = chart.bounding_box()
            assert chart_box is not None
            for i in range(len(STORY)):
                box = bars.nth(i).locator("rect.pg-lease-bar").bounding_box()
                assert box is not None and box["width"] >= 2 and box["height"] >= 12, (i, box)
                assert chart_box["x"] <= box["x"] and box["x"] + box["width"] <= chart_box["x"] + chart_box["width"]
            for outcome in ("lapsed", "force_released", "handed_off"):
                expect(chart.locator(f".pg-lease-mark-{outcome}")).to_have_count(1)
            expect(chart.locator(".pg-lease-outcome", has_text="force-released by ops@console")).to_be_visible()
            expect(chart.locator("text.pg-lease-lane")).to_have_text(["worker-a", "worker-b", "worker-c"])
            expect(chart.locator("rect.pg-lease-until-expiry")).to_have_count(1)
            lane_labels = [chart.locator("text.pg-lease-lane").nth(i).bounding_box() for i in range(3)]
            assert all(b is not None and b["height"] >= 10 for b in lane_labels)  # readable size
            words = chart.locator("text.pg-lease-outcome, text.pg-lease-epoch")
            boxes = [words.nth(i).bounding_box() for i in range(words.count())]
            assert not overlapping([b for b in boxes if b is not None])

            table = page.locator("#pg-lease-tenures")
            expect(table.locator("tbody tr")).to_have_count(len(STORY))
            expect(table.locator("tbody tr").first).to_contain_text("held, expires in")
            expect(table.locator("tr.pg-lease-outcome-force_released")).to_contain_text("ops@console")

            page.click("#pg-lease-request-handoff")
            expect(page.locator("ul.messagelist")).to_contain_text(
                f"Hand-off requested from {key!r} ('worker-b', epoch {epochs[-1]})"
            )
            expect(table.locator("tbody tr").first).to_contain_text("hand-off requested")
            expect(chart.locator(".pg-lease-mark-handoff-requested")).to_have_count(1)
            page.screenshot(path=str(shot), full_page=True)

            # The operator who force-releases from the admin is recorded in the history.
            page.goto(server.url + reverse("admin:pg_lease_django_lease_changelist"))
            page.locator("tr", has_text=key).locator("input.action-select").check()
            page.select_option("select[name=action]", "force_release")
            page.click("button[name=index]")
            page.click("input[type=submit][value^='Yes, force-release']")
            expect(page.locator("ul.messagelist")).to_contain_text(f"Force-released 1 lease: {key!r}")
            page.goto(page_url)
            expect(chart.locator("g.pg-lease-tenure")).to_have_count(len(STORY))
            expect(chart.locator(".pg-lease-mark-force_released")).to_have_count(2)
            expect(page.locator("#pg-lease-request-handoff")).to_have_count(0)  # free: nobody to ask
        finally:
            browser.close()

    assert shot.read_bytes().startswith(b"\x89PNG")
    keep(shot)
    last = LeaseTenure.objects.for_key(key).last()
    assert last is not None
    assert (last.epoch, last.end_reason, last.ended_by) == (epochs[-1], "force_released", "ops")
    assert [e.get_change_message() for e in LogEntry.objects.order_by("pk")] == [
        f"Requested a hand-off from 'worker-b' at epoch {epochs[-1]}.",
        f"Force-released: was held by 'worker-b' at epoch {epochs[-1]}; new epoch {epochs[-1] + 1}.",
    ]
    assert Lease.objects.inspect(key).status == "free"


#: What scrolls sideways: each results box, table or form row wider than its box, and the innermost
#: elements that reach past the window's right edge, as [element, pixels]. (Not inside the history
#: chart: an SVG is scaled to its box, and clips what it draws outside it.)
OVERFLOWS = """(() => {
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + (e.className ? '.' + e.className : '');
  const limit = document.documentElement.clientWidth;
  const boxes = [...document.querySelectorAll('#changelist .results, table, .form-row')]
    .filter(e => e.scrollWidth > e.clientWidth).map(e => [name(e), e.scrollWidth - e.clientWidth]);
  const past = [...document.body.querySelectorAll('*')]
    .filter(e => e.children.length === 0 && !(e instanceof SVGElement) && e.getBoundingClientRect().right > limit + 1)
    .slice(0, 5).map(e => [name(e), Math.round(e.getBoundingClientRect().right - limit)]);
  return [...boxes, ...past];
})()"""


def test_lease_and_tenure_pages_fit_1280_px_with_a_long_key_and_show_seconds(
    server: Any, recorded: None, tmp_path: Path
) -> None:
    """Issue 28, item 6: a 158-character key, a 0.5 s lease; at 1280 px nothing scrolls sideways,
    and the lease's and the tenures' times show seconds (acquired and expires differ)."""
    from playwright.sync_api import sync_playwright

    User.objects.create_superuser("ops", password=PASSWORD)
    key = ("reports:" + "quarterly-revenue-by-region-and-product-line-" * 4)[:158]
    assert len(key) == 158 and " " not in key
    owner = "worker-7@host-b.example.internal:12345:9f8e7d6c5b4a39281706f5e4d3c2b1a0"
    grant = Lease.objects.acquire(key, owner, ttl=0.5)
    assert grant is not None
    Lease.objects.release(key, owner, grant.epoch)
    assert Lease.objects.acquire(key, owner, ttl=0.5) is not None  # an open tenure too
    pages = {
        "lease list": "/admin/pg_lease_django/lease/",
        "lease page": reverse("admin:pg_lease_django_lease_change", args=[quote(key)]),
        "tenure list": "/admin/pg_lease_django/leasetenure/",
    }
    widths: dict[str, list[Any]] = {}
    texts: dict[str, str] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{server.url}/admin/login/?next=/admin/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_selector("#content")
            for name, path in pages.items():
                page.goto(f"{server.url}{path}")
                page.wait_for_selector("#content")
                shot = tmp_path / f"admin-{name.replace(' ', '-')}-long-key-1280.png"
                page.screenshot(path=str(shot), full_page=True)
                keep(shot)
                # Sideways overflow of the page, and of each results box, table and form row in it.
                overflows = page.evaluate(OVERFLOWS)
                widths[name] = overflows
                texts[name] = page.inner_text("#content")
        finally:
            browser.close()
    assert widths == {name: [] for name in pages}, widths  # [element, pixels] of each that scrolls sideways
    seconds = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"
    acquired = re.search(rf"acquired at:?\s+({seconds})", texts["lease page"], re.I)
    expires = re.search(rf"expires at:?\s+({seconds})", texts["lease page"], re.I)
    assert acquired is not None and expires is not None and acquired[1] != expires[1], texts["lease page"]
    assert len(re.findall(seconds, texts["tenure list"])) >= 3, texts["tenure list"]  # two granted, one ended
    assert "open" in texts["tenure list"], texts["tenure list"]
