"""Each call at the cost of its work: two trees of the package side by side in one run (issue 55).

Measured in child processes, one per tree and round, the trees alternating (A B, B A, ...):

* an uncontended ``aacquire`` of a free key, non-blocking and ``blocking=True`` (median latency, under
  ``asyncio.run``: no sync caller above, as under an ASGI server);
* the client's share of a call: process time (``time.process_time``: this process's CPU, the
  server's excluded) per acquire+release pair, renew and inspect through ``Lease.objects``, against
  the hand-written statements of ``floor.py`` sent through Django's cursor on the same connection;
* the wall-clock ratio of each (hand-written time / manager time: 1.0 is as fast), the median of
  per-block ratios of interleaved blocks.

Each tree runs on a database of its own, built by its own migrations (the name of DATABASE_URL's, or
the bench database's, with ``_before`` or ``_after``, made afresh by every run): the SQL functions are
part of what is compared. Spread is the range over the rounds. DATABASE_URL, else the embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PAIRS = 250  # calls per block
BLOCKS = 8  # interleaved blocks per variant
ASYNC_CALLS = 60  # aacquire calls per block


def _blocks(variants: dict[str, Callable[[], None]], blocks: int, size: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, process) seconds per call of each variant, per block, the order reversed every block."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for block in range(blocks):
        for name in names if block % 2 == 0 else reversed(names):
            fn = variants[name]
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(size):
                fn()
            out[name].append(((time.perf_counter() - wall) / size, (time.process_time() - cpu) / size))
    return out


def _summary(blocks: dict[str, list[tuple[float, float]]], manager: str, floor: str) -> dict[str, float]:
    pairs = list(zip(blocks[manager], blocks[floor], strict=True))
    return {
        "manager_cpu_us": statistics.median(m[1] for m, _ in pairs) * 1e6,
        "floor_cpu_us": statistics.median(f[1] for _, f in pairs) * 1e6,
        "cpu_ratio": statistics.median(m[1] / f[1] for m, f in pairs),
        "wall_ratio": statistics.median(f[0] / m[0] for m, f in pairs),  # floor time / manager time
    }


def child(source: str, name: str) -> dict[str, Any]:
    """The measurements of the package in ``source`` (put first on sys.path, before the repository
    common adds), on its own database ``name``, migrated here by that package's migrations."""
    sys.path.insert(1, str(HERE))
    from common import bench_database, plain_lease_table, setup_django

    sys.path.insert(0, source)
    from floor import FLOOR_ACQUIRE, FLOOR_INSPECT, FLOOR_RELEASE, FLOOR_RENEW, through_django

    database, _ = bench_database()
    database["NAME"] = name
    setup_django(database, ["pg_lease_django"])
    from django.core.management import call_command

    call_command("migrate", "pg_lease_django", verbosity=0)
    from pg_lease_django import Lease

    tag = f"{os.getpid()}"
    key, floor_key, owner, ttl = f"cc:{tag}", f"cc:{tag}", "cc-owner", 30
    plain_lease_table([floor_key])
    result: dict[str, Any] = {"package": str(Path(sys.modules["pg_lease_django"].__file__ or "").parent)}

    def manager_pair() -> None:
        grant = Lease.objects.acquire(key, owner, ttl)
        assert grant is not None
        Lease.objects.release(key, owner, grant.epoch)

    def floor_pair() -> None:
        epoch = through_django(FLOOR_ACQUIRE, [owner, "30 s", floor_key, owner])[0]
        through_django(FLOOR_RELEASE, [floor_key, owner, epoch])

    result["pair"] = _summary(_blocks({"m": manager_pair, "f": floor_pair}, BLOCKS, PAIRS), "m", "f")
    held = Lease.objects.acquire(key, owner, 3600)
    assert held is not None
    floor_epoch = through_django(FLOOR_ACQUIRE, [owner, "3600 s", floor_key, owner])[0]
    renew = {
        "m": lambda: Lease.objects.renew(key, owner, held.epoch, 3600),
        "f": lambda: through_django(FLOOR_RENEW, ["3600 s", floor_key, owner, floor_epoch]),
    }
    result["renew"] = _summary(_blocks(renew, BLOCKS, PAIRS), "m", "f")
    inspect = {"m": lambda: Lease.objects.inspect(key), "f": lambda: through_django(FLOOR_INSPECT, [floor_key])}
    result["inspect"] = _summary(_blocks(inspect, BLOCKS, PAIRS), "m", "f")
    Lease.objects.release(key, owner, held.epoch)
    result["aacquire"] = asyncio.run(_aacquire(f"{key}:async", owner))
    return result


