"""One real browser: headless Chromium logs into the admin, force-releases a lease, saves a screenshot.

Needs Debian's ``chromium`` package and Playwright from PyPI (``pip install playwright``; no
``playwright install``: the system Chromium is used). Skipped, saying which is missing, otherwise.
Set ``PG_LEASE_SCREENSHOT_DIR`` to also keep the screenshots there (docs/img/ is made that way).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User

from pg_lease_django import Lease

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None, reason="playwright is not installed (pip install playwright)"
    ),
    pytest.mark.django_db(transaction=True),
]


def keep(screenshot: Path) -> None:
    target = os.environ.get("PG_LEASE_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(target) / screenshot.name)


@pytest.fixture
def server(request: pytest.FixtureRequest, settings: Any) -> Any:
    """pytest-django's live_server (static files come from django.contrib.staticfiles)."""
    # Requested here (not as an argument, which would start it first: it is session-scoped), so
    # pytest-django does not add its host to ALLOWED_HOSTS for us.
    server = request.getfixturevalue("live_server")
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, urlsplit(server.url).hostname]
    return server


def test_force_release_in_a_real_browser(server: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    # Database work happens before and after the browser session: Playwright's sync API runs an
    # event loop in this thread, where Django refuses synchronous ORM calls.
    User.objects.create_superuser("ops", password="correct horse battery staple")
    stuck = Lease.objects.acquire("jobs:nightly-report", "worker-7@host-b", ttl=600)
    other = Lease.objects.acquire("jobs:hourly-sync", "worker-2@host-a", ttl=600)
    short = Lease.objects.acquire("jobs:cleanup", "worker-3@host-c", ttl=0.001)
    assert stuck is not None and other is not None and short is not None
    free = Lease.objects.acquire("reports:weekly", "worker-1@host-a", ttl=60)
    assert free is not None
    Lease.objects.release(free.key, free.owner, free.epoch)

    list_png = tmp_path / "admin-lease-list.png"
    confirm_png = tmp_path / "admin-force-release-confirmation.png"
    done_png = tmp_path / "admin-force-released.png"
    detail_png = tmp_path / "admin-lease-detail.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 640})
            page.goto(f"{server.url}/admin/login/?next=/admin/pg_lease_django/lease/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "correct horse battery staple")
            page.click("input[type=submit]")

            expect(page.locator("#result_list")).to_contain_text("jobs:nightly-report")
            expect(page.locator("tr", has_text="jobs:cleanup").locator(".pg-lease-state")).to_have_text("lapsed")
            expect(page.locator("tr", has_text="reports:weekly").locator(".pg-lease-state")).to_have_text("free")
            page.screenshot(path=str(list_png), full_page=True)

            page.locator("tr", has_text="jobs:nightly-report").locator("input.action-select").check()
            page.select_option("select[name=action]", "force_release")
            page.click("button[name=index]")

            expect(page.locator("#pg-lease-force-release")).to_contain_text("worker-7@host-b")
            page.screenshot(path=str(confirm_png), full_page=True)
            page.click("input[type=submit][value^='Yes, force-release']")

            expect(page.locator("ul.messagelist")).to_contain_text("Force-released 1 lease: 'jobs:nightly-report'")
            expect(page.locator("tr", has_text="jobs:nightly-report").locator(".pg-lease-state")).to_have_text("free")
            page.screenshot(path=str(done_png), full_page=True)

            page.click("text=jobs:hourly-sync")
            expect(page.locator(".field-usage")).to_contain_text('Lease.objects.acquire("jobs:hourly-sync"')
            page.screenshot(path=str(detail_png), full_page=True)
        finally:
            browser.close()

    for png in (list_png, confirm_png, done_png, detail_png):
        assert png.read_bytes().startswith(b"\x89PNG"), png
        keep(png)
    state = Lease.objects.inspect(stuck.key)
    assert (state.status, state.epoch) == ("free", stuck.epoch + 1)
    assert Lease.objects.inspect(other.key).status == "held"
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.user.username) == (stuck.key, "ops")


def test_a_fenced_model_in_a_real_browser(server: Any, tmp_path: Path) -> None:
    """Add, change and delete an Invoice (a FencedModel under FencedModelAdmin) through Chromium."""
    from playwright.sync_api import expect, sync_playwright

    from devkit.testapp.models import Invoice
    from pg_lease_django.admin import UNFENCED_NOTE

    User.objects.create_superuser("ops", password="correct horse battery staple")
    shot = tmp_path / "admin-fenced-invoice.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(f"{server.url}/admin/login/?next=/admin/testapp/invoice/add/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "correct horse battery staple")
            page.click("input[type=submit]")

            page.fill("#id_account", "acme")
            page.fill("#id_status", "draft")
            page.fill("#id_amount", "12")
            page.click("input[name=_continue]")
            expect(page.locator("ul.messagelist")).to_contain_text("was added successfully")
            page.fill("#id_status", "sent")
            page.click("input[name=_save]")
            expect(page.locator("#result_list")).to_contain_text("sent")
            page.screenshot(path=str(shot), full_page=True)

            page.locator("tr", has_text="acme").locator("input.action-select").check()
            page.select_option("select[name=action]", "delete_selected")
            page.click("button[name=index]")
            page.click("input[type=submit]")
            expect(page.locator("ul.messagelist")).to_contain_text("Successfully deleted 1")
        finally:
            browser.close()

    assert shot.read_bytes().startswith(b"\x89PNG")
    keep(shot)
    assert not Invoice.objects.filter(account="acme").exists()
    assert [entry.action_flag for entry in LogEntry.objects.order_by("pk")] == [1, 2, 3]
    assert all(UNFENCED_NOTE in entry.get_change_message() for entry in LogEntry.objects.all())


def test_the_lease_changelist_fits_1280_px(server: Any, tmp_path: Path) -> None:
    """At 1280 px, with the nav and filter sidebars, no column is cut (the table does not scroll)."""
    from playwright.sync_api import sync_playwright

    User.objects.create_superuser("ops", password="correct horse battery staple")
    for n in range(3):
        Lease.objects.acquire(f"jobs:nightly-report-{n}", f"worker-{n}@host-b.example.internal:12345:9f8e7d6c", ttl=600)
    shot = tmp_path / "admin-lease-list-1280.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 600})
            page.goto(f"{server.url}/admin/login/?next=/admin/pg_lease_django/lease/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "correct horse battery staple")
            page.click("input[type=submit]")
            page.wait_for_selector("#result_list")
            page.screenshot(path=str(shot), full_page=True)
            overflow = page.evaluate(
                "(() => { const r = document.querySelector('#changelist .results');"
                " return r.scrollWidth - r.clientWidth; })()"
            )
            header = page.locator("#result_list thead th", has_text="acquired at").bounding_box()
            results = page.locator("#changelist .results").bounding_box()
        finally:
            browser.close()
    keep(shot)
    assert overflow <= 0, f"the changelist scrolls sideways by {overflow}px at 1280 px"
    assert header is not None and results is not None
    assert header["x"] + header["width"] <= results["x"] + results["width"] + 1
