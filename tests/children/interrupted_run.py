"""``leases run`` given a real signal at one of its statements, for tests/db/test_interrupts_jobs.py.

    python -m tests.children.interrupted_run ARGS...      (as ``python -m django leases run ARGS...``)

Every statement sent on a Django connection of the process (its own, and ``hold()``'s lease
connections; not the heartbeat's renewals) is counted, and appended to ``PG_LEASE_TEST_STATEMENTS``
(a path, one line each) when it is set. With ``PG_LEASE_TEST_SIGNAL_AT=N:before|after:SIGNUM``,
SIGNUM is sent just before the N-th statement is sent or just after its answer came. From the main
thread it is ``signal.raise_signal``: the handler runs there and then, so the process is exactly
between two statements. From another thread (the election's, ``--campaign``) it is ``os.kill`` of
the process (the main thread handles it); the sending thread then waits until the handler has
stopped the election, instead of a sleep.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import django

#: Seconds a sending thread waits for the signal's handler to stop the election: a hang guard.
HANG_GUARD = 30.0


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.core.management import execute_from_command_line
    from django.db.backends.signals import connection_created

    at: dict[int, str] = {}
    signum = 0
    if point := os.environ.get("PG_LEASE_TEST_SIGNAL_AT"):
        step, when, number = point.split(":")
        at, signum = {int(step): when}, int(number)
    log = os.environ.get("PG_LEASE_TEST_STATEMENTS")
    sent = [0]
    lock = threading.Lock()

    def interrupt() -> None:
        if threading.current_thread() is threading.main_thread():
            signal.raise_signal(signum)
            return
        from pg_lease_django import current_election

        os.kill(os.getpid(), signum)
        election = current_election()
        if election is not None:
            election._stop.wait(HANG_GUARD)  # set by the handler (CampaignSupervisor._on_signal)

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if threading.current_thread().name.startswith("pg_lease heartbeat"):
            return execute(sql, params, many, context)
        with lock:
            sent[0] += 1
            when = at.get(sent[0])
            if log:
                with open(log, "a") as out:
                    out.write(" ".join(sql.split())[:100] + "\n")
        if when == "before":
            interrupt()
        result = execute(sql, params, many, context)
        if when == "after":
            interrupt()
        return result

    def attach(sender: Any, connection: Any, **kwargs: Any) -> None:
        if wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(wrapper)

    connection_created.connect(attach, weak=False)
    execute_from_command_line(["django", "leases", "run", *sys.argv[1:]])


if __name__ == "__main__":
    main()
