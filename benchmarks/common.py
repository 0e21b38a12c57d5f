"""What every benchmark stage shares: Django and database set-up, interleaved timing, the table and its JSON.

Written once so that every stage (and the scripts that run one stage alone) measures, formats and
reports the same way. ``bench.py`` runs the stages.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import psycopg  # noqa: E402

from devkit.dbserver import conninfo as conninfo  # noqa: E402  (re-exported for the stages)

BENCH_DATABASE = "pg_lease_bench"
TABLE = "pg_lease_django_lease"
#: The floor's table: the lease table's shape (columns, constraints, indexes, fill factor), no triggers,
#: no functions: what an application would write by hand.
PLAIN_TABLE = "bench_plain_lease"
DEFAULT_JSON = HERE / "results" / "latest.json"
TTL = timedelta(seconds=30)
OWNER = f"bench-{socket.gethostname()}"


# ---- Django set-up (main process and every spawned worker) -----------------------------------------


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def installed_apps() -> list[str]:
    """Our app, the test app (its FencedModel ``Invoice``), and django-db-mutex's app when installed."""
    apps = ["pg_lease_django", "devkit.testapp"]
    if available("db_mutex"):
        apps.append("db_mutex")
    return apps


def setup_django(database: dict[str, Any], apps: list[str]) -> None:
    """Configure Django on ``database`` (no settings module: nothing else in the tree is imported).

    Also the initializer of the worker pool: every spawned worker sets Django up the same way.
    """
    import warnings

    import django
    from django.conf import settings

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # tooz's and pglocks' notices
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=apps,
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()


