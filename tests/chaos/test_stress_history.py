"""The lease history of a stress run against the harness's own record of grants, one to one.

The check is shown to fail on each kind of mismatch (hand-made histories), then run on a real
stress run with every key recorded.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from stress.checker import Op
from stress.tenures import TenureRow, check_tenures


def grant(worker: str, epoch: int, outcome: str = "ok") -> Op:
    return Op(worker, "k", "acquire", 0.0, 0.1, outcome, epoch=epoch if outcome == "ok" else None)  # type: ignore[arg-type]


def release(worker: str, epoch: int, outcome: str = "ok") -> Op:
    return Op(worker, "k", "release", 0.2, 0.3, outcome, epoch=epoch)  # type: ignore[arg-type]


def tenure(owner: str, epoch: int, granted: float, ended: float | None, reason: str | None) -> TenureRow:
    return TenureRow("k", epoch, owner, granted, ended, reason, owner if reason else None)


GOOD_OPS = [grant("w1", 1), release("w1", 1), grant("w2", 3), grant("w3", 0, "unknown"), grant("w1", 4)]
GOOD_TENURES = [
    tenure("w1", 1, 100.0, 101.0, "released"),
    tenure("w2", 3, 102.0, 103.0, "lapsed"),  # lapsed at 103.0, taken over by w1 at 104.0
    tenure("w1", 4, 104.0, None, None),
]


def kinds(ops: list[Op], tenures: list[TenureRow]) -> set[str]:
    return {v["kind"] for v in check_tenures(ops, tenures)}


def test_a_matching_history_passes() -> None:
    assert check_tenures(GOOD_OPS, GOOD_TENURES) == []
    # A tenure whose grant the client could not learn of (w3's unknown acquire) is allowed, by that owner.
    ended = [*GOOD_TENURES[:2], tenure("w1", 4, 104.0, 105.0, "lapsed"), tenure("w3", 6, 106.0, None, None)]
    assert check_tenures(GOOD_OPS, ended) == []


@pytest.mark.parametrize(
    ("tenures", "kind"),
    [
        (GOOD_TENURES[1:], "grant_not_recorded"),
        ([GOOD_TENURES[0], replace(GOOD_TENURES[1], owner="w9"), GOOD_TENURES[2]], "tenure_owner"),
        ([*GOOD_TENURES, tenure("w9", 9, 105.0, None, None)], "tenure_never_granted"),
        ([*GOOD_TENURES, GOOD_TENURES[2]], "tenure_twice"),
        (
            [GOOD_TENURES[0], replace(GOOD_TENURES[1], end_reason="released"), GOOD_TENURES[2]],
            "released_without_release",
        ),
        ([replace(GOOD_TENURES[0], end_reason="lapsed"), *GOOD_TENURES[1:]], "release_recorded_as"),
        (
            [GOOD_TENURES[0], replace(GOOD_TENURES[1], ended_at=None, end_reason=None), GOOD_TENURES[2]],
            "tenure_left_open",
        ),
        ([GOOD_TENURES[0], replace(GOOD_TENURES[1], ended_at=104.5), GOOD_TENURES[2]], "lapse_after_next_grant"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_mismatch_is_caught(tenures: list[TenureRow], kind: str) -> None:
    assert kind in kinds(GOOD_OPS, tenures)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.django_db(transaction=True)
def test_a_stress_runs_history_matches_its_grants_one_to_one() -> None:
    """A stress run (six workers, three keys, backends terminated as it runs) with every key's history
    recorded: each acknowledged grant is one tenure, every tenure a grant someone asked for."""
    from django.db import connections

    from stress.harness import Config, run

    s = connections["default"].settings_dict
    url = f"postgresql://{s['USER']}@{s['HOST'] or 'localhost'}:{s['PORT'] or 5432}/{s['NAME']}"
    result = run(Config(url, seed=11, workers=6, keys=3, seconds=12, terminate_every=0.7))
    assert result.report.ok, result.describe()
    granted = [op for op in result.ops if op.op == "acquire" and op.outcome == "ok"]
    assert len(granted) > 50, result.describe()
    assert len(result.tenures) >= len(granted)
    assert {(t.key, t.epoch) for t in result.tenures} >= {(op.key, op.epoch) for op in granted}
    reasons = {t.end_reason for t in result.tenures}
    assert {"released", "lapsed"} <= reasons, reasons
    unknown = sum(op.op == "acquire" and op.outcome == "unknown" for op in result.ops)
    print(
        f"\nstress history: {len(granted)} acknowledged grants, {unknown} unknown acquires, "
        f"{len(result.tenures)} tenures"
    )
