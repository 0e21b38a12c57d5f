"""A newcomer's first hour: docs/installation.md then docs/quickstart.md, literally, in a new project.

``django-admin startproject mysite`` and ``startapp billing`` in a temporary directory; the
settings edited as the installation page says, on a database of the test's own (created and
dropped here, on the suite's server: ``DATABASE_URL``, or the embedded server whose URL the suite
exports to its children); then every command and sample of the two pages, taken from the pages
themselves, in subprocesses: ``migrate pg_lease_django``, the installation's shell check, the
quickstart's ``Invoice`` model as ``billing/models.py``, ``makemigrations`` and ``migrate``, the
quickstart's python blocks in one ``manage.py shell``, its ``manage.py leases`` commands, and a
clean ``manage.py check``. Then the rest of the first hour, in the same kind of project: the admin
of docs/fencing.md driven in Chromium (add, change, delete an Invoice), docs/async.md's views under
uvicorn with concurrent requests, and docs/testing.md's runner setting and test module (a
``TestCase``, a ``TransactionTestCase``, a ``LiveServerTestCase``) under ``manage.py test``. Any
error the pages do not predict fails the test. And the first hour's rough edges (issue 28, items
1-5), met as a newcomer meets them: ``manage.py leases`` and ``check`` before ``migrate``, SQLite from
``manage.py shell``, a ``TransactionTestCase`` and ``flush`` without ``TEST_RUNNER``, a SIGTERM to a
management command's ``@leased`` job, and a changed ``PG_LEASE_HISTORY``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import psycopg
import pytest

from devkit import dbserver
from devkit.dbserver import free_port
from tests.acceptance.test_docs import python_blocks
from tests.helpers import checks_said

# No xdist group: the generated projects make no roles, and read `check` through checks_said, which
# leaves out what the cluster-wide checks say of other tests' roles (and of a parameter granted to
# PUBLIC). In the group that serialises the tests that make roles, their minutes ran on one worker.
pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
INSTALLATION = REPO / "docs" / "installation.md"
QUICKSTART = REPO / "docs" / "quickstart.md"

BEHIND_PGBOUNCER = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))

_SH_FENCE = re.compile(r"^```(?:sh|bash|shell|console)\s*$")


# ---- the pages ----------------------------------------------------------------------------------


def manage_commands(page: Path) -> list[list[str]]:
    """The ``python manage.py ...`` lines of the page's ```sh blocks, in order, comments removed."""
    commands: list[list[str]] = []
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if not inside:
            inside = bool(_SH_FENCE.match(line.strip()))
            continue
        if line.strip().startswith("```"):
            inside = False
            continue
        words = shlex.split(line, comments=True)
        if words[:2] == ["python", "manage.py"]:
            commands.append(words)
    return commands


def section(page: Path, heading: str) -> tuple[int, int]:
    """The 1-based line range ``[start, end)`` of the ``## `` section whose heading starts with ``heading``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    starts = [i + 1 for i, line in enumerate(lines) if line.startswith(f"## {heading}")]
    assert len(starts) == 1, f"{page.name} should have one section '## {heading}...'"
    ends = [i + 1 for i, line in enumerate(lines) if line.startswith("## ") and i + 1 > starts[0]]
    return starts[0], ends[0] if ends else len(lines) + 1


def quickstart_model() -> str:
    """The ``models.py`` block of the quickstart's section 3, verbatim."""
    start, end = section(QUICKSTART, "3.")
    found = [
        block.source
        for block in python_blocks(QUICKSTART)
        if start < block.line < end and "class Invoice(FencedModel)" in block.source
    ]
    assert len(found) == 1, "docs/quickstart.md section 3 should have one block defining class Invoice(FencedModel)"
    return found[0]


def runnable_blocks(page: Path) -> str:
    """The page's python blocks that the docs test runs (not marked skip), joined in order."""
    return "\n".join(block.source for block in python_blocks(page) if block.skipped_because() is None)


# ---- the project and its database ---------------------------------------------------------------


def admin_conninfo() -> str:
    """The server's ``postgres`` database, for CREATE/DROP DATABASE: directly, not through a pooler."""
    direct = os.environ.get("DIRECT_DATABASE_URL")
    settings = dbserver.database_settings(direct) if direct else dbserver.database_settings()
    return dbserver.conninfo(settings, dbname="postgres")


