"""History-checked failover runs (issue 16): the stress harness while the primary is SIGKILLed and the
standby promoted, again and again (stress/failover.py; ``make stress-failover`` for the long run).

- CI: a synchronous cluster, 3 promotions, the whole history checked: no acknowledged grant lost,
  no epoch going back, no epoch granted twice, no stale fenced write accepted;
- slow: an asynchronous cluster (standby cut off 1 s before each kill): acknowledged grants lost;
  the same with ``leases advance-epochs`` on each promoted server before clients get in: no
  violation;
- the checker's failover additions, shown to catch what they look for on hand-made histories.

Real servers and client processes (devkit/pgcluster.py, stress/harness.py); skipped where no
PostgreSQL server binaries with ``pg_basebackup`` are found.
"""

from __future__ import annotations

import pytest

from devkit.pgcluster import find_bindir
from stress.checker import AuditRow, Op, WriteRow, check, summarize
from stress.failover import FailoverConfig, FailoverResult, run_failover
from stress.harness import django_database

pytestmark = pytest.mark.cluster

BINDIR = find_bindir()
needs_binaries = pytest.mark.skipif(BINDIR is None, reason="no PostgreSQL server binaries with pg_basebackup")


def _print(result: FailoverResult, *, full: bool = True) -> None:
    print("\n" + result.describe(full=full))


def _served_after_every_failover(result: FailoverResult) -> None:
    """Clients got grants from every promoted server: the load went on across each failover."""
    kills = [promotion.killed_at for promotion in result.promotions]
    for start, end in zip(kills, [*kills[1:], float("inf")], strict=True):
        granted = [
            op
            for op in result.result.ops
            if op.op == "acquire" and op.outcome == "ok" and start < op.invoke and (op.complete or 0) < end
        ]
        assert granted, f"no grant between the kill at {start} and the next one"


@pytest.mark.slow
@pytest.mark.soak
@needs_binaries
def test_synchronous_failovers_under_load_lose_nothing_and_never_double_grant() -> None:
    """5 workers on 3 keys; the primary SIGKILLed 3 times mid-load, the standby promoted each time and a
    new one made from the new primary. The whole history (about 800 operations) checks clean."""
    result = run_failover(
        FailoverConfig(synchronous=True, promotions=3, seed=16, load_min=0.5, load_max=1.0, min_changes=15)
    )
    _print(result)
    assert result.ok, result.describe()
    assert len(result.promotions) == 3
    assert set(result.summary.values()) == {0}, result.summary
    assert result.result.report.losses == []
    counts = result.result.report.counts
    assert counts.get("acquire:ok", 0) > 30 and counts.get("write:ok", 0) > 5, counts
    assert counts.get("write:fail", 0) > 0, counts  # stale holders were fenced out
    # The kills landed mid-load: some operations were cut off (indeterminate).
    assert sum(n for kind, n in counts.items() if kind.endswith(":unknown")) > 0, counts
    _served_after_every_failover(result)


@pytest.mark.slow
@pytest.mark.soak
@needs_binaries
def test_asynchronous_failovers_lose_grants_and_advance_epochs_closes_the_gap() -> None:
    """The standby cut off the primary's WAL 1 s before each of 2 kills: acknowledged grants are lost.
    With ``leases advance-epochs --by 1000000`` on each promoted server before clients get in, the
    losses stay but no epoch is granted again, none goes back, no stale write is accepted."""
    gap = run_failover(FailoverConfig(synchronous=False, promotions=2, seed=17, lag=1.0))
    _print(gap, full=False)
    assert gap.summary["acknowledged_grants_lost"] > 0, gap.describe()

    remedied = run_failover(FailoverConfig(synchronous=False, promotions=2, seed=18, lag=1.0, advance_by=1_000_000))
    _print(remedied)
    assert remedied.ok, remedied.describe()
    assert remedied.summary["acknowledged_grants_lost"] > 0  # lost all the same, but harmless
    assert {name: n for name, n in remedied.summary.items() if name != "acknowledged_grants_lost"} == {
        "double_grants": 0,
        "epoch_regressions": 0,
        "stale_fenced_writes_accepted": 0,
        "stale_renewals_or_releases_accepted": 0,
        "other": 0,
    }
    advances = [op for op in remedied.result.ops if op.op == "advance"]
    assert len(advances) == 2 * 3  # one per key and promotion
    assert max(row.epoch for row in remedied.result.audit) > 2_000_000


