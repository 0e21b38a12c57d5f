"""The stress harness in CI mode, and the checker shown to catch every violation it looks for.

A checker that cannot fail proves nothing: each hand-made bad history below breaks exactly one
property and must be reported with that property's kind; the good history must pass.
"""

from __future__ import annotations

import pytest
from django.db import connections

from stress.checker import AuditRow, Op, Report, WriteRow, check
from stress.harness import Result, run, short_configs

pytestmark = pytest.mark.chaos


def server_url() -> str:
    """URL of the server the test database lives on (the harness creates its own databases there)."""
    s = connections["default"].settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgresql://{auth}@{s['HOST'] or 'localhost'}:{s['PORT'] or 5432}/{s['NAME']}"


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.django_db(transaction=True)
def test_short_mode_has_no_violations() -> None:
    """``python -m stress --short``: three fixed seeds, one of them terminating backends as it runs."""
    results: list[Result] = [run(config) for config in short_configs(server_url())]
    for result in results:
        assert result.report.ok, result.describe()
        counts = result.report.counts
        # The schedules exercised what the checks are about, not just idle workers.
        assert counts.get("acquire:ok", 0) > 20, result.describe()
        assert counts.get("write:ok", 0) > 0, result.describe()
        assert counts.get("write:fail", 0) > 0, result.describe()  # stale holders were fenced out
        assert counts.get("renew:fail", 0) + counts.get("release:fail", 0) > 0, result.describe()
        assert sum(result.counters.values()) == len(result.writes) > 0
    # A loaded machine lapses more of the short leases before their writes (4 writes landed in one
    # seed at load 19): the three seeds together, not each, must land more than a handful.
    assert sum(result.report.counts.get("write:ok", 0) for result in results) > 5
    chaos = results[2]
    assert chaos.terminated > 0
    assert sum(v for k, v in chaos.report.counts.items() if k.endswith(":unknown")) > 0, chaos.describe()


# ---- hand-made histories -------------------------------------------------------------------


def acq(worker: str, epoch: int, invoke: float, complete: float, granted_at: float, ttl: float = 1.0) -> Op:
    return Op(
        worker,
        "k",
        "acquire",
        invoke,
        complete,
        "ok",
        epoch=epoch,
        server_time=granted_at,
        expires_at=granted_at + ttl,
        ttl=ttl,
    )


def audit(*rows: tuple[str | None, int, float | None, float | None]) -> list[AuditRow]:
    """Audit rows for key ``k`` from (owner, epoch, acquired_at, expires_at), old values chained."""
    out: list[AuditRow] = []
    old_owner: str | None = None
    old_epoch = 0
    for seq, (owner, epoch, acquired_at, expires_at) in enumerate(rows, 1):
        out.append(AuditRow(seq, "k", owner, epoch, acquired_at, expires_at, old_owner, old_epoch))
        old_owner, old_epoch = owner, epoch
    return out


def good_history() -> tuple[list[Op], list[AuditRow], list[WriteRow], dict[str, int]]:
    """w0 holds epoch 1, writes, releases (epoch 2); w1 acquires epoch 3, writes; w2's acquire is unknown."""
    ops = [
        acq("w0", 1, 0.0, 0.1, 100.0),
        Op("w0", "k", "write", 0.2, 0.3, "ok", epoch=1, tag="a"),
        Op("w0", "k", "renew", 0.31, 0.32, "ok", epoch=1, expires_at=101.5, ttl=1.2),
        Op("w0", "k", "release", 0.4, 0.5, "ok", epoch=1),
        Op("w2", "k", "acquire", 0.45, None, "unknown", cause="killed"),
        acq("w1", 4, 2.6, 2.7, 102.6),
        Op("w1", "k", "write", 2.8, 2.9, "ok", epoch=4, tag="b"),
        Op("w0", "k", "write", 3.0, 3.1, "fail", cause="not_owner", epoch=1, tag="c"),
        Op("w0", "k", "inspect", 3.2, 3.3, "ok", epoch=4, status="held", owner="w1"),
    ]
    rows = audit(
        ("w0", 1, 100.0, 101.0),
        ("w0", 1, 100.0, 101.5),
        (None, 2, None, None),
        ("w2", 3, 100.5, 101.5),  # the unknown acquire did happen
        ("w1", 4, 102.6, 103.6),
    )
    writes = [WriteRow("a", "k", 1, 1), WriteRow("b", "k", 4, 2)]
    return ops, rows, writes, {"k": 2}


def test_a_good_history_passes() -> None:
    report = check(*good_history())
    assert report.ok, report.render()
    assert report.counts["total"] == 9