@pytest.fixture
def db_name() -> Iterator[str]:
    """A database of this test's own, created empty, dropped afterwards."""
    name = f"{dbserver.database_settings()['NAME'][:30]}_newcomer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    with psycopg.connect(admin_conninfo(), autocommit=True) as conn:
        for database in (f"test_{name}", name):  # manage.py test makes the first
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``cwd``, as a newcomer's terminal would: no settings module of the suite's."""
    environ = {**os.environ}
    for name in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS", "PYTHONSTARTUP"):
        environ.pop(name, None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a command that must have succeeded."""
    assert done.returncode == 0, f"{shlex.join(done.args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


def printed(stdout: str) -> list[str]:
    """The lines a shell's code printed: without the blank lines and the notice of Django's automatic
    imports (``N objects imported automatically``, Django 5.2+)."""
    return [line for line in stdout.splitlines() if line.strip() and "imported automatically" not in line]


def edit_settings(path: Path, db_name: str) -> None:
    """What docs/installation.md says: add the app (and ours) to INSTALLED_APPS, point DATABASES at PostgreSQL."""
    text = path.read_text(encoding="utf-8")
    text, added = re.subn(
        r"^(INSTALLED_APPS = \[\n(?:    .*\n)*)\]\n",
        r'\1    "pg_lease_django",\n    "billing",\n]\n',
        text,
        flags=re.MULTILINE,
    )
    assert added == 1, "startproject's settings.py has no INSTALLED_APPS list as expected"
    database = {**dbserver.database_settings(), "NAME": db_name}
    text, replaced = re.subn(
        r"^DATABASES = \{\n.*?^\}\n", lambda _: f"DATABASES = {{'default': {database!r}}}\n", text, flags=re.M | re.S
    )
    assert replaced == 1, "startproject's settings.py has no DATABASES dict as expected"
    if BEHIND_PGBOUNCER:  # as the installation page says for transaction pooling
        text += "\nPG_LEASE_LISTEN = False\n"
    path.write_text(text, encoding="utf-8")


# ---- the newcomer -------------------------------------------------------------------------------


def new_project(tmp_path: Path, db_name: str) -> Path:
    """startproject and startapp, then docs/installation.md and the quickstart's model, migrated."""
    ok(run(tmp_path, "-m", "django", "startproject", "mysite"))
    root = tmp_path / "mysite"
    ok(run(root, "manage.py", "startapp", "billing"))
    edit_settings(root / "mysite" / "settings.py", db_name)

    # docs/installation.md: migrate, then the first call from manage.py shell.
    migrate = manage_commands(INSTALLATION)
    assert migrate == [["python", "manage.py", "migrate", "pg_lease_django"]], migrate
    for command in migrate:
        ok(run(root, *command[1:]))
    checked = printed(ok(run(root, "manage.py", "shell", "-c", runnable_blocks(INSTALLATION))))
    assert len(checked) == 1 and checked[0].startswith("free 0 "), checked

    # docs/quickstart.md section 3: the model in the app, makemigrations and migrate.
    (root / "billing" / "models.py").write_text(quickstart_model(), encoding="utf-8")
    ok(run(root, "manage.py", "makemigrations"))
    assert (root / "billing" / "migrations" / "0001_initial.py").exists()
    ok(run(root, "manage.py", "migrate"))
    return root


def test_installation_and_quickstart_in_a_new_startproject(tmp_path: Path, db_name: str) -> None:
    root = new_project(tmp_path, db_name)

    # Every python block of the quickstart, in order, in one manage.py shell (which imports Invoice).
    code = runnable_blocks(QUICKSTART)
    lines = printed(ok(run(root, "manage.py", "shell", "-c", code)))
    assert re.fullmatch(r"1 \d{4}-\d\d-\d\d \d\d:\d\d:\d\d.*", lines[0]), lines  # epoch 1, expires_at
    assert lines[1:] == [
        "held worker-1 1",
        "3",
        "processed [1, 2]",
        "processed [3, 4]",
        "sent 42",
        "True",
        "not_owner",
        "1",
    ], lines

    # Section 4, from a shell: see the stuck lease and break it.
    commands = manage_commands(QUICKSTART)
    assert [command[2] for command in commands] == ["leases"] * 3, commands
    listed, shown, released = (ok(run(root, *command[1:])) for command in commands)
    assert "quickstart:stuck" in listed, listed
    assert re.search(r"^state:\s+held$", shown, re.M) and re.search(r"^owner:\s+worker-9$", shown, re.M), shown
    assert re.search(r"^epoch:\s+1$", shown, re.M), shown
    after = ok(run(root, "manage.py", "leases", "show", "quickstart:stuck"))  # broken: free, epoch up
    assert re.search(r"^state:\s+free$", after, re.M) and re.search(r"^epoch:\s+2$", after, re.M), (released, after)

    # And the project is clean for Django's system checks.
    done = run(root, "manage.py", "check")
    assert checks_said(ok(done)) == [], done.stdout
    assert not [line for line in checks_said(done.stdout + done.stderr) if "pg_lease_django" in line], done.stderr


