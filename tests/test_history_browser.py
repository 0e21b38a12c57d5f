"""A lease's history in a real browser: headless Chromium opens a lease's page after a real life
(release, lapse, force release, hand-off, re-acquire), reads the chart, requests a hand-off and
force-releases through the admin.

Needs Debian's ``chromium`` and Playwright, like ``test_admin_browser`` (skipped otherwise). Set
``PG_LEASE_SCREENSHOT_DIR`` to keep the screenshot.
"""

from __future__ import annotations

import importlib.util
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
from tests.history_story import STORY, recording, tell
from tests.test_admin_browser import CHROMIUM, CHROMIUM_ARGS, keep

if TYPE_CHECKING:
    from playwright.sync_api import FloatRect

pytestmark = [
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
