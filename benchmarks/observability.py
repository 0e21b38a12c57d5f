"""Stage ``metrics``: what the Prometheus metrics cost, and what one scrape of the database's view costs.

* Side by side on Django's connection, in interleaved blocks: a ``Lease.objects`` acquire + release
  pair and a ``hold()`` enter + exit, with the metrics installed (`pg_lease_django.metrics.hooks.install`)
  against the same with them uninstalled (target: at most 1.03x the time). A pair counts a grant and
  a release, where ``operations`` reads their rows; a hold counts the same, plus its signals.
* The client CPU of a pair (this thread's CPU time, which the server's work and other processes'
  load do not add to), metrics on against off, in alternated blocks: what the two counts cost.
* One scrape of the database's view (`pg_lease_django.metrics.database_view.DatabaseCollector`, one
  statement) with 100,000 lease rows under 50 key labels (a third each held, lapsed and free), made
  once by the SQL functions and kept (rows are never deleted): the median and p99 of 30 scrapes.

Runs in ``benchmarks/bench.py`` (``--only metrics``), or alone: ``python benchmarks/observability.py``.
Needs prometheus_client (the ``metrics`` extra).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TTL, Report, Row, Timer, interleave, percentile, run_alone

TARGET = 1.03
ROWS = 100_000
LABELS = 50
SCRAPES = 30
BATCH = 2_000


def available() -> bool:
    """prometheus_client is installed (else the stage is skipped)."""
    from common import available as module_available

    return module_available("prometheus_client")


def _fill(rows: int) -> float:
    """Make ``rows`` lease rows ``bench-scrape-N:i`` (held, lapsed, free) unless they exist; seconds taken."""
    from django.db import connection

    from pg_lease_django.sql import run

    schema = run.schema(connection)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {schema}.pg_lease_django_lease WHERE key LIKE 'bench-scrape-%%'")
        (present,) = cursor.fetchone()
        if present >= rows:
            return 0.0
        started = time.perf_counter()
        # Through the functions, as any client: i % 3 = 0 held for a day, 1 lapsed at once, 2 released.
        # In batches, each committed on its own: a grant takes a lock per key until its transaction ends.
        for first in range(present, rows, BATCH):
            _fill_batch(cursor, schema, first, min(first + BATCH, rows))
        return time.perf_counter() - started


def _fill_batch(cursor: Any, schema: str, first: int, end: int) -> None:
    cursor.execute(
        f"""
            WITH keys AS (
              SELECT i, 'bench-scrape-' || (i %% {LABELS}) || ':' || i AS key
                FROM generate_series(%s::int, %s::int - 1) i
            ), granted AS (
              SELECT k.i, k.key, a.epoch
                FROM keys k,
                     LATERAL {schema}.pg_lease_acquire(
                       k.key, 'bench-owner',
                       CASE WHEN k.i %% 3 = 1 THEN interval '1 millisecond' ELSE interval '1 day' END) a
            )
            SELECT count(*)
              FROM granted g, LATERAL {schema}.pg_lease_release(g.key, 'bench-owner', g.epoch) r
             WHERE g.i %% 3 = 2
            """,
        [first, end],
    )


#: Junk keys one tenant could make (issue 46): half without the separator, half each a label of its own.
JUNK_ROWS = 100_000
#: What a scrape over them may export at most (PG_LEASE_METRICS_MAX_LABELS at its default, 16).
SERIES_TARGET = 200


def _fill_junk(rows: int) -> float:
    """Make ``rows`` junk lease rows unless they exist (plain INSERTs, as the owner); seconds taken."""
    from django.db import connection

    from pg_lease_django.sql import run

    schema = run.schema(connection)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {schema}.pg_lease_django_lease WHERE key LIKE 'bench-junk%%'")
        (present,) = cursor.fetchone()
        if present >= rows:
            return 0.0
        started = time.perf_counter()
        cursor.execute(
            f"INSERT INTO {schema}.pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
            "SELECT CASE WHEN i %% 2 = 0 THEN 'bench-junk-' || i ELSE 'bench-junk' || i || ':k' END, 'junk', "
            "f.floor + 1, clock_timestamp(), clock_timestamp() + interval '1 day' "
            f"FROM generate_series(%s::int, %s::int - 1) i, {schema}.pg_lease_django_epoch_floor f "
            "ON CONFLICT DO NOTHING",
            [present, rows],
        )
        return time.perf_counter() - started


def _hooks_us(metrics: Any, cycles: int = 5_000) -> float:
    """Microseconds the metrics add to one hold's grant, acquired and released (installed minus not)."""
    from pg_lease_django.holds.lease import send_lease_signal
    from pg_lease_django.signals import lease_acquired, lease_released

    class Lease:  # what the receivers read of a HeldLease
        key = "bench-metrics:hooks"
        epoch = 1

    def loop() -> float:
        started = time.perf_counter()
        for _ in range(cycles):
            lease: Any = Lease()
            with metrics.acquiring(lease.key):
                metrics.granted(lease.key)  # as operations counts the grant's row
            send_lease_signal(lease_acquired, lease)
            metrics.release_confirmed(lease.key)
            send_lease_signal(lease_released, lease, freed=True)
        return (time.perf_counter() - started) / cycles * 1e6

    was = metrics.installed()
    on: list[float] = []
    off: list[float] = []
    try:
        for _ in range(7):  # alternated, the fastest of each side: load from other processes only adds time
            metrics.install()
            on.append(loop())
            metrics.uninstall()
            off.append(loop())
    finally:
        (metrics.install if was else metrics.uninstall)()
    return min(on) - min(off)