def _bad(kind: str) -> Report:
    ops, rows, writes, counters = good_history()
    if kind == "duplicate_epoch":
        ops.append(acq("w3", 4, 5.0, 5.1, 105.0))
        return check(ops)
    if kind == "grant_time_order":
        ops.append(acq("w3", 5, 5.0, 5.1, 102.0))  # epoch 5 granted "before" epoch 4 in server time
        return check(ops)
    if kind == "realtime_order":
        ops.append(acq("w3", 3, 5.0, 5.1, 200.0))  # invoked after epoch 4 was granted, got a lower epoch
        return check(ops)
    if kind == "stale_renew_accepted":
        ops.append(Op("w0", "k", "renew", 5.0, 5.1, "ok", epoch=1, expires_at=200.0, ttl=1.0))
        return check(ops)
    if kind == "stale_write_accepted":
        ops[7] = Op("w0", "k", "write", 3.0, 3.1, "ok", epoch=1, tag="c")
        writes.append(WriteRow("c", "k", 1, 3))
        return check(ops, rows, writes, {"k": 3})
    if kind == "overlap":
        ops[5] = acq("w1", 2, 0.2, 0.3, 100.9)  # takeover while w0's epoch 1 runs until 101.0
        return check([*ops[:2], ops[5]])
    if kind == "overlap_after_renewal":
        ops[5] = acq("w1", 2, 0.4, 0.5, 101.2)  # after the grant's expiry, before the renewed one
        return check(ops[:3] + ops[5:6])
    if kind == "overlap_on_server":
        # w1's acquire never returned (unknown), but the server record shows it took over while
        # w0's epoch 1 still ran: an unknown outcome that produced a second holder.
        ops = [acq("w0", 1, 0.0, 0.1, 100.0), Op("w1", "k", "acquire", 0.2, None, "unknown", cause="killed")]
        return check(ops, audit(("w0", 1, 100.0, 101.0), ("w1", 2, 100.5, 101.5)))
    if kind == "phantom_grant":
        ops[4] = Op("w2", "k", "acquire", 0.45, 0.46, "fail", cause="not_acquirable")
        return check(ops, rows, writes, counters)
    if kind == "lost_grant":
        return check(ops, rows[:-1], writes, counters)
    if kind == "epoch_regression":
        rows.append(AuditRow(6, "k", "w1", 3, 102.6, 103.6, "w1", 4))
        return check(ops, rows, writes, counters)
    if kind == "fence_order":
        writes = [WriteRow("a", "k", 1, 2), WriteRow("b", "k", 4, 1)]
        return check(ops, rows, writes, counters)
    if kind == "lost_update":
        return check(ops, rows, writes, {"k": 1})
    if kind == "lost_write":
        return check(ops, rows, writes[:1], {"k": 1})
    if kind == "phantom_write":
        writes.append(WriteRow("c", "k", 1, 3))  # its writer was told it was refused
        return check(ops, rows, writes, {"k": 3})
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("duplicate_epoch", "duplicate_epoch"),
        ("grant_time_order", "grant_time_order"),
        ("realtime_order", "realtime_order"),
        ("stale_renew_accepted", "realtime_order"),
        ("stale_write_accepted", "realtime_order"),
        ("overlap", "overlap"),
        ("overlap_after_renewal", "overlap"),
        ("overlap_on_server", "overlap"),
        ("phantom_grant", "phantom_grant"),
        ("lost_grant", "lost_grant"),
        ("epoch_regression", "epoch_regression"),
        ("fence_order", "fence_order"),
        ("lost_update", "lost_update"),
        ("lost_write", "lost_write"),
        ("phantom_write", "phantom_write"),
    ],
)
def test_the_checker_catches(case: str, kind: str) -> None:
    report = _bad(case)
    assert kind in report.kinds(), report.render()
    assert not report.ok
    rendered = report.render()
    assert kind in rendered
    assert "-> ok" in rendered or "-> fail" in rendered or "audit" in rendered or kind in rendered


def test_clock_dependent_properties_are_reported_apart() -> None:
    report = _bad("overlap")
    assert report.safe and not report.ok
    assert {v.kind for v in report.clock_violations} == {"overlap"}


def test_unknown_outcomes_may_have_happened_but_never_twice() -> None:
    """An acquire of unknown outcome explains one grant nobody was told about, not two."""
    ops, rows, writes, counters = good_history()
    assert check(ops, rows, writes, counters).ok  # w2's grant is explained by its unknown acquire
    rows.append(AuditRow(6, "k", "w2", 5, 104.0, 105.0, "w1", 4))
    report = check(ops, rows, writes, counters)
    assert report.kinds() == {"phantom_grant"}, report.render()


def test_a_killed_writer_may_or_may_not_have_written() -> None:
    ops, rows, writes, counters = good_history()
    ops.append(Op("w1", "k", "write", 4.0, None, "unknown", cause="killed", epoch=4, tag="d"))
    assert check(ops, rows, writes, counters).ok
    assert check(ops, rows, [*writes, WriteRow("d", "k", 4, 3)], {"k": 3}).ok
