"""A worker process for tests/db/test_jobs.py: holds a lease with hold() and reports events as JSON lines.

    python -m tests.children.jobs_worker MODE KEY TTL NAME

``DATABASE_URL`` must point at the test database. Modes:

- ``loop``: hold the lease and write one fenced Entry after another (no fence passed: the hold's
  lease is used), calling ``check()`` before each, until the lease is lost.
- ``takeover``: wait for the lease (blocking), write one Entry, then hold it until stdin closes.
- ``hold``: hold the lease until SIGTERM/SIGINT (``exit_on_signals()``), then exit cleanly.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import django

_output = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, **fields}, default=str)
    with _output:  # the heartbeat thread reports too (lease_lost)
        print(line, flush=True)


def main() -> None:
    mode, key, ttl_text, name = sys.argv[1:5]
    ttl = float(ttl_text)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from devkit.testapp.models import Entry
    from pg_lease_django import LeaseLostError, exit_on_signals, hold, lease_lost, lease_released

    def on_released(sender: Any, lease: Any, freed: bool, **kwargs: Any) -> None:
        emit("released", epoch=lease.epoch, freed=freed)

    def on_lost(sender: Any, lease: Any, error: LeaseLostError, **kwargs: Any) -> None:
        emit("lost_signal", epoch=lease.epoch, error=type(error).__name__)

    lease_released.connect(on_released)
    lease_lost.connect(on_lost)

    if mode == "loop":
        with hold(key, ttl, owner=name) as lease:
            emit("acquired", epoch=lease.epoch, pid=os.getpid())
            wrote, where = 0, "check"
            try:
                while True:
                    where = "check"
                    lease.check()
                    where = "save"
                    Entry(account=key, writer=name, ticket=wrote).save()  # fenced by the held lease
                    wrote += 1
                    lease.wait_lost(0.02)  # pace the writes; returns early once the lease is lost
            except LeaseLostError as exc:
                emit("stopped", error=type(exc).__name__, where=where, wrote=wrote, lost=lease.lost)
            try:
                lease.check()
            except LeaseLostError as exc:
                emit("check_again", error=type(exc).__name__)
    elif mode == "takeover":
        with hold(key, ttl, owner=name, blocking=True, timeout=30) as lease:
            emit("acquired", epoch=lease.epoch)
            Entry(account=key, writer=name, ticket=0).save()
            emit("wrote")
            sys.stdin.read()
    elif mode == "hold":
        exit_on_signals()
        with hold(key, ttl, owner=name) as lease:
            emit("acquired", epoch=lease.epoch)
            lease.wait_lost()
            emit("lost")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
