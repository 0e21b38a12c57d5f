"""The COMMAND of tests/db/test_command_run.py: reports what ``leases run`` gave it, one JSON line each.

    python -m tests.children.run_child MODE [ARG]

Lines go to stdout (inherited from ``leases run``), flushed at once. Modes:

- ``env CODE``: report ``PG_LEASE_KEY``/``PG_LEASE_OWNER``/``PG_LEASE_EPOCH``, then exit with CODE.
- ``touch PATH``: create PATH (proof that the command ran) and exit 0.
- ``signals``: report ``ready``, then every SIGUSR1, SIGUSR2, SIGHUP and SIGINT as it arrives; on
  SIGTERM report it and die of it (so the exit status is 128 + 15).
- ``background FIFO``: start a background child (in COMMAND's process group) that reports
  ``ready`` and exits once FIFO is opened for writing and closed; report ``exiting`` and exit 0 at
  once, as a shell script whose last line is ``cmd &`` does.
- ``stubborn``: start a grandchild that ignores SIGTERM, report ``ready`` once it runs, then ignore
  SIGTERM too (reporting when it came) and run until killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

_GRANDCHILD = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    signal.pause()\n"
)


def emit(event: str, **fields: Any) -> None:
    """One ``os.write`` per line: a signal handler's line (two SIGTERMs, the platform's and the one
    ``leases run`` passes on, can land in one another's handler) never splits another line in two,
    as ``print``'s separate writes of the text and its newline would."""
    os.write(sys.stdout.fileno(), (json.dumps({"event": event, **fields}) + "\n").encode())


def _ready() -> None:
    emit("ready", pid=os.getpid(), pgid=os.getpgrp())


def main() -> None:
    mode, *rest = sys.argv[1:]
    if mode == "env":
        emit("env", **{name: os.environ.get(name) for name in ("PG_LEASE_KEY", "PG_LEASE_OWNER", "PG_LEASE_EPOCH")})
        raise SystemExit(int(rest[0]))
    if mode == "touch":
        with open(rest[0], "w"):
            pass
        return
    if mode == "signals":

        def report(signum: int, frame: FrameType | None) -> None:
            emit("signal", name=signal.Signals(signum).name)
            if signum == signal.SIGTERM:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, report)
        _ready()
        while True:
            signal.pause()
    if mode == "background":
        lingering = (
            "import json, os, sys\n"
            "print(json.dumps({'event': 'ready', 'pid': os.getpid()}), flush=True)\n"
            "open(sys.argv[1]).read()\n"  # blocks until the test opens the FIFO for writing and closes it
        )
        subprocess.Popen([sys.executable, "-c", lingering, rest[0]])
        emit("exiting", pid=os.getpid())
        return
    if mode == "stubborn":

        def ignore(signum: int, frame: FrameType | None) -> None:
            emit("ignored", name=signal.Signals(signum).name, at=time.monotonic())

        signal.signal(signal.SIGTERM, ignore)
        grandchild = subprocess.Popen([sys.executable, "-c", _GRANDCHILD], stdout=subprocess.PIPE, text=True)
        assert grandchild.stdout is not None
        assert grandchild.stdout.readline().strip() == "ready"  # it ignores SIGTERM from here on
        emit("ready", pid=os.getpid(), pgid=os.getpgrp(), grandchild=grandchild.pid)
        while True:
            signal.pause()
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
