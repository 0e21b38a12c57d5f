"""``manage.py leases run KEY --ttl S -- COMMAND``: real ``python -m django leases run`` processes.

The COMMAND is ``python -m tests.children.run_child`` (see there), which reports on stdout what it was given
and which signals reached it. Every wait is on an event (a line from the child, a line on stderr, a
process exit); the only bounds on time are the ones the feature promises.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from io import StringIO
from pathlib import Path
from typing import IO, Any

import pytest
from django.core.management import CommandError, call_command

from devkit.dbserver import REPO
from pg_lease_django import Lease
from pg_lease_django.management.exit_codes import ExitCode
from tests.helpers import ProcessEnd, held, session_members, url_of_test_database

pytestmark = pytest.mark.django_db(transaction=True)

CHILD = [sys.executable, "-m", "tests.children.run_child"]
NAME = os.path.basename(sys.executable)  # how leases run names COMMAND in its messages


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (gone, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


_CONTROLLING_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(2, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
)


class LeasesRun:
    """One ``python -m django leases run ARGS`` process, in a session of its own.

    COMMAND's JSON lines on stdout become ``events``; stderr is collected as text. With
    ``tty=True`` stderr is a pseudo-terminal (so the waiting status line is shown).
    """

    def __init__(
        self,
        *args: str,
        tty: bool = False,
        foreground: bool = False,
        entry: Sequence[str] = ("-m", "django", "leases", "run"),
        environ: dict[str, str] | None = None,
    ) -> None:
        env = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
        env.update(environ or {})
        env["PYTHONUNBUFFERED"] = "1"
        master = slave = -1
        if tty:
            master, slave = pty.openpty()
        self.master = master
        argv = [sys.executable, *entry, *args]
        if foreground:
            # Make the terminal (stderr) the controlling terminal of the new session, with this
            # process group in its foreground, as a shell does; then exec leases run (same pid).
            argv = [sys.executable, "-c", _CONTROLLING_TTY, *argv]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave if tty else subprocess.PIPE,
            start_new_session=True,  # no controlling terminal: COMMAND gets a process group of its own
        )
        self.ended_at: float | None = None
        self.events: list[dict[str, Any]] = []
        self._stderr: list[str] = []
        self._changed = threading.Condition()
        assert self.proc.stdout is not None
        readers = [threading.Thread(target=self._read_events, args=(self.proc.stdout,), daemon=True)]
        if tty:
            os.close(slave)
            readers.append(threading.Thread(target=self._read_pty, args=(master,), daemon=True))
        else:
            assert self.proc.stderr is not None
            readers.append(threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True))
        self._readers = readers
        self.foreground = foreground
        for reader in readers:
            reader.start()

    @property
    def stderr(self) -> str:
        with self._changed:
            return "".join(self._stderr)

    def _read_events(self, stream: IO[bytes]) -> None:
        for line in stream:
            with self._changed:
                self.events.append(json.loads(line))
                self._changed.notify_all()

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            with self._changed:
                self._stderr.append(chunk.decode())
                self._changed.notify_all()

    def _read_pty(self, master: int) -> None:
        try:
            while chunk := os.read(master, 4096):
                with self._changed:
                    self._stderr.append(chunk.decode(errors="replace"))
                    self._changed.notify_all()
        except OSError:
            pass  # EIO: every process holding the terminal has exited
        finally:
            os.close(master)

    def _until(self, predicate: Callable[[], bool], what: str, timeout: float) -> None:
        with self._changed:
            if not self._changed.wait_for(predicate, timeout):
                pytest.fail(f"timed out waiting for {what}; events {self.events}, stderr {''.join(self._stderr)!r}")

    def expect(self, event: str, count: int = 1, timeout: float = 20.0) -> dict[str, Any]:
        """The ``count``-th event named ``event`` (waiting for it)."""

        def matching() -> list[dict[str, Any]]:
            return [e for e in self.events if e["event"] == event]

        self._until(lambda: len(matching()) >= count, f"event {event!r} #{count}", timeout)
        with self._changed:
            return matching()[count - 1]

    def expect_stderr(self, pattern: str, timeout: float = 20.0) -> None:
        self._until(lambda: re.search(pattern, "".join(self._stderr)) is not None, f"stderr {pattern!r}", timeout)

    def finish(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        self.ended_at = time.monotonic()
        for reader in self._readers:
            reader.join(5)
        return code

    def kill(self) -> None:
        for event in self.events:  # COMMAND and its grandchild run in process groups of their own
            for pid in (event.get("pid"), event.get("grandchild")):
                if isinstance(pid, int) and not process_gone(pid):
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@pytest.fixture
def runs() -> Iterator[Callable[..., LeasesRun]]:
    """Start ``leases run`` processes; any left running are killed at the end."""
    started: list[LeasesRun] = []

    def start(*args: str, tty: bool = False, foreground: bool = False) -> LeasesRun:
        run = LeasesRun(*args, tty=tty, foreground=foreground)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


def one_line_error(stderr: str) -> str:
    """The single ``CommandError: ...`` line of stderr (and nothing else, no traceback)."""
    assert "Traceback" not in stderr
    assert stderr.count("\n") == 1 and stderr.startswith("CommandError: "), stderr
    return stderr.removeprefix("CommandError: ").rstrip("\n")


# -- running the command -------------------------------------------------------------------------------


def test_runs_the_command_with_the_lease_in_its_environment_and_exits_with_its_status(
    key: str, runs: Callable[..., LeasesRun]
) -> None:
    run = runs(key, "--ttl", "5", "--owner", "runner-1", "--", *CHILD, "env", "3")
    assert run.finish() == 3
    env = run.expect("env")
    assert (env["PG_LEASE_KEY"], env["PG_LEASE_OWNER"]) == (key, "runner-1")
    epoch = int(env["PG_LEASE_EPOCH"])
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)  # released its own epoch on exit
    assert run.stderr == ""


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_database_option_and_the_default_owner(key: str, runs: Callable[..., LeasesRun]) -> None:
    run = runs(key, "--database", "other", "--ttl", "5", "--", *CHILD, "env", "0")
    assert run.finish() == 0
    env = run.expect("env")
    assert re.fullmatch(r"[^:]+:\d+:[0-9a-f]{8}", env["PG_LEASE_OWNER"])  # host:pid:random
    assert env["PG_LEASE_OWNER"].split(":")[1] == str(run.proc.pid)
    state = Lease.objects.db_manager("other").inspect(key)
    assert (state.status, state.epoch) == ("free", int(env["PG_LEASE_EPOCH"]) + 1)
    assert Lease.objects.inspect(key).epoch == 0  # nothing on the default database


def test_a_command_that_cannot_be_run_exits_127_or_126_and_releases(key: str, runs: Callable[..., LeasesRun]) -> None:
    missing = runs(key, "--ttl", "5", "--", "/nonexistent/command", "arg")
    assert missing.finish() == ExitCode.COMMAND_NOT_FOUND.value == 127
    assert one_line_error(missing.stderr) == "/nonexistent/command: command not found"
    assert Lease.objects.inspect(key).status == "free"
    not_executable = runs(key, "--ttl", "5", "--", str(REPO / "pyproject.toml"))
    assert not_executable.finish() == ExitCode.CANNOT_EXECUTE.value == 126
    assert "cannot execute" in one_line_error(not_executable.stderr)
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", 4)  # acquired and released twice


# -- busy and waiting ----------------------------------------------------------------------------------


def test_a_busy_key_exits_75_without_running_the_command(
    key: str, runs: Callable[..., LeasesRun], tmp_path: Path
) -> None:
    epoch = held(key, "holder-1")
    marker = tmp_path / "ran"
    run = runs(key, "--ttl", "5", "--", *CHILD, "touch", str(marker))
    assert run.finish() == ExitCode.BUSY.value == 75
    message = one_line_error(run.stderr)
    assert message.startswith(f"lease {key!r} is held by 'holder-1' (epoch {epoch}, expires in ")
    assert message.endswith(f"; {NAME} was not run")
    assert not marker.exists()
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "holder-1", epoch)


def test_wait_times_out_with_77_within_its_bound(key: str, runs: Callable[..., LeasesRun], tmp_path: Path) -> None:
    epoch = held(key, "holder-1")
    marker = tmp_path / "ran"
    run = runs(key, "--ttl", "5", "--wait", "1.5", "--", *CHILD, "touch", str(marker))
    assert run.finish() == ExitCode.TIMED_OUT.value == 77
    assert run.ended_at is not None
    elapsed = run.ended_at - run.started_at
    # The wait at least; then a hang guard (Python and Django start in about 0.5 s here, far slower on a
    # loaded machine). Not waiting at all would time out sooner; waiting for the holder would run it.
    assert 1.5 <= elapsed < 1.5 + 30.0
    message = one_line_error(run.stderr)  # not a terminal: no status line
    assert message.startswith(f"timed out after waiting 1.5s: lease {key!r} is held by 'holder-1'")
    assert not marker.exists()
    assert Lease.objects.inspect(key).epoch == epoch


def test_wait_shows_the_holder_on_a_terminal_and_runs_once_it_is_released(
    key: str, runs: Callable[..., LeasesRun]
) -> None:
    epoch = held(key, "holder-w")
    run = runs(key, "--ttl", "5", "--wait", "30", "--", *CHILD, "env", "0", tty=True)
    run.expect_stderr(rf"waiting for {re.escape(key)} held by holder-w, expires in \d+s \(waited [\d.]+s of 30s\)")
    assert not run.events  # still waiting
    Lease.objects.release(key, "holder-w", epoch)
    assert run.finish() == 0
    got = int(run.expect("env")["PG_LEASE_EPOCH"])
    assert got > epoch
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", got + 1)
    status_at = run.stderr.rindex("waiting for")
    assert "\r\x1b[K" in run.stderr[status_at:]  # the status line was erased before COMMAND ran


def test_a_signal_while_waiting_ends_the_wait_without_running_the_command(
    key: str, runs: Callable[..., LeasesRun], tmp_path: Path
) -> None:
    epoch = held(key, "holder-w")
    marker = tmp_path / "ran"
    run = runs(key, "--ttl", "5", "--wait", "30", "--", *CHILD, "touch", str(marker), tty=True)
    run.expect_stderr(rf"waiting for {re.escape(key)} held by holder-w")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM
    assert f"SIGTERM before {NAME} started: not run, lease not held" in run.stderr
    assert not marker.exists()
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "holder-w", epoch)  # no stray grant


# -- losing the lease, signals -------------------------------------------------------------------------


def test_a_command_that_outlives_a_forced_release_is_terminated_then_killed(
    key: str, runs: Callable[..., LeasesRun]
) -> None:
    ttl, grace = 6.0, 0.5  # a loaded machine renews late: a short TTL lapses before the verdict
    interval = ttl / 3  # hold()'s default renew interval: the loss is seen at the next renewal
    run = runs(key, "--ttl", str(ttl), "--grace", str(grace), "--", *CHILD, "stubborn")
    ready = run.expect("ready")
    assert ready["pgid"] == ready["pid"] != run.proc.pid  # a process group of its own
    epoch = Lease.objects.inspect(key).epoch
    released_at = time.monotonic()
    assert Lease.objects.force_release(key) == epoch + 1

    # Ends (finish() waits 30 s: a hang guard) although COMMAND and its grandchild ignore SIGTERM. The
    # loss is the renewal's verdict (not_owner, below), not the lapse of the trust window. How soon
    # (interval + grace + the exit of two Python processes) is a latency: printed, not asserted.
    assert run.finish() == ExitCode.LOST.value == 76
    assert run.ended_at is not None
    print(f"\nended {run.ended_at - released_at:.2f}s after the forced release (interval {interval}s, grace {grace}s)")
    ignored = run.expect("ignored")
    assert ignored["name"] == "SIGTERM"
    assert run.ended_at - ignored["at"] >= grace  # SIGKILL no sooner than the grace period
    assert process_gone(ready["pid"])
    assert process_gone(ready["grandchild"])  # the whole process group, not only COMMAND
    sending = f"lease {key!r} lost (not_owner): sending SIGTERM to {NAME} (pid {ready['pid']}), SIGKILL in 0.5s"
    assert sending in run.stderr
    last = run.stderr.rstrip("\n").splitlines()[-1]
    assert last == (
        f"CommandError: lease {key!r} (epoch {epoch}) was lost while {NAME} ran (not_owner): "
        f"sent {NAME} SIGTERM, then SIGKILL after 0.5s; it was killed by SIGKILL"
    )
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)  # the forced release's: nothing sent after


def test_signals_are_forwarded_to_the_command_and_the_lease_is_released(
    key: str, runs: Callable[..., LeasesRun]
) -> None:
    run = runs(key, "--ttl", "5", "--", *CHILD, "signals")
    run.expect("ready")
    epoch = Lease.objects.inspect(key).epoch
    sent = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1]
    for count, signum in enumerate(sent, start=1):
        os.kill(run.proc.pid, signum)
        assert run.expect("signal", count=count)["name"] == signum.name
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM  # COMMAND died of the SIGTERM: 143, as a shell says
    assert [e["name"] for e in run.events if e["event"] == "signal"] == [s.name for s in sent] + ["SIGTERM"]
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch + 1)
    assert run.stderr == ""


def test_in_the_foreground_of_a_terminal_the_command_shares_it_and_ctrl_c_reaches_it_once(
    key: str, runs: Callable[..., LeasesRun]
) -> None:
    run = runs(key, "--ttl", "5", "--", *CHILD, "signals", tty=True, foreground=True)
    ready = run.expect("ready")
    assert ready["pgid"] == run.proc.pid  # our process group: COMMAND can read the terminal
    os.write(run.master, b"\x03")  # Ctrl-C: the terminal signals its whole foreground group
    assert run.expect("signal")["name"] == "SIGINT"
    os.kill(run.proc.pid, signal.SIGTERM)  # not from the terminal: passed on
    assert run.finish() == 128 + signal.SIGTERM
    assert [e["name"] for e in run.events if e["event"] == "signal"] == ["SIGINT", "SIGTERM"]
    assert Lease.objects.inspect(key).status == "free"


# -- bad arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["", "--ttl", "5", "--", "true"], "key must not be empty"),
        (["k\x00", "--ttl", "5", "--", "true"], "key must not contain NUL characters"),
        (["k", "--", "true"], "--ttl is required: how many seconds each grant lasts"),
        (["k", "--ttl", "abc", "--", "true"], "--ttl must be a number of seconds or a duration such as 30s"),
        (["k", "--ttl", "0", "--", "true"], "--ttl must be between 0.001 and 31536000 seconds, got '0'"),
        (["k", "--ttl", "nan", "--", "true"], "--ttl must be between 0.001 and 31536000 seconds, got 'nan'"),
        (["k", "--ttl", "5", "--wait", "-1", "--", "true"], "--wait must be between 0 and 31536000 seconds"),
        (["k", "--ttl", "5", "--wait", "inf", "--", "true"], "--wait must be between 0 and 31536000 seconds"),
        (["k", "--ttl", "5", "--grace", "x", "--", "true"], "--grace must be a number of seconds or a duration such"),
        (["k", "--ttl", "5", "--owner", "", "--", "true"], "owner must not be empty"),
        (["k", "--ttl", "5"], "missing COMMAND: leases run KEY --ttl SECONDS -- COMMAND [ARGS ...]"),
        (["k", "--ttl", "5", "--"], "missing COMMAND"),
        (["k", "--ttl", "5", "true"], "unexpected argument 'true': COMMAND goes after --"),
        (["k", "--ttl", "5", "--bogus", "--", "true"], "unexpected argument '--bogus'"),
        (["k", "--ttl", "5", "--database", "nope", "--", "true"], "unknown database alias 'nope'"),
        (["k", "--ttl", "5", "--database", "sqlite", "--", "true"], "database 'sqlite' is sqlite, not PostgreSQL"),
    ],
)
def test_bad_arguments_get_a_one_line_error_and_exit_2(args: list[str], message: str) -> None:
    with pytest.raises(CommandError) as caught:
        call_command("leases", "run", *args, stdout=StringIO(), stderr=StringIO())
    assert caught.value.returncode == ExitCode.USAGE
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_bad_arguments_from_a_real_process(key: str, runs: Callable[..., LeasesRun]) -> None:
    for args, message in [
        (["--ttl", "0", "--", "true"], "--ttl must be between"),
        (["--ttl", "5"], "missing COMMAND"),
    ]:
        run = runs(key, *args)
        assert run.finish() == 2
        assert one_line_error(run.stderr).startswith(message)
    assert Lease.objects.inspect(key).epoch == 0  # nothing was acquired


# -- a SIGTERM from the platform (systemd, the kubelet) --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("campaign", [False, True], ids=["run", "campaign"])
@pytest.mark.parametrize("sent_to", ["supervisor", "control-group"])
def test_grace_bounds_a_sigterm_from_the_platform_then_the_lease_is_released(
    key: str, runs: Callable[..., LeasesRun], campaign: bool, sent_to: str
) -> None:
    """A COMMAND (and its child) that ignore SIGTERM: the platform's SIGTERM reaches ``leases run`` alone
    (the kubelet, ``KillMode=mixed``) or every process of the unit (systemd's default ``KillMode=
    control-group``, here every process of the session). COMMAND's group is SIGKILLed ``--grace`` after
    the SIGTERM, never sooner, and the lease is released: with a TTL of 600 s a lease left to lapse
    would still be held when the test ends."""
    grace = 1.5
    options = ["--campaign"] if campaign else []
    run = runs(key, *options, "--ttl", "600", "--grace", str(grace), "-v", "2", "--", *CHILD, "stubborn")
    ready = run.expect("ready")
    leased = Lease.objects.inspect(key)
    assert leased.status == "held"
    deaths = [ProcessEnd(ready["pid"]), ProcessEnd(ready["grandchild"])]
    sent_at = time.monotonic()
    for pid in [run.proc.pid] if sent_to == "supervisor" else session_members(run.proc.pid):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    assert run.finish(timeout=60) == 128 + signal.SIGKILL  # COMMAND's status: killed by SIGKILL
    assert run.expect("ignored")["name"] == "SIGTERM"  # COMMAND got the SIGTERM and kept going
    for death in deaths:
        death.join(30)
        assert death.at is not None
        assert death.at - sent_at >= grace  # SIGKILL no sooner than --grace after the SIGTERM
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", leased.epoch + 1), state  # released, not left to lapse
    assert f"{NAME} (pid {ready['pid']}) still running {grace:g}s after SIGTERM: SIGKILL" in run.stderr
