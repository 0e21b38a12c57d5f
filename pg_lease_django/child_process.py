"""What ``leases run`` asks of the operating system about COMMAND: how it exited, whether it may
share the terminal, whether its process group still runs anything. No database, no lease."""

from __future__ import annotations

import os
import signal
from contextlib import suppress

__all__ = ["describe_exit", "group_alive", "signal_name", "terminal_foreground"]


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