# ---- the checker's failover additions, on hand-made histories -------------------------------------


def acq(worker: str, epoch: int, invoke: float, granted_at: float = 100.0, key: str = "k") -> Op:
    return Op(
        worker,
        key,
        "acquire",
        invoke,
        invoke + 0.01,
        "ok",
        epoch=epoch,
        server_time=granted_at,
        expires_at=granted_at + 1,
        ttl=1,
    )


def chain(*rows: tuple[str | None, int, float | None, float | None]) -> list[AuditRow]:
    """Audit rows of key ``k`` from (owner, epoch, acquired_at, expires_at), old values chained."""
    out: list[AuditRow] = []
    old_owner: str | None = None
    old_epoch = 0
    for seq, (owner, epoch, acquired_at, expires_at) in enumerate(rows, 1):
        out.append(AuditRow(seq, "k", owner, epoch, acquired_at, expires_at, old_owner, old_epoch))
        old_owner, old_epoch = owner, epoch
    return out


def advance(by: int, at: float, key: str = "k") -> Op:
    return Op("operator", key, "advance", at, at + 0.5, "ok", by=by)


def test_an_operators_advance_explains_the_jump_of_every_epoch() -> None:
    """w0 holds epoch 2; the operator advances by 1000 (w0 still holds, at 1002, refused thereafter);
    w1 gets 1003. Clean; the same record without the advance in the history is an epoch regression."""
    ops = [
        acq("w0", 1, 0.0),
        acq("w0", 2, 0.1, 100.1),
        advance(1000, 1.0),
        Op("w0", "k", "renew", 2.0, 2.01, "fail", cause="epoch_mismatch", epoch=2, ttl=1),
        acq("w1", 1003, 3.0, 102.0),
        Op("w1", "k", "inspect", 3.1, 3.11, "ok", epoch=1003, status="held", owner="w1"),
    ]
    rows = chain(("w0", 1, 100.0, 101.0), ("w0", 2, 100.1, 101.1), ("w0", 1002, 100.1, 101.1), ("w1", 1003, 102, 103))
    assert check(ops, rows).ok, check(ops, rows).render()
    without = check([op for op in ops if op.op != "advance"], rows)
    assert without.kinds() == {"epoch_regression"}, without.render()
    # An advance by another amount does not explain it either.
    assert "epoch_regression" in check([*ops[:2], advance(999, 1.0), *ops[3:]], rows).kinds()


def test_a_keys_first_grant_at_the_advanced_floor_is_explained() -> None:
    ops = [advance(1000, 0.0), acq("w0", 1001, 1.0)]
    rows = chain(("w0", 1001, 100.0, 101.0))
    assert check(ops, rows).ok
    assert "epoch_regression" in check(ops[1:], rows).kinds()


def test_asynchronous_losses_are_counted_but_a_reused_epoch_is_a_violation() -> None:
    """w0 was told epoch 2 (on the old primary); the promoted server never had it. Counted as a loss
    with ``grants_durable=False``, a violation otherwise. Once w0 was also told epoch 3 and the
    promoted server grants epoch 2 to w1, whose fenced write at 2 is accepted: violations either way,
    each in its summary count."""
    ops = [acq("w0", 1, 0.0), acq("w0", 2, 0.1, 100.1)]
    rows = chain(("w0", 1, 100.0, 101.0))
    durable = check(ops, rows)
    assert durable.kinds() == {"lost_grant"}
    allowed = check(ops, rows, grants_durable=False)
    assert allowed.ok and [v.kind for v in allowed.losses] == ["lost_grant"], allowed.render()
    assert "losses allowed by the run" in allowed.render()
    assert summarize(allowed)["acknowledged_grants_lost"] == 1

    reused = [
        *ops,
        acq("w0", 3, 0.2, 100.2),
        acq("w1", 2, 5.0, 105.0),
        Op("w1", "k", "write", 5.1, 5.2, "ok", epoch=2, tag="late"),
    ]
    rows = chain(("w0", 1, 100.0, 101.0), ("w1", 2, 105.0, 106.0))
    report = check(reused, rows, [WriteRow("late", "k", 2, 1)], {"k": 1}, grants_durable=False)
    assert {"regranted_epoch", "duplicate_epoch", "realtime_order"} <= report.kinds(), report.render()
    assert [(v.kind, v.epoch) for v in report.losses] == [("lost_grant", 3)]
    assert summarize(report) == {
        "acknowledged_grants_lost": 2,  # epoch 3 (lost) and epoch 2 (lost, then granted to w1)
        "double_grants": 1,  # epoch 2, reported from the clients and from the server record
        "epoch_regressions": 2,  # w1's acquire got 2 after w0 had been granted 3 (and at a later server time)
        "stale_fenced_writes_accepted": 1,  # w1's write at epoch 2, after 3 was granted
        "stale_renewals_or_releases_accepted": 0,
        "other": 0,
    }


