"""A newcomer's first hour: docs/installation.md then docs/quickstart.md, literally, in a new project.

``django-admin startproject mysite`` and ``startapp billing`` in a temporary directory; the
settings edited as the installation page says, on a database of the test's own (created and
dropped here, on the suite's server: ``DATABASE_URL``, or the embedded server whose URL the suite
exports to its children); then every command and sample of the two pages, taken from the pages
themselves, in subprocesses: ``migrate pg_lease_django``, the installation's shell check, the
quickstart's ``Invoice`` model as ``billing/models.py``, ``makemigrations`` and ``migrate``, the
quickstart's python blocks in one ``manage.py shell``, its ``manage.py leases`` commands, and a
clean ``manage.py check``. Any error the pages do not predict fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests import dbserver
from tests.test_docs import python_blocks

REPO = Path(__file__).resolve().parent.parent
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
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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


def test_installation_and_quickstart_in_a_new_startproject(tmp_path: Path, db_name: str) -> None:
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

    # Every python block of the quickstart, in order, in one manage.py shell.
    code = "from billing.models import Invoice\n" + runnable_blocks(QUICKSTART)
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
    assert "System check identified no issues" in ok(done), done.stdout
    assert "pg_lease_django" not in done.stdout + done.stderr, done.stdout + done.stderr
