"""What a ``hold()`` costs, side by side with the manager, and how 1,000 holds in one process behave.

1. ``hold()`` enter+exit against ``Lease.objects.acquire`` + ``release`` (interleaved rounds, same
   machine, same database): the ratio manager / hold (1.0 = a hold costs what the two statements cost).
2. ``HOLDS`` (default 1,000) holds entered at once in one process (from one thread, held together
   for ``SECONDS``): the peak thread count of the process, the peak number of this process's lease
   sessions in ``pg_stat_activity``, and the lateness of every renewal against its schedule (the
   previous successful send + ``renew_every``): p50 / p99 / max.

DATABASE_URL, else the embedded server. Usage: python benchmarks/holds.py [rounds] [holds] [seconds]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TTL = 6.0
RENEW_EVERY = 2.0


def single(rounds: int) -> tuple[float, float]:
    """Median seconds of one hold() enter+exit and of one acquire+release, interleaved."""
    from pg_lease_django import Lease, hold

    owner = "bench-holds"
    hold_times: list[float] = []
    manager_times: list[float] = []
    for _ in range(20):  # warm-up: connections, statement rendering, the schema lookup
        with hold("bench:holds:warm", ttl=TTL):
            pass
        grant = Lease.objects.acquire("bench:holds:warm", owner, TTL)
        assert grant is not None
        Lease.objects.release("bench:holds:warm", owner, grant.epoch)
    for _ in range(rounds):
        started = time.perf_counter()
        with hold("bench:holds:single", ttl=TTL):
            pass
        hold_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        grant = Lease.objects.acquire("bench:holds:manager", owner, TTL)
        assert grant is not None
        Lease.objects.release("bench:holds:manager", owner, grant.epoch)
        manager_times.append(time.perf_counter() - started)
    return statistics.median(hold_times), statistics.median(manager_times)


def many(count: int, seconds: float) -> dict[str, Any]:
    """Enter ``count`` holds, keep them ``seconds``, exit; the peaks and the renewal lateness."""
    import psycopg
    from django.db import connection

    from pg_lease_django import hold
    from pg_lease_django.holds import lease_connection
    from pg_lease_django.holds.context import active as _active

    sends: dict[str, list[float]] = defaultdict(list)
    original = lease_connection.LeaseConnection.renew

    def recording(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        sends[key].append(time.monotonic())
        return original(self, key, *args, **kwargs)

    lease_connection.LeaseConnection.renew = recording  # type: ignore[method-assign]
    peaks = {"threads": threading.active_count(), "sessions": 0}
    stop = threading.Event()
    settings = connection.settings_dict

    def watch() -> None:
        with psycopg.connect(common.conninfo(settings, settings["NAME"]), autocommit=True) as conn:
            while not stop.is_set():
                (sessions,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pg_lease_django%%'"
                ).fetchone() or (0,)
                peaks["sessions"] = max(peaks["sessions"], int(sessions))
                peaks["threads"] = max(peaks["threads"], threading.active_count())
                stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    granted: dict[str, float] = {}
    entered = 0
    error = None
    try:
        with contextlib.ExitStack() as stack:
            try:
                for index in range(count):
                    lease = stack.enter_context(hold(f"bench:holds:many:{index}", ttl=TTL, renew_every=RENEW_EVERY))
                    granted[lease.key] = lease._tenure.granted_at
                    entered += 1
            except Exception as exc:  # the old one-connection-per-hold design runs out of connections
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            time.sleep(seconds)
            lost = sum(1 for lease in _active.get() if lease.lost)  # the holds this thread entered
    finally:
        stop.set()
        watcher.join()
        lease_connection.LeaseConnection.renew = original  # type: ignore[method-assign]
    lateness: list[float] = []
    for key, times in sends.items():
        previous = granted.get(key)
        if previous is None:
            continue
        for sent in times:
            lateness.append(max(0.0, sent - (previous + RENEW_EVERY)))
            previous = sent
    lateness.sort()
    return {
        "entered": entered,
        "error": error,
        "lost": lost,
        "renewals": len(lateness),
        "threads": peaks["threads"],
        "sessions": peaks["sessions"],
        "p50": common.percentile(lateness, 0.5),
        "p99": common.percentile(lateness, 0.99),
        "max": lateness[-1] if lateness else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], epilog="DATABASE_URL, else the embedded server."
    )
    parser.add_argument("rounds", nargs="?", type=int, default=300, help="hold() and acquire+release pairs timed (300)")
    parser.add_argument("count", nargs="?", type=int, default=1000, help="holds entered in one process (1000)")
    parser.add_argument("seconds", nargs="?", type=float, default=7.0, help="how long they are held (7.0)")
    args = parser.parse_args()
    rounds, count, seconds = args.rounds, args.count, args.seconds
    database, where = common.bench_database()
    common.setup_django(database, ["pg_lease_django"])
    from django.core.management import call_command

    call_command("migrate", "pg_lease_django", verbosity=0)
    print(f"database: {where}")
    hold_s, manager_s = single(rounds)
    print(f"hold() enter+exit      median {hold_s * 1000:7.3f} ms")
    print(f"acquire+release        median {manager_s * 1000:7.3f} ms")
    print(f"ratio manager/hold     {manager_s / hold_s:7.2f}x   (target >= 0.5x)")
    result = many(count, seconds)
    print(
        f"{count} holds in one process: entered {result['entered']}, lost {result['lost']}"
        + (f", stopped by {result['error']}" if result["error"] else "")
    )
    print(f"  peak threads {result['threads']}, peak lease sessions (pg_stat_activity) {result['sessions']}")
    print(
        f"  renewals {result['renewals']}, lateness vs schedule: p50 {result['p50'] * 1000:.1f} ms, "
        f"p99 {result['p99'] * 1000:.1f} ms, max {result['max'] * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
