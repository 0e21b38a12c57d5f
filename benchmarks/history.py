"""Stage ``history``: what recording a lease's history costs an acquire + release.

Side by side on Django's connection, in interleaved blocks: ``Lease.objects`` acquire + release of a
key whose history is recorded (``PG_LEASE_HISTORY``) against one whose is not (target: at most
1.15x the time). And the trigger's own cost when nothing is recorded: the same calls with the lease
table's triggers off for the session (``session_replication_role = replica``, superusers only; the
row is skipped otherwise), which is how a release before migration 0009 ran.

Runs in ``benchmarks/bench.py`` (``--only history``), or alone: ``python benchmarks/history.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from common import TTL, Report, Row, Timer, interleave, raw_connection

TARGET = 1.15
ACQUIRE = "SELECT granted, epoch FROM pg_lease_acquire(%s::text, %s::text, %s::interval)"
RELEASE = "SELECT outcome FROM pg_lease_release(%s::text, %s::text, %s::bigint)"


def run(report: Report, rounds: int, block: float, owner: str) -> dict[str, Any]:
    """Interleave recorded and unrecorded acquire + release; add the rows; return the figures."""
    from django.db import connection
    from django.test import override_settings

    from pg_lease_django import Lease
    from pg_lease_django.history import sync_scope
    from pg_lease_django.models import LeaseTenure

    section = "history"
    recorded, plain = "bench-history:recorded", "bench-plain"

    def cycle(key: str) -> Any:
        def one(timer: Timer) -> None:
            grant = timer("acquire", Lease.objects.acquire, key, owner, TTL)
            assert grant is not None
            timer("release", Lease.objects.release, key, owner, grant.epoch)

        return one

    with override_settings(PG_LEASE_HISTORY=["bench-history:"]):
        sync_scope()
        try:
            series = interleave({"on": cycle(recorded), "off": cycle(plain)}, rounds, block)
            per_pair = [off / on for off, on in zip(series["off"].rates, series["on"].rates, strict=True)]
            cost = sorted(per_pair)[len(per_pair) // 2]  # median time ratio: off rate / on rate
            tenures = LeaseTenure.objects.filter(key=recorded).count()
        finally:
            LeaseTenure.objects.filter(key=recorded).delete()
    sync_scope()
    on, off = series["on"], series["off"]
    report.add(Row(section, "acquire+release, history off", off.rate, off.cycle_ms(0.5), off.cycle_ms(0.99)))
    report.add(
        Row(
            section,
            "acquire+release, history on",
            on.rate,
            on.cycle_ms(0.5),
            on.cycle_ms(0.99),
            ratio=cost,
            vs="time vs history off",
            target=f"<= {TARGET}x",
            met=cost <= TARGET,
            note=f"{tenures} tenures recorded",
        )
    )
    figures: dict[str, Any] = {"history_cost": round(cost, 3), "tenures": tenures}

    raw = raw_connection()
    superuser = raw.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if superuser and superuser[0]:
        # Two more sessions like Django's, one with the lease table's triggers off: the same two calls.
        with_triggers = psycopg.connect(raw.info.dsn, autocommit=True)
        without = psycopg.connect(raw.info.dsn, autocommit=True)
        without.execute("SET session_replication_role = replica")

        def raw_cycle(conn: psycopg.Connection[Any], key: str) -> Any:
            def one(timer: Timer) -> None:
                row = timer("acquire", conn.execute, ACQUIRE, [key, owner, TTL]).fetchone()
                assert row is not None and row[0]
                timer("release", conn.execute, RELEASE, [key, owner, row[1]])

            return one

        both = interleave(
            {"triggers": raw_cycle(with_triggers, plain), "none": raw_cycle(without, "bench-plain:no-triggers")},
            rounds,
            block,
        )
        pairs = [n / t for t, n in zip(both["triggers"].rates, both["none"].rates, strict=True)]
        trigger_cost = sorted(pairs)[len(pairs) // 2]
        with_triggers.close()
        without.close()
        report.add(
            Row(
                section,
                "SQL functions, history off, vs triggers off",
                both["triggers"].rate,
                both["triggers"].cycle_ms(0.5),
                both["triggers"].cycle_ms(0.99),
                ratio=trigger_cost,
                vs="time vs triggers off",
                note="the hand-off/history trigger when nothing is recorded",
            )
        )
        figures["trigger_cost_when_off"] = round(trigger_cost, 3)
    connection.close()
    return figures


def main() -> None:
    import argparse

    from common import DEFAULT_JSON, HEADER, OWNER, bench_database, installed_apps, run_meta, setup_django

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--block", type=float, default=0.25)
    args = parser.parse_args()
    database, where = bench_database()
    setup_django(database, installed_apps())
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    report = Report(run_meta(where, False, args.rounds, args.block))
    print(HEADER)
    figures = run(report, args.rounds, args.block, OWNER)
    report.details["history"] = figures
    report.meta["total_seconds"] = 0
    report.finish(DEFAULT_JSON.with_name("history.json"))


if __name__ == "__main__":
    main()