# ---- the rest of the first hour: the admin, an async view, the project's own tests ----------------

FENCING = REPO / "docs" / "fencing.md"
ASYNC = REPO / "docs" / "async.md"
TESTING = REPO / "docs" / "testing.md"

#: The view docs/testing.md's LiveServerTestCase calls (``/bill/<account>/<amount>/``).
BILL_VIEW = """

from django.http import HttpResponse
from pg_lease_django import hold

from .models import Invoice


def bill(request, account, amount):
    with hold(account, ttl=10):
        Invoice(account=account, amount=amount).save()
    return HttpResponse(str(Invoice.objects.filter(account=account).count()))
"""

URLS = """
from billing import views

urlpatterns += [
    path("bill/<str:account>/<int:amount>/", views.bill),
    path("report/rebuild/", views.rebuild_report),
    path("report/status/", views.report_status),
]
"""


def page_file(page: Path, name: str) -> str:
    """The python block of ``page`` that starts with the comment ``# <name>``, verbatim."""
    found = [block.source for block in python_blocks(page) if block.source.startswith(f"# {name}\n")]
    assert len(found) == 1, f"{page.name} should have one block starting with '# {name}'"
    return found[0]


def settings_excerpt(page: Path) -> str:
    """The page's ``# settings.py`` excerpt, to append to the project's settings."""
    return page_file(page, "settings.py")


@contextmanager
def served(root: Path) -> Iterator[str]:
    """The project's ASGI application under uvicorn, as it would be deployed; yields its base URL."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS")}
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "mysite.asgi:application", "--port", str(port), "--log-level", "warning"],
        cwd=root,
        env=environ,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # until it answers (or died)
            assert server.poll() is None, f"uvicorn exited {server.returncode}"
            try:
                with urlopen(f"{base}/admin/login/", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "uvicorn did not answer within 60 s"
                time.sleep(0.1)  # polling a server that is starting: nothing to wait on
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def get_json(url: str) -> dict[str, Any]:
    with urlopen(url, timeout=30) as response:
        return dict(json.loads(response.read()))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="playwright is not installed")
def test_admin_async_views_and_the_projects_own_tests_in_a_new_startproject(tmp_path: Path, db_name: str) -> None:
    from playwright.sync_api import sync_playwright

    from tests.cluster.test_admin_browser import CHROMIUM_ARGS

    root = new_project(tmp_path, db_name)
    app = root / "billing"
    # docs/fencing.md's admin.py; docs/async.md's views (and the view docs/testing.md's tests call);
    # docs/testing.md's runner setting and test module.
    (app / "admin.py").write_text(page_file(FENCING, "billing/admin.py"), encoding="utf-8")
    views = [block.source for block in python_blocks(ASYNC) if "async def rebuild_report" in block.source]
    assert len(views) == 1, "docs/async.md should have one block defining rebuild_report"
    (app / "views.py").write_text(views[0] + BILL_VIEW, encoding="utf-8")
    urls = root / "mysite" / "urls.py"
    urls.write_text(urls.read_text(encoding="utf-8") + URLS, encoding="utf-8")
    settings = root / "mysite" / "settings.py"
    settings.write_text(settings.read_text(encoding="utf-8") + "\n" + settings_excerpt(TESTING), encoding="utf-8")
    (app / "tests.py").write_text(page_file(TESTING, "billing/tests.py"), encoding="utf-8")

    # The project's own tests: a TestCase, a TransactionTestCase (the flush) and a LiveServerTestCase.
    tested = run(root, "manage.py", "test", "billing", "--noinput")
    assert tested.returncode == 0 and "OK" in tested.stderr, tested.stdout + tested.stderr
    assert "Ran 4 tests" in tested.stderr, tested.stderr

    done = run(root, "manage.py", "check")
    assert checks_said(ok(done)) == [], done.stdout + done.stderr
    environ_password = "correct horse battery staple"
    created = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "createsuperuser",
            "--noinput",
            "--username",
            "ops",
            "--email",
            "ops@example.com",
        ],
        cwd=root,
        env={
            **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
            "DJANGO_SUPERUSER_PASSWORD": environ_password,
        },
        capture_output=True,
        text=True,
        timeout=180,
    )
    ok(created)

    with served(root) as base:
        # docs/async.md's views, four requests at once: each waits its turn (no thread held), none fails.
        with ThreadPoolExecutor(max_workers=4) as pool:
            rebuilt = list(pool.map(get_json, [f"{base}/report/rebuild/"] * 4))
        epochs = sorted(reply["epoch"] for reply in rebuilt)
        assert epochs == list(range(epochs[0], epochs[0] + 8, 2)), rebuilt  # one after another; a release is +1
        assert get_json(f"{base}/report/status/") == {"status": "free", "owner": None, "epoch": epochs[-1] + 1}

        # The admin of docs/fencing.md, in Chromium: add, change and delete an Invoice.
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"{base}/admin/login/")
                page.fill("#id_username", "ops")
                page.fill("#id_password", environ_password)
                page.click("input[type=submit]")
                page.goto(f"{base}/admin/billing/invoice/add/")
                page.fill("#id_account", "newcomer-acme")
                page.fill("#id_amount", "120")
                page.click("input[name=_save]")
                page.wait_for_url(f"{base}/admin/billing/invoice/")
                page.click("text=newcomer-acme")
                page.fill("#id_amount", "150")
                page.click("input[name=_save]")
                page.wait_for_url(f"{base}/admin/billing/invoice/")
                assert "150" in page.inner_text("#result_list")
                page.click("text=newcomer-acme")
                page.click("a.deletelink")
                page.click("input[type=submit]")  # "Yes, I'm sure"
                page.wait_for_url(f"{base}/admin/billing/invoice/")
                assert "newcomer-acme" not in page.content()
            finally:
                browser.close()

    report = (
        "from django.contrib.admin.models import LogEntry\n"
        "print(Invoice.objects.filter(account='newcomer-acme').count())\n"
        "for entry in LogEntry.objects.order_by('pk'): print(entry.action_flag, entry.get_change_message())\n"
    )
    lines = printed(ok(run(root, "manage.py", "shell", "-c", report)))
    assert lines[0] == "0", lines
    assert [line[0] for line in lines[1:]] == ["1", "2", "3"], lines  # added, changed, deleted
    assert all("Unfenced write from the admin" in line for line in lines[1:]), lines


# ---- the first hour's rough edges (issue 28, items 1-5), as a newcomer meets them -------------------

#: A test module without TEST_RUNNER: its TransactionTestCase takes a lease, so the flush after it is refused.
UNFLUSHABLE_TESTS = """
from django.test import TransactionTestCase

