"""Handoff benchmark for blocking acquire: how soon a waiter gets a lease its holder gives up.

Run from the repository root::

    python benchmarks/handoff.py [--handoffs 200] [--poll-interval 0.1] [--waiters 8]

Uses ``DATABASE_URL`` when set (that database, created if missing), else the embedded server of
``devkit/dbserver.py`` with a database ``pg_lease_bench`` of its own; migrates it, then measures:

* handoff at release: from the holder's release (server clock at the release's row lock, just
  before its commit) to the waiter's grant (server clock at the grant), for blocking acquire with
  LISTEN, blocking acquire polling (``PG_LEASE_LISTEN=False``) and a plain fixed-interval polling
  loop (``acquire(); sleep(interval)``) in the same run; the holder releases at a random phase of
  the poll cycle. The client-side figure (holder's call to waiter's return, ``time.monotonic()``)
  is printed too;
* handoff at lapse: the holder stops renewing; the waiter's grant relative to ``expires_at``;
* fairness: N threads each loop acquire/hold/release/re-acquire on one key; for every grant,
  how many grants to others the grantee waited through (a FIFO queue would give N-1).

Figures depend on the machine: quote the ratios, not the absolutes. ``run()`` is
``benchmarks/bench.py``'s stage ``handoff``: the release and expiry handoffs as rows of its table.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from common import Report, Row, bench_database, conninfo, percentile, setup_django


def configure() -> dict[str, Any]:
    """Configure Django on the benchmark database (created and migrated here); return its settings.

    Our app only: the handoffs need no test app.
    """
    database, _where = bench_database()
    setup_django(database, ["pg_lease_django"])
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return database


# --- figures --------------------------------------------------------------------------------------


@dataclass
class Figures:
    """Latency samples of one mode, in milliseconds."""

    label: str
    server_ms: list[float]
    client_ms: list[float]

    def p(self, fraction: float, client: bool = False) -> float:
        """Percentile of the server-clock (or client-side) samples."""
        return percentile(self.client_ms if client else self.server_ms, fraction)


# --- a waiter thread with its own connection ------------------------------------------------------


class Worker(threading.Thread):
    """Runs callables on its own Django connection, one at a time; keeps the connection between them."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.results: queue.Queue[tuple[Any, float, BaseException | None]] = queue.Queue()
        self.pid = 0

    def run(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            self.pid = cursor.fetchone()[0]
        try:
            while (job := self.jobs.get()) is not None:
                try:
                    result = job()
                    self.results.put((result, time.monotonic(), None))
                except BaseException as exc:
                    self.results.put((None, time.monotonic(), exc))
        finally:
            connection.close()

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job``; its result, return time and exception arrive on ``results``."""
        self.jobs.put(job)

    def stop(self) -> None:
        """Let the thread finish after the queued jobs."""
        self.jobs.put(None)
        self.join(60)


def wait_until_waiting(observer: psycopg.Connection[Any], pid: int, key: str) -> None:
    """Poll until backend ``pid`` has been refused ``key`` at least once and sleeps between attempts."""
    pattern = f"%pg_lease_acquire%{key}%"
    deadline = time.monotonic() + 30
    while (
        observer.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND state = 'idle' AND query LIKE %s", [pid, pattern]
        ).fetchone()
        is None
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend {pid} never waited for {key}")
        time.sleep(0.0005)


# --- acquire strategies ---------------------------------------------------------------------------


def blocking_acquire(key: str, owner: str, ttl: float) -> Any:
    """The library's blocking acquire (LISTEN or polling per settings)."""
    from pg_lease_django import Lease

    return Lease.objects.acquire(key, owner, ttl=ttl, blocking=True, timeout=60)


def plain_polling_acquire(interval: float) -> Callable[[str, str, float], Any]:
    """What one writes without blocking mode: try, sleep a fixed interval, try again."""

    def acquire(key: str, owner: str, ttl: float) -> Any:
        from pg_lease_django import Lease

        deadline = time.monotonic() + 60
        while (grant := Lease.objects.acquire(key, owner, ttl=ttl)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(interval)
        return grant

    return acquire


def release_sql(key: str, owner: str, epoch: int) -> datetime:
    """Release through the SQL function, returning its server_time (the row lock just before commit)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT outcome, server_time FROM pg_lease_release(%s, %s, %s)", [key, owner, epoch])
        outcome, server_time = cursor.fetchone()
    assert outcome == "ok", outcome
    return server_time  # type: ignore[no-any-return]


# --- measurements ---------------------------------------------------------------------------------


def measure_release(
    label: str,
    acquire: Callable[[str, str, float], Any],
    observer: psycopg.Connection[Any],
    handoffs: int,
    phase: float,
    run: str,
) -> Figures:
    """Holder (this thread) releases while the worker waits; latency from release to grant."""
    from pg_lease_django import Lease

    worker = Worker()
    worker.start()
    server_ms: list[float] = []
    client_ms: list[float] = []
    try:
        for i in range(handoffs):
            key = f"{run}/release/{label}/{i}"
            held = Lease.objects.acquire(key, "holder", ttl=60)
            assert held is not None
            worker.submit(lambda key=key: acquire(key, "waiter", 60))  # type: ignore[misc]
            while not worker.pid:
                time.sleep(0.001)
            wait_until_waiting(observer, worker.pid, key)
            if phase:
                time.sleep(random.uniform(0, phase))  # release at a random point of the poll cycle
            called_at = time.monotonic()
            released_at = release_sql(key, "holder", held.epoch)
            grant, returned_at, error = worker.results.get(timeout=120)
            if error is not None:
                raise error
            server_ms.append((grant.server_time - released_at).total_seconds() * 1000)
            client_ms.append((returned_at - called_at) * 1000)
            worker.submit(lambda key=key, epoch=grant.epoch: Lease.objects.release(key, "waiter", epoch))  # type: ignore[misc]
            worker.results.get(timeout=60)
    finally:
        worker.stop()
    return Figures(label, server_ms, client_ms)


def measure_lapse(
    label: str, acquire: Callable[[str, str, float], Any], lapses: int, ttl: float, phase: float, run: str
) -> list[float]:
    """Holder takes a short lease and never renews; lag of the waiter's grant behind expires_at (ms)."""
    from pg_lease_django import Lease

    worker = Worker()
    worker.start()
    lags: list[float] = []
    try:
        for i in range(lapses):
            key = f"{run}/lapse/{label}/{i}"
            held = Lease.objects.acquire(key, "holder", ttl=ttl)
            assert held is not None
            time.sleep(random.uniform(0, phase))  # start waiting at a random phase
            worker.submit(lambda key=key: acquire(key, "waiter", 60))  # type: ignore[misc]
            grant, _returned_at, error = worker.results.get(timeout=120)
            if error is not None:
                raise error
            lags.append((grant.server_time - held.expires_at).total_seconds() * 1000)
    finally:
        worker.stop()
    return lags


@dataclass
class Fairness:
    """Handoffs each grantee waited through, for one configuration."""

    label: str
    waiters: int
    waited_through: list[int]
    per_thread: list[int]

    def row(self) -> str:
        """One line of the fairness table."""
        w = self.waited_through
        return (
            f"{self.label:<38} {len(w):>6} {statistics.median(w):>6.0f} {percentile(w, 0.99):>6.0f} "
            f"{max(w):>6} {self.waiters - 1:>6}   {min(self.per_thread):>4}-{max(self.per_thread):<4}"
        )


def measure_fairness(label: str, waiters: int, grants: int, hold: float, think: float, run: str) -> Fairness:
    """``waiters`` threads loop acquire (blocking) / hold / release / think on one key."""
    from django.db import connection

    from pg_lease_django import Lease

    key = f"{run}/fairness/{label}"
    counter = [0]
    waited: list[int] = []
    per_thread = [0] * waiters
    stop = threading.Event()
    start = threading.Barrier(waiters)
    errors: list[BaseException] = []

    def client(index: int) -> None:
        owner = f"client-{index}"
        try:
            Lease.objects.inspect(key)  # connect first
            start.wait()
            while not stop.is_set():
                seen = counter[0]
                grant = Lease.objects.acquire(key, owner, ttl=30, blocking=True, timeout=60)
                # Only the holder touches the counter, so its order is the grant order.
                counter[0] += 1
                waited.append(counter[0] - 1 - seen)
                per_thread[index] += 1
                if counter[0] >= grants:
                    stop.set()
                time.sleep(hold)
                Lease.objects.release(key, owner, grant.epoch)
                if think:
                    time.sleep(think)
        except BaseException as exc:
            errors.append(exc)
            stop.set()
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(waiters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    if errors:
        raise errors[0]
    return Fairness(label, waiters, waited, per_thread)


# --- bench.py's stage ---------------------------------------------------------------------------


def run(report: Report, database: dict[str, Any], handoffs: int, lapses: int) -> None:
    """Blocking acquire: release -> grant, and expiry -> grant, as rows of bench.py's table."""
    from django.test import override_settings

    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    observer = psycopg.connect(conninfo(database), autocommit=True)
    try:
        with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=0.5):
            listen = measure_release("blocking, LISTEN", blocking_acquire, observer, handoffs, 0.0, run_id)
            lapse = measure_lapse("listen", blocking_acquire, lapses, 0.25, 0.1, run_id)
        with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=0.1):
            polling = measure_release("blocking, polling", blocking_acquire, observer, handoffs // 2, 0.1, run_id)
    finally:
        observer.close()
    for figures, target in ((listen, "p99<=50ms"), (polling, "p99<=150ms")):
        limit = 50 if figures is listen else 150
        report.add(
            Row(
                "handoff",
                f"release -> grant, {figures.label}",
                None,
                figures.p(0.5),
                figures.p(0.99),
                target=target,
                met=figures.p(0.99) <= limit,
                note=f"{len(figures.server_ms)} handoffs, server clock; client p50 {figures.p(0.5, True):.2f} ms",
            )
        )
    report.add(
        Row(
            "handoff",
            "expiry -> grant, blocking, LISTEN (TTL 0.25 s)",
            None,
            percentile(lapse, 0.5),
            percentile(lapse, 0.99),
            note=f"{len(lapse)} lapses: grant time - holder's expires_at",
        )
    )


# --- report ---------------------------------------------------------------------------------------


def main() -> None:
    """Run every measurement and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handoffs", type=int, default=200, help="handoffs per mode at release (default 200)")
    parser.add_argument("--poll-interval", type=float, default=0.1, help="PG_LEASE_POLL_INTERVAL and plain-loop sleep")
    parser.add_argument("--lapses", type=int, default=30, help="handoffs per mode at lapse (default 30)")
    parser.add_argument("--lapse-ttl", type=float, default=0.25, help="holder's TTL for the lapse runs (s)")
    parser.add_argument("--waiters", type=int, default=8, help="threads in the fairness runs (default 8)")
    parser.add_argument("--grants", type=int, default=400, help="grants per fairness run (default 400)")
    args = parser.parse_args()

    database = configure()
    from django.test import override_settings

    interval = args.poll_interval
    run = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    observer = psycopg.connect(conninfo(database), autocommit=True)
    version = observer.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    print(f"pg_lease handoff benchmark: PostgreSQL {version}, {os.cpu_count()} CPUs, database {database['NAME']!r}")
    print(f"poll interval {interval * 1000:.0f} ms (PG_LEASE_POLL_INTERVAL and the plain loop's sleep)\n")

    plain = plain_polling_acquire(interval)
    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=0.5):
        listen = measure_release("blocking, LISTEN", blocking_acquire, observer, args.handoffs, 0.0, run)
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=interval):
        polling = measure_release("blocking, polling", blocking_acquire, observer, args.handoffs, interval, run)
    loop = measure_release("plain polling loop", plain, observer, args.handoffs, interval, run)

    print(f"Handoff at release: holder's release -> waiter's grant, {args.handoffs} handoffs per mode")
    print(f"{'mode':<28} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}   {'client p50':>10} {'client p99':>10}")
    for figures in (listen, polling, loop):
        print(
            f"{figures.label:<28} {figures.p(0.5):>8.2f} {figures.p(0.99):>8.2f} {max(figures.server_ms):>8.2f}"
            f"   {figures.p(0.5, True):>10.2f} {figures.p(0.99, True):>10.2f}"
        )
    for label, figures in (("LISTEN", listen), ("polling", polling)):
        p50, p99 = loop.p(0.5) / figures.p(0.5), loop.p(0.99) / figures.p(0.99)
        print(f"ratio plain loop / {label + ':':<9} p50 {p50:6.1f}x   p99 {p99:6.1f}x")
    print(
        f"targets: LISTEN p50 <= 5 ms: {listen.p(0.5) <= 5}, p99 <= 50 ms: {listen.p(0.99) <= 50}; "
        f"polling p99 <= interval + 50 ms: {polling.p(0.99) <= interval * 1000 + 50}\n"
    )

    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=0.5):
        lapse_listen = measure_lapse("listen", blocking_acquire, args.lapses, args.lapse_ttl, interval, run)
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=interval):
        lapse_polling = measure_lapse("polling", blocking_acquire, args.lapses, args.lapse_ttl, interval, run)
    lapse_loop = measure_lapse("plain", plain, args.lapses, args.lapse_ttl, interval, run)
    print(f"Handoff at lapse: waiter's grant - holder's expires_at, {args.lapses} lapses, TTL {args.lapse_ttl} s")
    print(f"{'mode':<28} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, lags in (
        ("blocking, LISTEN", lapse_listen),
        ("blocking, polling", lapse_polling),
        ("plain polling loop", lapse_loop),
    ):
        print(f"{label:<28} {percentile(lags, 0.5):>8.2f} {percentile(lags, 0.99):>8.2f} {max(lags):>8.2f}")
    print(
        f"ratio plain loop / blocking (LISTEN) p50 "
        f"{percentile(lapse_loop, 0.5) / max(percentile(lapse_listen, 0.5), 0.001):.1f}x\n"
    )

    n, grants = args.waiters, args.grants
    runs: list[Fairness] = []
    with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=0.5):
        runs.append(measure_fairness("LISTEN, re-acquire at once", n, grants, 0.001, 0.0, run))
        runs.append(measure_fairness("LISTEN, 20 ms between turns", n, grants, 0.001, 0.02, run))
    with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=interval):
        runs.append(measure_fairness("polling, re-acquire at once", n, grants // 4, 0.001, 0.0, run))
        runs.append(
            measure_fairness(
                f"polling, {interval * 2000:.0f} ms between turns", n, grants // 4, 0.001, interval * 2, run
            )
        )
    print(f"Fairness: {n} threads loop acquire(blocking) / hold 1 ms / release on one key")
    print("handoffs = grants to others while a grantee waited (FIFO would be N-1); grants per thread: min-max")
    print(f"{'run':<38} {'grants':>6} {'p50':>6} {'p99':>6} {'max':>6} {'FIFO':>6}   per thread")
    for fairness in runs:
        print(fairness.row())
    observer.close()


if __name__ == "__main__":
    main()