def bench_database() -> tuple[dict[str, Any], str]:
    """The DATABASES entry to run on (created if missing) and a description of where it is."""
    from devkit.dbserver import database_settings, database_url

    explicit = os.environ.get("DATABASE_URL")
    database = database_settings(database_url())
    if not explicit:
        database["NAME"] = BENCH_DATABASE
    with psycopg.connect(conninfo(database, "postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database["NAME"]]).fetchone() is None:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(database["NAME"])))
    where = "DATABASE_URL" if explicit else "embedded server (devkit/dbserver.py)"
    return database, f"{where}: {database['HOST']}:{database['PORT']}/{database['NAME']}"


def raw_connection() -> psycopg.Connection[Any]:
    """Django's own psycopg connection of the default alias (its settings, its cursor class)."""
    from django.db import connection

    connection.ensure_connection()
    raw: psycopg.Connection[Any] = connection.connection
    return raw


def plain_lease_table(keys: Sequence[str]) -> None:
    """Create the floor's table (once) with a free row for each of ``keys``."""
    raw = raw_connection()
    with raw.transaction():
        raw.execute(
            f"CREATE TABLE IF NOT EXISTS {PLAIN_TABLE} (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
            "INCLUDING INDEXES) WITH (fillfactor = 60)"
        )
        for key in keys:
            raw.execute(f"INSERT INTO {PLAIN_TABLE} (key, epoch) VALUES (%s, 0) ON CONFLICT DO NOTHING", [key])


def count_statements(fn: Callable[[], Any]) -> int:
    """Statements Django sends for one call of ``fn``."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        fn()
    return len(captured.captured_queries)


def acquire_epoch(key: str, owner: str, ttl: float | timedelta = TTL) -> int:
    """Acquire ``key`` for ``owner`` (it must be free or ours); its epoch."""
    from pg_lease_django import Lease

    grant = Lease.objects.acquire(key, owner, ttl)
    assert grant is not None, f"{key} is held by someone else"
    return grant.epoch


def sleep_until(start_at: float) -> None:
    """Sleep until wall-clock ``start_at``: worker processes start a measurement together."""
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


class Timer:
    """Collects per-step latencies (ms) for one series."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        self.samples[name].append((time.perf_counter() - started) * 1000)
        return result


Cycle = Callable[[Timer], None]


@dataclass
class Series:
    """One variant of an interleaved measurement: a rate per block and latencies per step."""

    label: str
    rates: list[float] = field(default_factory=list)
    timer: Timer = field(default_factory=Timer)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def p(self, step: str, fraction: float) -> float:
        return percentile(self.timer.samples[step], fraction)

    def cycle_ms(self, fraction: float) -> float:
        """Percentile of the summed steps of a cycle (steps of one cycle are recorded in order)."""
        steps = list(self.timer.samples.values())
        if len(steps) == 1:
            return percentile(steps[0], fraction)
        return percentile([sum(parts) for parts in zip(*steps, strict=True)], fraction)


def op_p(series: Series) -> tuple[float, float]:
    """p50 and p99 of a one-step (``"op"``) series, for a row's latency columns."""
    return series.p("op", 0.5), series.p("op", 0.99)


def interleave(
    cycles: dict[str, Cycle],
    rounds: int,
    block_seconds: float,
    min_cycles: int = 5,
    before_round: Callable[[], None] | None = None,
) -> dict[str, Series]:
    """Run each cycle in timed blocks, alternating the order every round (ABC, CBA, ...).

    ``before_round``, when given, runs (untimed) before each round's blocks: to put the tables each
    side writes back into the same state, for instance.
    """
    series = {label: Series(label) for label in cycles}
    for cycle in cycles.values():  # warm-up: connections, plans, caches
        warm = Timer()
        for _ in range(min_cycles):
            cycle(warm)
    order = list(cycles)
    for index in range(rounds):
        if before_round is not None:
            before_round()
        for label in order if index % 2 == 0 else reversed(order):
            entry = series[label]
            done, started = 0, time.perf_counter()
            while True:
                cycles[label](entry.timer)
                done += 1
                now = time.perf_counter()
                if now - started >= block_seconds and done >= min_cycles:
                    break
            entry.rates.append(done / (now - started))
    return series


def ratio(a: Series, b: Series) -> float:
    """Median over rounds of a's rate / b's rate (adjacent blocks)."""
    return statistics.median(x / y for x, y in zip(a.rates, b.rates, strict=True))


def block_rates(groups: dict[str, dict[str, Series]]) -> dict[str, list[float]]:
    """Every block's rate, keyed ``group:variant``, for the JSON details."""
    return {
        f"{group}:{name}": [round(rate, 1) for rate in entry.rates]
        for group, table in groups.items()
        for name, entry in table.items()
    }


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Announce a stage and record its wall-clock seconds in ``timings``."""
    print(f"\n== {name}", flush=True)
    started = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - started, 1)


# ---- the report ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table (and of the JSON)."""

    section: str
    name: str
    ops_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    ratio: float | None = None
    vs: str = ""
    target: str = ""
    met: bool | None = None
    note: str = ""


HEADER = (
    f"{'section':<11} {'measurement':<46} {'ops/s':>8} {'p50 ms':>7} {'p99 ms':>7}  "
    f"{'ratio':>7} {'vs':<22} {'target':<10} {'met':<4} note"
)


def _num(value: float | None, width: int, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return " " * (width - 1) + "-"
    return f"{value:>{width}.{digits}f}"


def format_row(row: Row) -> str:
    met = "-" if row.met is None else ("yes" if row.met else "NO")
    ratio_text = _num(row.ratio, 6, 2) + ("x" if row.ratio is not None else " ")
    return (
        f"{row.section:<11} {row.name:<46} {_num(row.ops_s, 8, 0)} {_num(row.p50_ms, 7, 2)} "
        f"{_num(row.p99_ms, 7, 2)}  {ratio_text} {row.vs:<22} {row.target:<10} {met:<4} {row.note}"
    ).rstrip()


@dataclass
class Report:
    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        """Keep ``row`` and print it at once (a long run shows its progress)."""
        self.rows.append(row)
        print(format_row(row), flush=True)

    def table(self) -> str:
        lines = [HEADER, "-" * len(HEADER)]
        section = None
        for row in self.rows:
            if row.section != section and section is not None:
                lines.append("")
            section = row.section
            lines.append(format_row(row))
        return "\n".join(lines)

    def finish(self, path: Path) -> None:
        """Print the table and the targets missed; write meta, rows and details as JSON to ``path``."""
        meta = self.meta
        print(f"\n\nResults ({meta['mode']} run, {meta['total_seconds']} s; ratios from interleaved blocks)\n")
        print(self.table())
        missed = [f"{row.section}: {row.name.strip()}" for row in self.rows if row.met is False]
        print(f"\ntargets met: {sum(row.met is True for row in self.rows)}, missed: {len(missed)}")
        for name in missed:
            print(f"  missed: {name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"meta": meta, "rows": [asdict(row) for row in self.rows], "details": self.details}, indent=2)
            + "\n"
        )
        print(f"JSON written to {path}")


# ---- the run's description -----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in load],
        "git_commit": commit.stdout.strip() or None,
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in (
        "django",
        "psycopg",
        "django-pglock",
        "django-db-mutex",
        "tooz",
        "psycopg2-binary",
        "python-redis-lock",
        "redis",
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def run_meta(where: str, quick: bool, rounds: int, block: float) -> dict[str, Any]:
    """The JSON's ``meta``: server, its durability settings, machine, versions and the run's settings."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        server_version = cursor.fetchone()[0]
        cursor.execute("SHOW synchronous_commit")
        sync_commit = cursor.fetchone()[0]
        cursor.execute("SHOW fsync")
        fsync = cursor.fetchone()[0]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "database": where,
        "server_version": server_version,
        "server_settings": {"synchronous_commit": sync_commit, "fsync": fsync},
        "machine": machine(),
        "versions": versions(),
        "mode": "quick" if quick else "full",
        "rounds": rounds,
        "block_seconds": block,
    }


def run_alone(name: str, run: Callable[[Report, int, float, str], Any], description: str) -> None:
    """A stage run as a script of its own (``python benchmarks/<stage>.py [--rounds N] [--block S]``):
    set-up as `bench.py` does, its rows printed, its figures in ``results/<name>.json``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--block", type=float, default=0.25)
    args = parser.parse_args()
    database, where = bench_database()
    setup_django(database, installed_apps())
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    report = Report(run_meta(where, False, args.rounds, args.block))
    print(HEADER)
    report.details[name] = run(report, args.rounds, args.block, OWNER)
    report.meta["total_seconds"] = 0
    report.finish(DEFAULT_JSON.with_name(f"{name}.json"))
