"""`Supervisor` driven directly, without ``call_command``: a real child process, busy, a lost lease; `ExitCode`.

The child is tests/children/run_child.py, which reports on its stdout (inherited: pytest's captured fd 1)
what it was given and which signals reached it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management.base import OutputWrapper
from django.db import connections

from pg_lease_django import Lease
from pg_lease_django.management.commands.leases import Command
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.supervision.child_process import Child
from pg_lease_django.management.supervision.status_line import StatusLine
from pg_lease_django.management.supervision.supervisor import RunError, Supervisor
from pg_lease_django.operations import LeaseState
from pg_lease_django.status import LeaseStatus
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, str(REPO / "tests" / "children" / "run_child.py")]
NAME = os.path.basename(sys.executable)  # how the supervisor names COMMAND in its messages


def events(capfd: pytest.CaptureFixture[str], name: str) -> list[dict[str, Any]]:
    """The child's JSON lines named ``name``, from the captured stdout."""
    out, _err = capfd.readouterr()
    return [event for line in out.splitlines() if line.startswith("{") and (event := json.loads(line))["event"] == name]


def test_runs_the_child_with_the_lease_and_returns_its_status(key: str, capfd: pytest.CaptureFixture[str]) -> None:
    stderr = StringIO()
    supervisor = Supervisor(
        key, [*CHILD, "env", "3"], ttl=5, owner="direct-1", verbosity=2, stderr=OutputWrapper(stderr)
    )
    assert supervisor.run() == 3
    (env,) = events(capfd, "env")
    assert (env["PG_LEASE_KEY"], env["PG_LEASE_OWNER"]) == (key, "direct-1")
    epoch = int(env["PG_LEASE_EPOCH"])
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == (LeaseStatus.FREE, epoch + 1)  # released its own epoch at the end
    assert stderr.getvalue().splitlines() == [
        f"leases run: acquired {key!r} as 'direct-1' at epoch {epoch}; running {NAME}",
        f"leases run: released {key!r} (epoch {epoch}); {NAME} exited with status 3",
    ]


def test_a_busy_key_raises_busy_without_running_the_child(key: str, tmp_path: Path) -> None:
    grant = Lease.objects.acquire(key, "holder-1", ttl=30)
    assert grant is not None
    marker = tmp_path / "ran"
    with pytest.raises(RunError) as caught:
        Supervisor(key, [*CHILD, "touch", str(marker)], ttl=5).run()
    assert caught.value.exit_code == ExitCode.BUSY.value == 75
    assert str(caught.value).startswith(f"lease {key!r} is held by 'holder-1' (epoch {grant.epoch}, expires in ")
    assert not marker.exists()
    assert Lease.objects.inspect(key).owner == "holder-1"


def test_a_lost_lease_terminates_the_child(key: str, capfd: pytest.CaptureFixture[str]) -> None:
    out: list[str] = []  # the child's stdout, read while it runs

    def child_ready() -> bool:
        out.append(capfd.readouterr().out)
        return '"event": "ready"' in "".join(out)

    def force_release_once_ready() -> None:
        # Once the child reports ready its SIGTERM handler is installed: released sooner, the child
        # could die of the SIGTERM before it reports it (a loaded machine starts Python slowly).
        try:
            wait_until(child_ready, timeout=60, what="the child to be ready")
            Lease.objects.force_release(key)
        finally:
            connections.close_all()  # this thread's

    breaker = threading.Thread(target=force_release_once_ready)
    breaker.start()
    stderr = StringIO()
    with pytest.raises(RunError) as caught:
        Supervisor(key, [*CHILD, "signals"], ttl=1.5, grace=5, stderr=OutputWrapper(stderr)).run()
    breaker.join(10)
    assert caught.value.exit_code == ExitCode.LOST.value == 76
    epoch = Lease.objects.inspect(key).epoch - 1  # the forced release's bump: nothing was sent after it
    assert str(caught.value) == (
        f"lease {key!r} (epoch {epoch}) was lost while {NAME} ran (not_owner): "
        f"sent {NAME} SIGTERM; it was killed by SIGTERM"
    )
    out.append(capfd.readouterr().out)
    signals = [
        e["name"]
        for line in "".join(out).splitlines()
        if line.startswith("{") and (e := json.loads(line))["event"] == "signal"
    ]
    assert signals == ["SIGTERM"]
    assert f"leases run: lease {key!r} lost (not_owner): sending SIGTERM to {NAME}" in stderr.getvalue()


