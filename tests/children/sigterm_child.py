"""A process for tests/db/test_sigterm.py: holds a lease in its main thread until a SIGTERM arrives.

    python -m tests.children.sigterm_child MODE KEY

``DATABASE_URL`` must point at the test database. It prints ``ready`` once it holds (or leads),
then sleeps. Modes:

- ``hold``: ``with hold(KEY, ttl=60)``.
- ``leased``: a ``@leased(KEY, ttl=60)`` function, as a management command's job would be.
- ``elect``: ``with elect(KEY, ...)``, leading in the election's thread; the main thread joins it.
- ``off``: ``hold`` with ``PG_LEASE_RELEASE_ON_SIGTERM = False``.
- ``mine``: the program has a SIGTERM handler of its own; it prints ``mine`` and ends the hold.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

import django


def main() -> None:
    mode, key = sys.argv[1:3]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.conf import settings

    from pg_lease_django import current_election, elect, hold, leased

    def ready() -> None:
        print("ready", flush=True)

    if mode in ("hold", "off"):
        if mode == "off":
            settings.PG_LEASE_RELEASE_ON_SIGTERM = False
        with hold(key, ttl=60):
            ready()
            time.sleep(120)
    elif mode == "leased":

        @leased(key, ttl=60)
        def job() -> None:
            ready()
            time.sleep(120)

        job()
    elif mode == "elect":

        def lead(lease: object) -> None:
            ready()
            election = current_election()
            assert election is not None
            election.wait_stop()

        with elect(key, ttl=60, on_started_leading=lead, on_stopped_leading=lambda: None) as election:
            election.join()
    elif mode == "mine":
        stop = threading.Event()

        def handler(signum: int, frame: FrameType | None) -> None:
            print("mine", flush=True)
            stop.set()

        signal.signal(signal.SIGTERM, handler)
        with hold(key, ttl=60):
            ready()
            stop.wait(120)
        print("still mine" if signal.getsignal(signal.SIGTERM) is handler else "replaced", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
