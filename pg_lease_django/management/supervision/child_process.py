"""What ``leases run`` asks of the operating system about COMMAND: how it exited, whether it may
share the terminal, whether its process group still runs anything; and `Child`, COMMAND's process
with its group and its grace. No database, no lease."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from contextlib import suppress

__all__ = ["Child", "describe_exit", "group_alive", "signal_name", "terminal_foreground"]


def signal_name(signum: int) -> str:
    """``SIGTERM``, or ``signal 64`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``exited with status 3`` / ``was killed by SIGKILL``, from a Popen return code."""
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)}"
    return f"exited with status {returncode}"


def terminal_foreground() -> bool:
    """Whether this process group is the foreground group of the terminal on stdin/stdout/stderr.

    Then COMMAND stays in our process group, so that it can use the terminal, and Ctrl-C reaches
    it straight from the terminal (passing that SIGINT on would deliver it twice).
    """
    for fd in (0, 1, 2):
        with suppress(OSError):
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
    return False


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process that is not a zombie.

    An orphan's zombie waits for whoever reaps orphans (in a container without an init, maybe
    nobody): it runs nothing and must not keep the lease. Read from /proc; elsewhere ``killpg``.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != b"Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


class Child:
    """COMMAND's process, signalled with its process group, and SIGKILLed once its grace has run out.

    COMMAND gets a process group of its own unless this process runs in the foreground of a
    terminal. Then a signal, passed on or sent on a loss, reaches the processes COMMAND started as
    well. In the foreground COMMAND must share our group to read the terminal, as with ``timeout
    --foreground``; there only COMMAND itself is signalled and waited for. Its grace runs from the
    first SIGTERM it got, whoever sent it, as `terminated` records; the caller asks `until_kill`,
    then `kill`.

    Raises:
        OSError: COMMAND could not be started; ``FileNotFoundError`` when it does not exist.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], grace: float) -> None:
        self.own_group = not terminal_foreground()
        self.popen = subprocess.Popen(list(argv), env=env, process_group=0 if self.own_group else None)
        self.pid, self.grace = self.popen.pid, grace
        self.terminated_at: float | None = None  # the first SIGTERM it got, on the monotonic clock
        self.killed = False
        self.pidfd = -1  # readable once COMMAND has exited; none before Linux 5.3 (or elsewhere): poll
        with suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)

    def close(self) -> None:
        """Close the pidfd (idempotent); the process itself is left alone."""
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def signal(self, signum: int) -> None:
        """Send ``signum`` to COMMAND's whole process group when it has one of its own (a shell's children too)."""
        with suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)

    def group_left(self) -> bool:
        """Whether COMMAND's own process group still has a process (COMMAND's background children)."""
        return self.own_group and group_alive(self.pid)

    def terminated(self, at: float) -> None:
        """A SIGTERM reached COMMAND at ``at`` (`time.monotonic`): its grace runs from the first one."""
        if self.terminated_at is None or at < self.terminated_at:
            self.terminated_at = at

    def until_kill(self, now: float) -> float | None:
        """Seconds until the SIGKILL is due (0 once it is), or None: no SIGTERM yet, or already killed."""
        if self.terminated_at is None or self.killed:
            return None
        return max(self.terminated_at + self.grace - now, 0.0)

    def kill(self) -> None:
        """SIGKILL, its grace over."""
        self.killed = True
        self.signal(signal.SIGKILL)
