"""Stage ``scale``: acquire + release over distinct keys from 1, 2, 4 and 8 processes of the worker pool.

Ours against the floor's UPDATEs (on the plain table of ``floor.py``) with and without the release
notification, so the cost of NOTIFY under concurrency shows apart from the rest.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
from common import TTL, Report, Row, acquire_epoch, conninfo, plain_lease_table, raw_connection, sleep_until
from floor import FLOOR_ACQUIRE, FLOOR_RELEASE, FLOOR_RELEASE_NOTIFY

SCALE_KINDS = {
    "manager": "Lease.objects",
    "floor": "floor UPDATEs",
    "floor-notify": "floor UPDATEs + pg_notify",
}


def task_cycles(kind: str, key: str, owner: str, start_at: float, seconds: float) -> tuple[int, float, int]:
    """Acquire + release of one key back to back; returns (cycles, seconds, pid)."""
    from pg_lease_django import Lease

    raw = raw_connection()
    acquire_epoch(key, owner)  # the key exists and is ours
    Lease.objects.release(key, owner, Lease.objects.inspect(key).epoch)
    sleep_until(start_at)
    done, started = 0, time.perf_counter()
    end = started + seconds
    while time.perf_counter() < end:
        if kind == "manager":
            grant = Lease.objects.acquire(key, owner, TTL)
            assert grant is not None
            Lease.objects.release(key, owner, grant.epoch)
        else:
            row = raw.execute(FLOOR_ACQUIRE, [owner, TTL, key, owner]).fetchone()
            assert row is not None
            release = FLOOR_RELEASE_NOTIFY if kind == "floor-notify" else FLOOR_RELEASE
            assert raw.execute(release, [key, owner, row[0]]).fetchone() is not None
        done += 1
    return done, time.perf_counter() - started, os.getpid()


def sample_waits(conn: psycopg.Connection[Any], until: Callable[[], bool]) -> dict[str, int]:
    """What this database's active backends wait on, sampled every 20 ms until ``until()``."""
    counts: dict[str, int] = defaultdict(int)
    while not until():
        for (event,) in conn.execute(
            """SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity
                WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()"""
        ):
            counts[event] += 1
        time.sleep(0.02)
    return dict(counts)


def run(report: Report, pool: Any, database: dict[str, Any], seconds: float, repeats: int, owner: str) -> None:
    """Distinct keys from 1, 2, 4, 8 processes; the variants interleaved per process count.

    With 8 processes, what the backends wait on is sampled: it names the bottleneck.
    """
    rates: dict[tuple[str, int], list[float]] = defaultdict(list)
    waits: dict[str, dict[str, int]] = {}
    # The floor's rows, on its plain table (made here, before the workers race to make it).
    plain_lease_table([f"bench:scale:{kind}:{i}" for kind in SCALE_KINDS if kind != "manager" for i in range(8)])
    observer = psycopg.connect(conninfo(database), autocommit=True)
    for _ in range(repeats):
        for procs in (1, 2, 4, 8):
            for kind in SCALE_KINDS:
                start_at = time.time() + 0.3
                args = [(kind, f"bench:scale:{kind}:{i}", f"{owner}-{i}", start_at, seconds) for i in range(procs)]
                pending = pool.starmap_async(task_cycles, args, chunksize=1)
                if procs == 8:
                    sleep_until(start_at + 0.2)
                    for event, count in sample_waits(observer, pending.ready).items():
                        waits.setdefault(kind, defaultdict(int))[event] += count
                results = pending.get(timeout=seconds + 120)
                if len({pid for *_, pid in results}) != procs:
                    report.details.setdefault("warnings", []).append(f"scale-out {procs}: a worker ran two tasks")
                rates[(kind, procs)].append(sum(done / spent for done, spent, _ in results))
    observer.close()
    # The target: ours at 8 processes scales at least 0.9 as well as the hand-written statements do
    # in the same run (this shared disk caps how far group commit can take either).
    scaling = {kind: statistics.median(rates[(kind, 8)]) / statistics.median(rates[(kind, 1)]) for kind in SCALE_KINDS}
    for kind, label in SCALE_KINDS.items():
        base = statistics.median(rates[(kind, 1)])
        for procs in (1, 2, 4, 8):
            rate = statistics.median(rates[(kind, procs)])
            target = procs == 8 and kind == "manager"
            note = ""
            if procs == 8:
                total = sum(waits[kind].values()) or 1
                top = sorted(waits[kind].items(), key=lambda item: -item[1])[:3]
                note = "waits: " + ", ".join(f"{event} {count / total:.0%}" for event, count in top)
            if target:
                note = f"{scaling[kind] / scaling['floor']:.2f}x the floor's scaling ({scaling['floor']:.2f}x); " + note
            report.add(
                Row(
                    "scale-out",
                    f"{label} acq+rel, {procs} proc{'s' if procs > 1 else ''}",
                    rate,
                    ratio=rate / base,
                    vs="1 process",
                    target=">= 0.9x floor's" if target else "",
                    met=(scaling[kind] >= 0.9 * scaling["floor"]) if target else None,
                    note=note,
                )
            )
    report.details["scale_out_cycles_per_s"] = {f"{k}:{n}": v for (k, n), v in rates.items()}
    report.details["scale_out_waits_8_procs"] = waits
