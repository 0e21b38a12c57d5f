"""Fenced save vs plain save, side by side on one connection (issue target: <= 1.3x).

Interleaves blocks of plain saves (``save(unfenced=True)``) and fenced saves (``save(fence=grant)``)
of the same model (the test app's ``Invoice``), so load drifts hit both alike; prints per-save
times and the ratio. ``benchmarks/bench.py`` runs the same measurement as one row of its table.
DATABASE_URL, else the embedded server. Usage: python benchmarks/fenced_save.py [rounds]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

from bench import Cycle, Timer, bench_database, installed_apps, interleave, ratio, setup_django


def fenced_and_plain_cycles(owner: str) -> tuple[Cycle, Cycle, dict[str, int]]:
    """A plain-save cycle, a fenced-save cycle (each one save of an existing row) and their statement counts.

    The fenced row's lease is held by ``owner`` (600 s TTL) for the rest of the process.
    """
    from bench import count_statements

    from pg_lease_django import Lease
    from tests.testapp.models import Invoice

    fenced_key = "bench:fenced-save"
    grant = Lease.objects.acquire(fenced_key, owner, ttl=600)
    assert grant is not None, f"{fenced_key} is held by another owner"
    fenced_row = Invoice.objects.filter(account=fenced_key).first() or Invoice(account=fenced_key)
    fenced_row.save(fence=grant)
    plain_row = Invoice.objects.filter(account="bench:plain-save").first() or Invoice(account="bench:plain-save")
    plain_row.save(unfenced=True)
    counter = [0]

    def plain(t: Timer) -> None:
        counter[0] += 1
        plain_row.amount = counter[0]
        t("op", plain_row.save, unfenced=True)

    def fenced(t: Timer) -> None:
        counter[0] += 1
        fenced_row.amount = counter[0]
        t("op", fenced_row.save, fence=grant)

    statements = {
        "plain": count_statements(lambda: plain(Timer())),
        "fenced": count_statements(lambda: fenced(Timer())),
    }
    return plain, fenced, statements


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    database, where = bench_database()
    setup_django(database, installed_apps())
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    plain, fenced, statements = fenced_and_plain_cycles("bench-fenced-save")
    series: dict[str, Any] = interleave({"plain": plain, "fenced": fenced}, rounds, 0.4)
    p, f = series["plain"], series["fenced"]
    print(f"database: {where}")
    print(f"plain save   {1e3 / p.rate:.3f} ms/save  ({p.rate:.0f}/s), {statements['plain']} statement(s)")
    print(f"fenced save  {1e3 / f.rate:.3f} ms/save  ({f.rate:.0f}/s), {statements['fenced']} statement(s)")
    print(f"fenced / plain = {1 / ratio(f, p):.2f}x time per save (target <= 1.3x)")


if __name__ == "__main__":
    main()
