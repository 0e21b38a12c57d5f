"""Stage ``soak``: 1,000 leases renewed from 4 processes, and the minimum TTL the renewals call for.

A heartbeat must stay HOT (no index writes, no table growth) to run for days; the table's statistics
before and after show whether it does.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import psycopg
from common import TABLE, TTL, Report, Row, conninfo, percentile, sleep_until


def task_soak(leases: list[tuple[str, int]], owner: str, renewals: int, start_at: float) -> list[float]:
    """Renew ``leases`` round robin until ``renewals`` are done; returns latencies (ms)."""
    from django.db import connection

    from pg_lease_django import Lease

    Lease.objects.inspect(leases[0][0])  # connect before the start
    sleep_until(start_at)
    samples: list[float] = []
    for index in range(renewals):
        key, epoch = leases[index % len(leases)]
        started = time.perf_counter()
        Lease.objects.renew(key, owner, epoch, TTL)
        samples.append((time.perf_counter() - started) * 1000)
    connection.close()  # the backend exits and flushes its table statistics
    return samples


def task_close(pause: float) -> int:
    """Close this worker's database connection (its backend exits and flushes its statistics)."""
    from django.db import connection

    time.sleep(pause)  # long enough that every worker takes one of these tasks
    connection.close()
    return os.getpid()


def run(report: Report, pool: Any, database: dict[str, Any], renewals: int, owner: str) -> list[float]:
    """1,000 leases renewed from 4 processes; HOT ratio, sizes and dead tuples before and after."""
    from pg_lease_django import Lease

    soak_owner = f"{owner}-soak"
    leases = []
    for i in range(1000):
        grant = Lease.objects.acquire(f"bench:soak:{i:04d}", soak_owner, 600)
        assert grant is not None
        leases.append((grant.key, grant.epoch))
    observer = psycopg.connect(conninfo(database), autocommit=True)

    def stats() -> dict[str, int]:
        time.sleep(0.6)  # backend statistics reach the shared stats when the backend exits or idles
        observer.execute("SELECT pg_stat_clear_snapshot()")
        row = observer.execute(
            """SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), s.n_tup_upd, s.n_tup_hot_upd,
                      s.n_dead_tup, s.n_live_tup, s.autovacuum_count, s.vacuum_count
                 FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
                WHERE c.oid = %s::regclass""",
            [TABLE],
        ).fetchone()
        assert row is not None
        names = ("heap", "indexes", "upd", "hot_upd", "dead", "live", "autovacuum_count", "vacuum_count")
        return dict(zip(names, (int(v) for v in row), strict=True))

    from django.db import connection

    # Table statistics reach the shared counters when a backend exits (or idles a while): close every
    # connection that wrote to the table (ours, and the pool's from earlier stages) before "before".
    connection.close()
    pool.starmap(task_close, [(0.3,)] * 8, chunksize=1)
    before = stats()
    per_process = math.ceil(renewals / 4)
    start_at = time.time() + 0.5
    started = time.perf_counter()
    chunks = [leases[i::4] for i in range(4)]
    results = pool.starmap(task_soak, [(chunk, soak_owner, per_process, start_at) for chunk in chunks], chunksize=1)
    spent = time.perf_counter() - started - 0.5
    after = stats()
    samples = [s for chunk in results for s in chunk]
    updates = after["upd"] - before["upd"]
    hot = after["hot_upd"] - before["hot_upd"]
    hot_ratio = hot / updates if updates else math.nan
    growth = (after["heap"] + after["indexes"]) / (before["heap"] + before["indexes"])
    for key, epoch in leases:
        Lease.objects.release(key, soak_owner, epoch)
    observer.close()
    report.add(
        Row(
            "soak",
            f"4 procs renew 1,000 leases ({len(samples):,} renewals)",
            len(samples) / spent,
            percentile(samples, 0.5),
            percentile(samples, 0.99),
            note=f"max {max(samples):.1f} ms; {spent:.0f} s",
        )
    )
    report.add(
        Row(
            "soak",
            "  HOT updates / updates",
            ratio=hot_ratio,
            vs=f"{hot:,} / {updates:,}",
            target=">= 0.95",
            met=hot_ratio >= 0.95,
        )
    )
    report.add(
        Row(
            "soak",
            "  table + index size after / before",
            ratio=growth,
            vs=f"{(after['heap'] + after['indexes']) // 1024} / {(before['heap'] + before['indexes']) // 1024} kB",
            target="<= 2x",
            met=growth <= 2,
            note=(
                f"heap {before['heap'] // 1024}->{after['heap'] // 1024} kB, indexes {before['indexes'] // 1024}->"
                f"{after['indexes'] // 1024} kB; dead tuples {after['dead']}, live {after['live']}; autovacuum runs "
                f"{after['autovacuum_count'] - before['autovacuum_count']}"
            ),
        )
    )
    report.details["soak"] = {"before": before, "after": after, "seconds": spent, "renewals": len(samples)}
    return samples


def recommend_ttl(report: Report, renewals: list[float], margin: float = 0.1) -> None:
    """Minimum TTL from renew latency under load (docs/performance.md gives the reasoning).

    A holder renews every ttl/3 and trusts its lease for ttl * (1 - margin) from the moment it sent the
    last successful renewal, so a renewal has ttl * (2/3 - margin) to land. Ask that budget to be at
    least 100x the loaded p99 and 10x the worst renewal seen; never below 1 s.
    """
    p99, worst = percentile(renewals, 0.99), max(renewals)
    budget_fraction = 2 / 3 - margin
    needed = max(100 * p99, 10 * worst) / 1000 / budget_fraction
    recommended = max(1.0, math.ceil(needed * 2) / 2)
    report.add(
        Row(
            "ttl",
            f"recommended minimum TTL: {recommended:g} s",
            None,
            percentile(renewals, 0.5),
            p99,
            vs=f"computed {needed:.2f} s",
            note=(
                f"renew p99/max under load {p99:.1f}/{worst:.1f} ms ({len(renewals):,} renewals); renew every ttl/3, "
                f"margin {margin:.0%}: budget ttl*{budget_fraction:.2f} >= 100x p99 and >= 10x max"
            ),
        )
    )
    report.details["ttl"] = {"computed_s": needed, "recommended_s": recommended, "renew_p99_ms": p99, "max_ms": worst}
