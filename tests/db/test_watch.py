"""``manage.py leases watch``: one frame as JSON, renewals seen between frames, and the live view in a real
terminal (a pty) stopped by Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import override_settings

from pg_lease_django import Lease
from pg_lease_django.management.leases.live_view import Watcher
from pg_lease_django.provisioning.history import sync_scope
from tests.helpers import held, lapsed, url_of_test_database

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix() -> str:
    return f"w{uuid.uuid4().hex[:12]}:"


def test_once_json_shows_each_state_time_left_and_the_recent_transitions(prefix: str) -> None:
    with override_settings(PG_LEASE_HISTORY=[prefix]):
        sync_scope()
        try:
            held(f"{prefix}a-held", "w1", ttl=60)
            lapsed(f"{prefix}b-lapsed", "w2")
            epoch = held(f"{prefix}c-free", "w3")
            Lease.objects.release(f"{prefix}c-free", "w3", epoch)
            held("elsewhere-" + prefix, "w4")  # not matched
            out = io.StringIO()
            call_command("leases", "watch", "--prefix", prefix, "--once", "--json", stdout=out)
        finally:
            with override_settings(PG_LEASE_HISTORY=[]):
                sync_scope()
    document = json.loads(out.getvalue())
    assert document["count"] == 3
    by_key = {lease["key"]: lease for lease in document["leases"]}
    assert [by_key[f"{prefix}{k}"]["state"] for k in ("a-held", "b-lapsed", "c-free")] == ["held", "lapsed", "free"]
    assert by_key[f"{prefix}a-held"]["owner"] == "w1"
    assert 0 < by_key[f"{prefix}a-held"]["expires_in_seconds"] <= 60  # server clock: ttl minus time passed
    assert by_key[f"{prefix}b-lapsed"]["expires_in_seconds"] < 0
    assert by_key[f"{prefix}a-held"]["renewed_seconds_ago"] is None  # one frame sees no renewal
    events = [(t["key"], t["event"]) for t in document["transitions"]]
    assert (f"{prefix}c-free", "released") in events
    assert sum(event == "granted" for _key, event in events) == 3
    assert document["transitions"] == sorted(document["transitions"], key=lambda t: t["at"], reverse=True)


def test_a_glob_selects_and_the_plain_frame_names_every_lease(prefix: str) -> None:
    held(f"{prefix}job-1", "w1")
    held(f"{prefix}job-22", "w1")
    held(f"{prefix}other", "w1")
    out = io.StringIO()
    call_command("leases", "watch", "--glob", f"{prefix}job-?", "--once", stdout=out)
    text = out.getvalue()
    assert f"{prefix}job-1 " in text and f"{prefix}job-22" not in text and f"{prefix}other" not in text
    assert text.startswith("1 lease matching glob")


def test_a_renewal_between_two_frames_is_seen_and_dated_by_the_server(prefix: str) -> None:
    key = f"{prefix}renewed"
    epoch = held(key, "w1", ttl=60)
    watcher = Watcher("default", prefix=prefix, transitions=0)
    first = watcher.read()
    assert first.renewed_ago == {key: None}
    Lease.objects.renew(key, "w1", epoch, ttl=60)
    second = watcher.read()
    renewed = second.renewed_ago[key]
    assert renewed is not None and renewed >= 0
    third = watcher.read().renewed_ago[key]  # no renewal since: the same instant, further in the past
    assert third is not None and third >= renewed
    # A grant that appears between two frames counts from its acquired_at.
    held(f"{prefix}new", "w2", ttl=60)
    assert watcher.read().renewed_ago[f"{prefix}new"] is not None


def _read_until(fd: int, needle: bytes, seen: bytearray, guard: float = 60.0) -> None:
    """Read the pty until ``needle`` appears (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + guard
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no {needle!r} from the watch within {guard}s; got {bytes(seen[-2000:])!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                pytest.fail(f"the watch ended before {needle!r}; got {bytes(seen[-2000:])!r}")
            seen.extend(chunk)


def _read_to_end(fd: int, seen: bytearray, guard: float = 60.0) -> None:
    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        seen.extend(chunk)
    pytest.fail("the watch did not end after Ctrl-C")


@pytest.mark.slow
@pytest.mark.parametrize("view", ["rich", "plain"])
def test_the_live_view_refreshes_in_a_terminal_and_ctrl_c_ends_it_cleanly(prefix: str, view: str) -> None:
    key = f"{prefix}live"
    epoch = held(key, "w1", ttl=60)
    env = {
        **os.environ,
        "DATABASE_URL": url_of_test_database(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TERM": "xterm-256color",
        "COLUMNS": "200",
        "LINES": "50",
    }
    argv = [sys.executable, "-m", "django", "leases", "watch", "--prefix", prefix, "--interval", "0.2"]
    if view == "plain":
        argv.append("--plain")
    pid, fd = pty.fork()  # the child gets the pty as its controlling terminal: Ctrl-C reaches it as in a shell
    if pid == 0:  # pragma: no cover (the child)
        # As from an interactive shell: a suite started in the background inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(REPO)
        os.execve(sys.executable, argv, env)
    seen = bytearray()
    try:
        _read_until(fd, key.encode(), seen)
        # A renewal after the first frame: a later frame shows it as seen ("... ago" in RENEWED).
        Lease.objects.renew(key, "w1", epoch, ttl=60)
        _read_until(fd, b"s ago", seen)
        os.write(fd, b"\x03")  # Ctrl-C, through the terminal's line discipline: SIGINT to the foreground group
        _read_to_end(fd, seen)
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    text = bytes(seen).decode(errors="replace")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, text[-2000:]
    assert "Traceback" not in text
    assert "stopped" in text
    assert "Ctrl-C to stop." in text
    if view == "plain":
        assert "\x1b[H\x1b[2J" in text  # redrawn in place
