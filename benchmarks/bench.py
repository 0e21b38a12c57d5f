"""The benchmark suite: pg_lease_django against the floor and against peers, side by side.

Run ``make bench`` (a virtualenv of its own in ``.venvs/bench`` with the project and the peers of
``benchmarks/requirements-peers.txt``), or from the repository root::

    python benchmarks/bench.py [--quick] [--json PATH] [--no-peers]

One server, one run: ``DATABASE_URL`` when set (that database), else the embedded server of
``devkit/dbserver.py`` with a database ``pg_lease_bench`` of its own, migrated here. It measures

* the floor: a raw psycopg ``SELECT 1`` and hand-written single-statement acquire/renew/release/
  inspect on Django's own psycopg connection (same server, same connection settings), and the SQL
  functions called the same raw way;
* us: ``Lease.objects`` acquire, renew, release, inspect (ops/s, p50, p99, statements per call),
  ``hold()`` enter/exit when the package exports it, a fenced save and a fenced 1,000-row queryset
  update against the same writes to a plain model of identical shape;
* peers, same operation (acquire + release of a named lock), when installed: django-pglock
  (advisory lock), django-db-mutex (a lock row), tooz's PostgreSQL driver (advisory lock),
  python-redis-lock (local Redis on 127.0.0.1:6379, when one answers);
* scale-out over distinct keys from 1, 2, 4, 8 processes; contention: 8 processes on one held key
  (failed attempts/s, WAL bytes per attempt, the holder's renew latency meanwhile) against an
  ``INSERT .. ON CONFLICT DO UPDATE .. WHERE`` attempt; handoff latency through blocking acquire
  (``benchmarks/handoff.py``);
* the Prometheus metrics: their cost on a pair and on ``hold()`` (installed vs not, side by side),
  and one scrape of the database's view with 100,000 lease rows (``benchmarks/observability.py``);
* a heartbeat soak: 1,000 leases renewed from 4 processes (HOT ratio, table size, dead tuples).

Single-connection figures are measured in interleaved blocks (A, B, C, C, B, A, ...) and ratios
are medians of per-round ratios, so load from other processes on a shared machine hits both sides
of a ratio alike. Quote ratios, not absolutes. Prints a table; writes the same as JSON
(``benchmarks/results/latest.json`` by default). Worker processes use the spawn start method.

This file only runs the stages. Each is a module of its own: ``floor.py`` (single), ``fenced_save.py``
(save), ``history.py``, ``observability.py`` (metrics), ``peers.py``, ``scale_out.py`` (scale),
``contention.py``, ``soak.py`` (and the TTL recommendation), ``handoff.py``; ``common.py`` has what
they share (set-up, timing, the table, the JSON).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stage modules, also under python -m

import contention
import fenced_save
import floor
import handoff
import history
import observability
import peers
import scale_out
import soak
from common import DEFAULT_JSON, HEADER, OWNER, Report, bench_database, installed_apps, run_meta, setup_django, stage

STAGES = ("single", "save", "history", "metrics", "peers", "scale", "contention", "soak", "handoff")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter blocks and a 40,000-renewal soak (a smoke run)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write JSON (default {DEFAULT_JSON})")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers even when installed")
    parser.add_argument("--soak-renewals", type=int, default=None, help="renewals in the soak (default 200,000)")
    parser.add_argument("--only", nargs="+", choices=STAGES, help="run only these stages")
    args = parser.parse_args()
    quick = args.quick
    rounds, block = (6, 0.2) if quick else (16, 0.2)
    soak_renewals = args.soak_renewals or (40_000 if quick else 200_000)

    total_started = time.perf_counter()
    database, where = bench_database()
    apps = installed_apps()
    setup_django(database, apps)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    meta = run_meta(where, quick, rounds, block)
    report = Report(meta)
    server = meta["server_settings"]
    print(
        f"pg_lease_django benchmark ({meta['mode']}): PostgreSQL {meta['server_version']} at {where}\n"
        f"{os.cpu_count()} CPUs, load average {meta['machine']['load_average_at_start']}; fsync={server['fsync']}, "
        f"synchronous_commit={server['synchronous_commit']}. Shared machines are noisy: compare the ratios "
        f"(measured side by\nside in interleaved blocks), not the absolute figures.\n\n{HEADER}"
    )
    timings: dict[str, float] = {}
    owner = OWNER
    only = set(args.only or STAGES)
    renewals: list[float] = []
    if "single" in only:
        with stage("single connection: floor, SQL functions, Lease.objects", timings):
            report.details["figures"] = floor.run(report, rounds, block, owner)
    if "save" in only:
        with stage("fenced save", timings):
            fenced_save.run(report, rounds, block, owner)
    if "history" in only:
        with stage("history: acquire + release with the tenure recorded", timings):
            report.details["history"] = history.run(report, rounds, block, owner)
    if "metrics" in only and observability.available():
        with stage("metrics: their cost on a pair and on hold(); one scrape of the database's view", timings):
            report.details["metrics"] = observability.run(report, rounds, block, owner)
    if "peers" in only and not args.no_peers:
        with stage("peers: acquire + release of a named lock", timings):
            peers.run(report, database, rounds, block, owner)
    connection.close()

    if only & {"scale", "contention", "soak"}:
        spawn = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited database sockets
        with spawn.Pool(8, initializer=setup_django, initargs=(database, apps)) as pool:
            pool.starmap(time.sleep, [(0.2,)] * 8, chunksize=1)  # all workers up and Django set up
            if "scale" in only:
                with stage("scale-out: distinct keys, 1/2/4/8 processes", timings):
                    scale_out.run(report, pool, database, 1.5 if quick else 2.5, 1 if quick else 2, owner)
            if "contention" in only:
                with stage("contention: 8 clients on one held key", timings):
                    renewals += contention.run(report, pool, database, 2.0 if quick else 4.0, owner)
            if "soak" in only:
                with stage("heartbeat soak", timings):
                    renewals += soak.run(report, pool, database, soak_renewals, owner)
    if "handoff" in only:
        with stage("handoff through blocking acquire (benchmarks/handoff.py)", timings):
            handoff.run(report, database, 30 if quick else 80, 6 if quick else 15)
    if renewals:
        soak.recommend_ttl(report, renewals)
    report.details["stage_seconds"] = timings
    meta["total_seconds"] = round(time.perf_counter() - total_started, 1)
    report.finish(args.json)


if __name__ == "__main__":
    main()