def test_an_epoch_granted_again_to_the_same_owner_is_a_double_grant() -> None:
    """w0's acknowledged epoch 2 is lost; the promoted server grants epoch 2 to w0 again (another
    grant: another server time). Not hidden by the owner being the same."""
    ops = [acq("w0", 1, 0.0), acq("w0", 2, 0.1, 100.1), acq("w0", 2, 5.0, 105.0)]
    rows = chain(("w0", 1, 100.0, 101.0), ("w0", 2, 105.0, 106.0))
    report = check(ops, rows, grants_durable=False)
    assert {"regranted_epoch", "duplicate_epoch"} <= report.kinds(), report.render()
    assert summarize(report)["acknowledged_grants_lost"] == 1
    assert summarize(report)["double_grants"] == 1


def test_summary_counts_a_stale_renewal_apart_from_stale_writes() -> None:
    ops = [acq("w0", 3, 0.0), acq("w1", 4, 1.0), Op("w0", "k", "renew", 2.0, 2.01, "ok", epoch=3, ttl=1)]
    summary = summarize(check(ops))
    assert summary["stale_renewals_or_releases_accepted"] == 1
    assert summary["stale_fenced_writes_accepted"] == 0


def test_summary_counts_an_inspect_that_went_back_as_an_epoch_regression() -> None:
    ops = [acq("w0", 5, 0.0), Op("w1", "k", "inspect", 1.0, 1.01, "ok", epoch=3, status="held", owner="w0")]
    assert summarize(check(ops)) == {
        "acknowledged_grants_lost": 0,
        "double_grants": 0,
        "epoch_regressions": 1,
        "stale_fenced_writes_accepted": 0,
        "stale_renewals_or_releases_accepted": 0,
        "other": 0,
    }


def test_an_unconfirmed_acquire_is_indeterminate() -> None:
    """An acquire answered with UnconfirmedCommitError may or may not have happened: the promoted
    server having it, or not, is fine; a second grant it did not explain is not."""
    ops = [acq("w0", 1, 0.0), Op("w1", "k", "acquire", 1.0, 1.1, "unknown", cause="unconfirmed: canceling wait")]
    assert check(ops, chain(("w0", 1, 100.0, 100.5))).ok
    assert check(ops, chain(("w0", 1, 100.0, 100.5), ("w1", 2, 101.0, 102.0))).ok
    phantom = chain(("w0", 1, 100.0, 100.5), ("w1", 2, 101.0, 102.0), ("w1", 3, 102.5, 103.0))
    assert check(ops, phantom).kinds() == {"phantom_grant"}


def test_a_multi_host_url_becomes_a_multi_host_django_database() -> None:
    url = "postgresql://postgres@127.0.0.1:5001,127.0.0.1:5002/db?target_session_attrs=read-write&connect_timeout=3"
    assert django_database(url) == {
        "NAME": "db",
        "USER": "postgres",
        "PASSWORD": "",
        "HOST": "127.0.0.1,127.0.0.1",
        "PORT": "5001,5002",
        "OPTIONS": {"target_session_attrs": "read-write", "connect_timeout": "3"},
    }
    assert django_database("postgresql://postgres@127.0.0.1:5001/db") is None