def test_exit_codes_are_written_once() -> None:
    """The help, the docstring and run's description come from ExitCode; operations.md lists every code."""
    parser = Command().create_parser("manage.py", "leases")
    subcommands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    run_help = subcommands.choices["run"].format_help()
    operations = (REPO / "docs" / "operations.md").read_text()
    doc = sys.modules[Command.__module__].__doc__ or ""
    for code in ExitCode:
        assert f"{code.value} {code.label}" in Command.help
        assert re.search(rf"^{code.value} +{re.escape(code.meaning.split()[0])}", doc, flags=re.M), code
        assert re.search(rf"^\| (?:\d+, )*{code.value}(?:, \d+)* \|", operations, flags=re.M), code
        if code >= ExitCode.BUSY:
            assert f"{code.value} {code.label}" in " ".join(run_help.split())


#: Text a terminal would act on: an escape sequence (clear the screen), a bell and a bidi override.
HOSTILE = "\x1b[2J\x07\u202e"
SHOWN = "\\x1b[2J\\x07\\u202e"


def test_keys_owners_and_command_names_are_shown_escaped(key: str, tmp_path: Path) -> None:
    """Others choose owners and COMMAND (a shared script's name): ``leases run`` prints them through
    `printable`, never raw, in its messages and in its errors. (A new key or owner with such
    characters is refused by acquire; a holder stored before that rule, or by hand, is shown escaped.)"""
    command = tmp_path / f"report{HOSTILE}"
    command.symlink_to(sys.executable)
    stderr = StringIO()
    supervisor = Supervisor(
        key, [str(command), *CHILD[1:], "env", "0"], ttl=5, owner="me", verbosity=2, stderr=OutputWrapper(stderr)
    )
    assert supervisor.run() == 0
    epoch = Lease.objects.inspect(key).epoch - 1
    assert stderr.getvalue().splitlines() == [
        f"leases run: acquired '{key}' as 'me' at epoch {epoch}; running report{SHOWN}",
        f"leases run: released '{key}' (epoch {epoch}); report{SHOWN} exited with status 0",
    ]

    held_key = f"{key}/held"
    with connections["default"].cursor() as cursor:  # a holder whose owner predates the rule
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
            "SELECT %s, %s, f.floor + 1, clock_timestamp(), clock_timestamp() + interval '30 seconds' "
            "FROM pg_lease_django_epoch_floor f",
            [held_key, f"them{HOSTILE}"],
        )
    held = Lease.objects.inspect(held_key)
    with pytest.raises(RunError) as busy:
        Supervisor(held_key, [str(command)], ttl=5).run()
    assert str(busy.value).startswith(f"lease '{held_key}' is held by 'them{SHOWN}' (epoch {held.epoch}, ")
    assert str(busy.value).endswith(f"; report{SHOWN} was not run")

    with pytest.raises(RunError) as missing:
        Supervisor(key, [str(tmp_path / f"gone{HOSTILE}")], ttl=5).run()
    assert str(missing.value) == f"{tmp_path}/gone{SHOWN}: command not found"


def test_the_wait_status_line_shows_the_holder_escaped() -> None:
    now = datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)
    row = LeaseState(
        key=f"k{HOSTILE}",
        status="held",
        owner=f"them{HOSTILE}",
        epoch=3,
        expires_at=now + timedelta(seconds=29),
        server_time=now,
    )
    stderr = StringIO()
    status = StatusLine(row.key, lambda: row, OutputWrapper(stderr), wait=30)
    status.start()
    wait_until(lambda: "waited" in stderr.getvalue(), timeout=30, what="the status line")
    status.stop()
    status.join(10)
    shown = stderr.getvalue()
    assert f"waiting for k{SHOWN} held by them{SHOWN}, expires in 29s" in shown
    assert "\x07" not in shown and "\u202e" not in shown and "\x1b[2J" not in shown


def test_a_childs_grace_runs_from_the_first_sigterm_it_got() -> None:
    """`Child`'s bookkeeping, on its own clock readings: the earliest SIGTERM counts, whoever sent it
    (the supervisor on a loss, or a deploy's passed on), and the SIGKILL is due ``grace`` after it."""
    child = Child(["sleep", "60"], dict(os.environ), grace=2.0)
    try:
        assert child.until_kill(100.0) is None  # no SIGTERM yet: nothing is due
        child.terminated(110.0)
        child.terminated(109.0)  # an earlier one (a deploy's, seen late) moves the deadline forward
        child.terminated(112.0)  # a later one does not move it back
        assert (child.until_kill(110.0), child.until_kill(111.0), child.until_kill(115.0)) == (1.0, 0.0, 0.0)
        child.kill()
        assert child.until_kill(115.0) is None and child.popen.wait(30) == -signal.SIGKILL
    finally:
        child.close()
        if child.popen.poll() is None:
            child.popen.kill()
            child.popen.wait(30)