async def _aacquire(key: str, owner: str) -> dict[str, float]:
    from pg_lease_django import Lease

    times: dict[str, list[float]] = {"non-blocking": [], "blocking": []}
    for block in range(BLOCKS):
        for blocking in (False, True) if block % 2 == 0 else (True, False):
            for _ in range(ASYNC_CALLS):
                started = time.perf_counter()
                grant = await Lease.objects.aacquire(key, owner, 30, blocking=blocking, timeout=5 if blocking else None)
                times["blocking" if blocking else "non-blocking"].append(time.perf_counter() - started)
                assert grant is not None
                await Lease.objects.arelease(key, owner, grant.epoch)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def tree_of(ref: str, into: Path) -> Path:
    """The package as of git ``ref``, extracted into ``into`` (its parent goes first on sys.path)."""
    archive = subprocess.run(["git", "archive", ref, "pg_lease_django"], cwd=REPO, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], epilog=__doc__)
    parser.add_argument("before", nargs="?", default="HEAD", help="git ref of the tree to compare with (HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree (3)")
    parser.add_argument("--child", nargs=2, metavar=("SOURCE", "DATABASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    sys.path.insert(0, str(HERE))
    from common import bench_database, conninfo

    database, where = bench_database()
    names = {tree: f"{database['NAME']}_{tree}" for tree in ("before", "after")}
    with psycopg.connect(conninfo(database, "postgres"), autocommit=True) as conn:
        for name in names.values():
            conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {}").format(psycopg.sql.Identifier(name)))
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    print(f"database: {where}, _before and _after; before = {args.before}, after = the working tree")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": tree_of(args.before, Path(tmp)), "after": REPO}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for round_ in range(args.rounds):
            for name in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(trees[name]), names[name]],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                found = json.loads(done.stdout.strip().splitlines()[-1])
                assert found["package"] == str(trees[name] / "pg_lease_django"), found["package"]
                runs[name].append(found)
    _print(runs)


def _spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def _field(call: str, name: str) -> Callable[[dict[str, Any]], float]:
    return lambda run: float(run[call][name])


def _print(runs: dict[str, list[dict[str, Any]]]) -> None:
    rows: list[tuple[str, Callable[[dict[str, Any]], float], int]] = [
        ("aacquire non-blocking, free key (ms)", lambda r: r["aacquire"]["non-blocking"], 2),
        ("aacquire blocking=True, free key (ms)", lambda r: r["aacquire"]["blocking"], 2),
        ("  blocking / non-blocking", lambda r: r["aacquire"]["blocking"] / r["aacquire"]["non-blocking"], 2),
    ]
    for call in ("pair", "renew", "inspect"):
        rows += [
            (f"{call}: client CPU, manager (µs)", _field(call, "manager_cpu_us"), 0),
            (f"{call}: client CPU, hand-written (µs)", _field(call, "floor_cpu_us"), 0),
            (f"{call}: client CPU manager / hand-written", _field(call, "cpu_ratio"), 2),
            (f"{call}: wall, hand-written / manager", _field(call, "wall_ratio"), 2),
        ]
    print("| measurement | before | after |")
    print("|---|---:|---:|")
    for label, value, digits in rows:
        cells = [_spread([value(r) for r in runs[name]], digits) for name in ("before", "after")]
        print(f"| {label} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