from pg_lease_django import Lease


class Flushed(TransactionTestCase):
    def test_acquire(self):
        self.assertIsNotNone(Lease.objects.acquire("first-hour:flushed", "me", 30))
"""

SQLITE_SETTINGS = """
from .settings import *  # noqa: F403

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}  # noqa: F405
"""


#: A management command running a @leased job, as a cron line or a Kubernetes CronJob starts one.
NIGHTLY_COMMAND = """
import time

from django.core.management.base import BaseCommand

from pg_lease_django import leased


@leased("billing:nightly", ttl=60)
def nightly():
    print("ready", flush=True)
    time.sleep(120)


class Command(BaseCommand):
    def handle(self, *args, **options):
        nightly()
"""


def stderr_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.strip()]


@pytest.mark.slow  # ~25 s; and its `manage.py test` creates and drops a test database (not through a pooler)
def test_first_hour_rough_edges_in_a_new_startproject(tmp_path: Path, db_name: str) -> None:
    ok(run(tmp_path, "-m", "django", "startproject", "mysite"))
    root = tmp_path / "mysite"
    ok(run(root, "manage.py", "startapp", "billing"))
    settings = root / "mysite" / "settings.py"
    edit_settings(settings, db_name)

    # 1. Before `migrate`: `manage.py leases` says so in one line; plain `check` warns (W007).
    listed = run(root, "manage.py", "leases", "list")
    assert listed.returncode == 1, listed
    assert stderr_lines(listed) == [
        "CommandError: database error: database 'default' has no lease table (pg_lease_django_lease): "
        "run `manage.py migrate pg_lease_django --database default`"
    ], listed.stderr
    pruned = run(root, "manage.py", "leases", "prune-history")  # the ORM's table, not a lease function
    assert pruned.returncode == 1, pruned
    assert stderr_lines(pruned) == [
        'CommandError: database error: relation "pg_lease_django_tenure" does not exist; '
        "run `manage.py migrate pg_lease_django --database default`"
    ], pruned.stderr
    campaign = run(root, "manage.py", "leases", "run", "nightly", "--ttl", "5", "--campaign", "--", "true")
    assert campaign.returncode == 1, campaign  # it campaigned, failing, until stopped
    assert stderr_lines(campaign) == stderr_lines(listed), campaign.stderr
    checked = run(root, "manage.py", "check")
    assert checked.returncode == 0, checked  # a warning, not an error
    assert "(pg_lease_django.W007) database 'default' holds no lease tables" in checked.stderr, checked.stderr
    assert "HINT: Run: manage.py migrate pg_lease_django --database default" in checked.stderr, checked.stderr
    ok(run(root, "manage.py", "migrate"))
    done = run(root, "manage.py", "check")
    assert not [line for line in checks_said(ok(done) + done.stderr) if "pg_lease_django" in line], done.stderr

    # 2. SQLite as the database, from `manage.py shell` (no checks run): E001's words, no syntax error.
    (root / "mysite" / "settings_sqlite.py").write_text(SQLITE_SETTINGS, encoding="utf-8")
    acquire = "from pg_lease_django import Lease; Lease.objects.acquire('first-hour', 'me', 30)"
    shell = run(root, "manage.py", "shell", "--settings", "mysite.settings_sqlite", "-c", acquire)
    assert shell.returncode != 0, shell
    assert "django.core.exceptions.ImproperlyConfigured: leases need PostgreSQL, but database 'default' is sqlite" in (
        shell.stderr
    ), shell.stderr
    assert "pg_lease_django.E001" in shell.stderr and "syntax error" not in shell.stderr, shell.stderr

    # 3. A TransactionTestCase without TEST_RUNNER: the refusal names the runner and the plugin; so does
    #    `manage.py flush`. With the runner, the same test passes.
    (root / "billing" / "tests.py").write_text(UNFLUSHABLE_TESTS, encoding="utf-8")
    tested = run(root, "manage.py", "test", "billing", "--noinput")
    assert tested.returncode != 0, tested.stdout + tested.stderr
    assert "pg_lease_django refused the TRUNCATE" in tested.stderr, tested.stderr
    assert 'TEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner"' in tested.stderr, tested.stderr
    flushed = run(root, "manage.py", "flush", "--noinput")
    assert flushed.returncode == 1, flushed
    assert f"CommandError: Database {db_name} couldn't be flushed: pg_lease_django refused the TRUNCATE" in (
        flushed.stderr
    ), flushed.stderr
    assert "pytest-django" in flushed.stderr, flushed.stderr
    text = settings.read_text(encoding="utf-8")
    settings.write_text(text + '\nTEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner"\n', encoding="utf-8")
    tested = run(root, "manage.py", "test", "billing", "--noinput")
    assert tested.returncode == 0 and "Ran 1 test" in tested.stderr, tested.stdout + tested.stderr

    # 5. PG_LEASE_HISTORY changed: plain `check` warns (W005); `migrate` says what it changed.
    settings.write_text(settings.read_text(encoding="utf-8") + '\nPG_LEASE_HISTORY = ["billing:"]\n', encoding="utf-8")
    checked = run(root, "manage.py", "check")
    assert "(pg_lease_django.W005)" in checked.stderr and "['billing:']" in checked.stderr, checked.stderr
    migrated = ok(run(root, "manage.py", "migrate"))
    assert "No migrations to apply" in migrated, migrated
    assert "pg_lease_django: database 'default' now records the lease history of keys starting with ['billing:']" in (
        migrated
    ), migrated
    done = run(root, "manage.py", "check")
    assert not [line for line in checks_said(ok(done) + done.stderr) if "pg_lease_django" in line], done.stderr
    assert "now records" not in ok(run(root, "manage.py", "migrate")), "a second migrate changes nothing"

    # 4. A deploy stops a management command running a @leased job with SIGTERM: the lease is released
    #    (epoch 1 -> 2, free), not left held for its TTL, and the command still ends by SIGTERM.
    commands = root / "billing" / "management" / "commands"
    commands.mkdir(parents=True)
    (commands.parent / "__init__.py").write_text("", encoding="utf-8")
    (commands / "__init__.py").write_text("", encoding="utf-8")
    (commands / "nightly.py").write_text(NIGHTLY_COMMAND, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS")}
    job = subprocess.Popen(
        [sys.executable, "manage.py", "nightly"],
        cwd=root,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        shown = ok(run(root, "manage.py", "leases", "show", "billing:nightly"))
        assert re.search(r"^state:\s+held$", shown, re.M) and re.search(r"^epoch:\s+1$", shown, re.M), shown
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == -signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    shown = ok(run(root, "manage.py", "leases", "show", "billing:nightly"))
    assert re.search(r"^state:\s+free$", shown, re.M) and re.search(r"^epoch:\s+2$", shown, re.M), shown
