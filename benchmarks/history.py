"""Stage ``history``: what recording a lease's history costs an acquire + release.

Side by side on Django's connection, in interleaved blocks: ``Lease.objects`` acquire + release of a
key whose history is recorded (``PG_LEASE_HISTORY``) against one whose is not (target: at most
1.15x the time). What the lease table's triggers cost when nothing is recorded is the ``single``
stage's second floor line (the same hand-written statements on the lease table and on a plain one).
An earlier version compared the functions with the triggers off for the session
(``session_replication_role = replica``): without the re-check's stamp the grant kept its marker
expiry, so the release was refused (``lapsed``) and wrote nothing, and the "triggers off" side
committed half as often.

Runs in ``benchmarks/bench.py`` (``--only history``), or alone: ``python benchmarks/history.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TTL, Report, Row, Timer, interleave, run_alone

TARGET = 1.15


def run(report: Report, rounds: int, block: float, owner: str) -> dict[str, Any]:
    """Interleave recorded and unrecorded acquire + release; add the rows; return the figures."""
    from django.db import connection
    from django.test import override_settings

    from pg_lease_django import Lease
    from pg_lease_django.models import LeaseTenure
    from pg_lease_django.provisioning.history import sync_scope

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

    connection.close()
    return figures


if __name__ == "__main__":
    run_alone("history", run, __doc__.split("\n\n")[0])
