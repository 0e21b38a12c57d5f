"""A SIGTERM (every deploy's stop) to a process holding a lease in its main thread (issue 28, item 4).

With SIGTERM at Python's default, a sync ``hold()``, a ``@leased`` job and ``with elect()`` release
the lease, then the process still ends by SIGTERM; a program's own handler is left alone, and
``PG_LEASE_RELEASE_ON_SIGTERM = False`` leaves the lease to lapse as before. Each child is a real
process (tests/children/sigterm_child.py) on the test database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pg_lease_django import Lease
from tests.helpers import url_of_test_database

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.django_db(transaction=True)


def start(mode: str, key: str) -> subprocess.Popen[str]:
    environ = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.children.sigterm_child", mode, key],
        cwd=REPO,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # blocks until it holds (or died)
    if line != "ready\n":
        child.kill()
        child.wait(30)
        pytest.fail(f"child {mode} said {line!r} instead of ready (exit {child.returncode})")
    return child


def terminate(child: subprocess.Popen[str]) -> tuple[int, str]:
    child.send_signal(signal.SIGTERM)
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    return child.returncode, out


@pytest.mark.parametrize("mode", ["hold", "leased", "elect"])
def test_sigterm_releases_the_lease_then_ends_the_process_by_sigterm(mode: str, key: str) -> None:
    child = start(mode, key)
    held = Lease.objects.inspect(key)
    assert (held.status, held.epoch) == ("held", 1)
    code, _ = terminate(child)
    assert code == -signal.SIGTERM  # as without the package: killed by the signal, not an exit status
    after = Lease.objects.inspect(key)
    assert (after.status, after.epoch) == ("free", 2), after  # released, not left to lapse


def test_with_the_setting_off_a_sigterm_leaves_the_lease_to_lapse(key: str) -> None:
    code, _ = terminate(start("off", key))
    assert code == -signal.SIGTERM
    after = Lease.objects.inspect(key)
    assert (after.status, after.epoch) == ("held", 1), after


def test_a_programs_own_sigterm_handler_is_left_alone(key: str) -> None:
    code, out = terminate(start("mine", key))
    assert (code, out.splitlines()) == (0, ["mine", "still mine"])
    after = Lease.objects.inspect(key)
    assert (after.status, after.epoch) == ("free", 2), after  # its own handler ended the hold