def _pair_cpu_us(metrics: Any, owner: str, blocks: int = 21, pairs: int = 300) -> tuple[list[float], list[float]]:
    """Client CPU (this thread's, in microseconds) per ``Lease.objects`` acquire + release pair, with the
    metrics installed and not, in alternated blocks: the per-block figures, on and off."""
    from pg_lease_django import Lease

    def one_block(key: str) -> float:
        started = time.thread_time()
        for _ in range(pairs):
            grant = Lease.objects.acquire(key, owner, TTL)
            assert grant is not None
            Lease.objects.release(key, owner, grant.epoch)
        return (time.thread_time() - started) / pairs * 1e6

    was = metrics.installed()
    on: list[float] = []
    off: list[float] = []
    try:
        one_block("bench-metrics:cpu:warm")  # connection, statement cache, labels
        for _ in range(blocks):
            metrics.install()
            on.append(one_block("bench-metrics:cpu:on"))
            metrics.uninstall()
            off.append(one_block("bench-metrics:cpu:off"))
    finally:
        (metrics.install if was else metrics.uninstall)()
    return on, off


def run(report: Report, rounds: int, block: float, owner: str) -> dict[str, Any]:
    """The metrics' cost (installed vs not) on a pair and on hold(); the scrape with 100k rows."""
    from django.db import connection

    from pg_lease_django import Lease, hold
    from pg_lease_django.metrics import hooks as metrics
    from pg_lease_django.metrics.database_view import DatabaseCollector

    section = "metrics"
    was_installed = metrics.installed()

    def pair(key: str) -> Any:
        def one(timer: Timer) -> None:
            grant = timer("acquire", Lease.objects.acquire, key, owner, TTL)
            assert grant is not None
            timer("release", Lease.objects.release, key, owner, grant.epoch)

        return one

    def held(key: str) -> Any:
        def one(timer: Timer) -> None:
            holding = hold(key, TTL, owner=owner)
            timer("enter", holding.__enter__)
            timer("exit", holding.__exit__, None, None, None)

        return one

    def switched(on: bool, cycle: Any) -> Any:
        def one(timer: Timer) -> None:
            if on != metrics.installed():
                (metrics.install if on else metrics.uninstall)()
            cycle(timer)

        return one

    figures: dict[str, Any] = {}
    try:
        for name, make in (("acquire+release pair", pair), ("hold() enter+exit", held)):
            series = interleave(
                {
                    "on": switched(True, make(f"bench-metrics:{name[:4]}:on")),
                    "off": switched(False, make(f"bench-metrics:{name[:4]}:off")),
                },
                rounds,
                block,
            )
            on, off = series["on"], series["off"]
            cost = statistics.median(o / n for o, n in zip(off.rates, on.rates, strict=True))  # time on / time off
            report.add(Row(section, f"{name}, metrics off", off.rate, off.cycle_ms(0.5), off.cycle_ms(0.99)))
            report.add(
                Row(
                    section,
                    f"{name}, metrics on",
                    on.rate,
                    on.cycle_ms(0.5),
                    on.cycle_ms(0.99),
                    ratio=cost,
                    vs="time vs metrics off",
                    target=f"<= {TARGET}x",
                    met=cost <= TARGET,
                )
            )
            figures[name] = round(cost, 4)
            if name.startswith("hold"):
                figures["hold_p50_ms"] = off.cycle_ms(0.5)
    finally:
        if was_installed and not metrics.installed():
            metrics.install()
        elif not was_installed:
            metrics.uninstall()

    # The same cost without the database: what the hooks and receivers add to one hold, in microseconds
    # (a grant, the acquired and released signals), against the hold's own p50 above. Steadier than the
    # ratio on a loaded machine, where two blocks of the same code differ by more than 3 %.
    added_us = _hooks_us(metrics)
    hold_ms = figures["hold_p50_ms"]
    report.add(
        Row(
            section,
            "hooks + receivers per hold(), no database",
            1e6 / added_us,
            added_us / 1000,
            None,
            ratio=1 + added_us / (hold_ms * 1000),
            vs="bound vs hold() p50",
            target=f"<= {TARGET}x",
            met=1 + added_us / (hold_ms * 1000) <= TARGET,
            note=f"{added_us:.1f} us added to a {hold_ms:.2f} ms hold",
        )
    )
    figures["hooks_us_per_hold"] = round(added_us, 2)

    cpu_on, cpu_off = _pair_cpu_us(metrics, owner)
    on_us, off_us = statistics.median(cpu_on), statistics.median(cpu_off)
    cpu_ratio = statistics.median(o / f for o, f in zip(cpu_on, cpu_off, strict=True))  # each block with its twin
    report.add(
        Row(
            section,
            "acquire+release pair, client CPU, metrics on",
            1e6 / on_us,
            on_us / 1000,
            None,
            ratio=cpu_ratio,
            vs="client CPU vs metrics off",
            target=f"<= {TARGET}x",
            met=cpu_ratio <= TARGET,
            note=f"{on_us:.1f} us vs {off_us:.1f} us per pair (medians of {len(cpu_on)} blocks each)",
        )
    )
    figures["pair_client_cpu_us"] = {"on": round(on_us, 2), "off": round(off_us, 2), "ratio": round(cpu_ratio, 4)}

    filled = _fill(ROWS)
    collector = DatabaseCollector()
    times: list[float] = []
    samples = 0
    for _ in range(SCRAPES):
        started = time.perf_counter()
        families = list(collector.collect())
        times.append((time.perf_counter() - started) * 1000)
        samples = sum(len(family.samples) for family in families)
    up = families[0].samples[0].value
    p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
    report.add(
        Row(
            section,
            f"one scrape of the database's view, {ROWS:,} rows",
            1000 / p50,
            p50,
            p99,
            note=f"{samples} samples, pg_lease_db_up={up:g}" + (f"; rows made in {filled:.1f} s" if filled else ""),
        )
    )
    figures["scrape_ms_p50"] = round(p50, 2)
    figures["scrape_ms_p99"] = round(p99, 2)

    # One tenant's junk keys: the label cap keeps the scrape small (it was 80,073 series, 21 MB).
    from django.test import override_settings

    filled = _fill_junk(JUNK_ROWS)
    times = []
    with override_settings(PG_LEASE_METRICS_MAX_LABELS=16):
        for _ in range(max(3, SCRAPES // 3)):
            started = time.perf_counter()
            families = list(collector.collect())
            times.append((time.perf_counter() - started) * 1000)
    junk_series = sum(len(family.samples) for family in families)
    p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
    report.add(
        Row(
            section,
            f"one scrape over {JUNK_ROWS:,} junk keys more (half without ':', half a label each)",
            1000 / p50,
            p50,
            p99,
            target=f"< {SERIES_TARGET} series",
            met=junk_series < SERIES_TARGET,
            note=f"{junk_series} series" + (f"; rows made in {filled:.1f} s" if filled else ""),
        )
    )
    figures["junk_scrape_series"] = junk_series
    figures["junk_scrape_ms_p50"] = round(p50, 2)
    connection.close()
    return figures


if __name__ == "__main__":
    run_alone("metrics", run, __doc__.split("\n\n")[0])
