"""``python -m stress failover``: the stress harness against a replicated PostgreSQL whose primary keeps dying.

A primary and a streaming standby on this machine (devkit/pgcluster.py: ``initdb``, ``pg_basebackup
-R``, loopback ports). The workers of :mod:`stress.harness` reach it the way a project on a
replicated PostgreSQL does: Django with a multi-host ``HOST``/``PORT`` and
``target_session_attrs=read-write``. While they run, the nemesis, ``promotions`` times:

1. lets the load run (at least ``min_changes`` lease changes committed on the current primary,
   and a random ``load_min``-``load_max`` seconds);
2. for an asynchronous cluster with ``lag``: cuts the standby off the primary's WAL for ``lag``
   seconds first, the primary acknowledging alone (a WAL sender stalled behind a slow network);
3. SIGKILLs the primary's whole process group (a crashed host), mid-load;
4. promotes the standby (``pg_ctl promote``) and, as a failover manager does while no standby is
   left, clears its ``synchronous_standby_names``;
5. with ``advance_by`` (the remedy for an asynchronous cluster): before any client gets in, runs
   ``manage.py leases advance-epochs --by N`` on the promoted server. Clients are kept away by
   ``default_transaction_read_only = on`` set on the standby before the kill: libpq's
   ``target_session_attrs=read-write`` refuses such a server; the operator's own connection turns
   it off for its session, and the setting is reset once the advance has committed;
6. makes a new standby from the new primary (``pg_basebackup -R``, on the dead primary's port);
   for a synchronous cluster names it in ``synchronous_standby_names`` again once it streams, and
   waits until it has flushed everything (:meth:`devkit.pgcluster.Cluster.rebuild_standby`).

Then the workers stop, and :func:`stress.checker.check` checks the whole history against the
last primary's record (the audit trigger's table, replicated with the lease rows).
:func:`stress.checker.summarize` counts what a failover must never do: acknowledged grants lost,
epochs going back, an epoch granted twice, a stale fenced write accepted. Synchronous: every count
must be 0. Asynchronous: acknowledged grants the promoted server missed are measured
(``grants_durable=False``: losses, not violations), and reusing their epochs is a violation,
which the remedy must prevent.

``python -m stress failover --suite`` (``make stress-failover``) runs the three cases of
docs/high-availability.md ("History-checked failover runs"): synchronous with 10 promotions,
asynchronous with a lag and no remedy (the gap, measured), asynchronous with the lag and the
remedy; exit status 1 if the synchronous run or the remedied run has any violation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.pgcluster import Cluster, Node, find_bindir, poll

from .checker import Op, summarize
from .harness import Config, Result, Run, _run_django, elapsed

AUDIT_COUNT = "SELECT count(*) FROM stress_lease_audit"


@dataclass
class FailoverConfig:
    """One failover run.

    Attributes:
        synchronous: synchronous replication (``synchronous_standby_names`` names the standby).
        promotions: kills of the primary (each followed by a promotion and a new standby).
        seed: the workers' schedules and the nemesis's timing.
        workers, keys, ttl_min, ttl_max, long_pause: the load (see :class:`stress.harness.Config`).
        load_min, load_max: seconds of load between a ready standby and the next kill.
        min_changes: lease changes the current primary must have committed before the next kill.
        lag: asynchronous only: seconds the standby is cut off the primary's WAL before each kill.
        advance_by: asynchronous remedy: ``leases advance-epochs --by N`` on each promoted server
            before clients get in (None: no remedy).
        bindir: the PostgreSQL server binaries (default: :func:`devkit.pgcluster.find_bindir`).
        keep_database: leave the cluster's directory in place (to inspect it after a failure).
    """

    synchronous: bool = True
    promotions: int = 10
    seed: int = 1
    workers: int = 5
    keys: int = 3
    ttl_min: float = 0.1
    ttl_max: float = 1.5
    long_pause: float = 0.05
    load_min: float = 1.0
    load_max: float = 2.5
    min_changes: int = 20
    lag: float = 0.0
    advance_by: int | None = None
    bindir: Path | None = None
    keep_database: bool = False

    @property
    def name(self) -> str:
        """A short description: replication mode, lag, remedy."""
        if self.synchronous:
            return "synchronous"
        return (
            "asynchronous"
            + (f", lag {self.lag:g}s" if self.lag else "")
            + (f", advance-epochs --by {self.advance_by}" if self.advance_by else ", no remedy")
        )


@dataclass
class Promotion:
    """What one failover took (seconds, client monotonic clock)."""

    killed_at: float
    changes_before: int = 0  # lease changes the killed primary had committed in its last load period
    promoted_after: float = 0.0  # kill -> the promoted server accepts writes
    advanced_after: float | None = None  # kill -> the operator's advance committed
    first_change_after: float = 0.0  # kill -> the first lease change a client committed on the promoted server
    standby_after: float = 0.0  # kill -> a new standby streams (synchronous: named, sync, caught up)


@dataclass
class FailoverResult:
    """A finished failover run: the harness's result and what the nemesis did."""

    config: FailoverConfig
    result: Result
    promotions: list[Promotion] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def summary(self) -> dict[str, int]:
        """:func:`stress.checker.summarize` of the report."""
        return summarize(self.result.report)

    @property
    def ok(self) -> bool:
        """No violation at all (losses allowed by an asynchronous run aside)."""
        return self.result.report.ok

    def acknowledged_grants(self) -> int:
        return sum(1 for op in self.result.ops if op.op == "acquire" and op.outcome == "ok")

    def lost_per_promotion(self) -> list[int]:
        """Acknowledged grants missing from the record, by the failover that lost them (the first
        kill after the grant was acknowledged)."""
        counts = [0] * len(self.promotions)
        kills = [promotion.killed_at for promotion in self.promotions]
        for loss in self.result.report.losses + self.result.report.violations:
            if loss.kind not in ("lost_grant", "regranted_epoch") or not loss.ops:
                continue
            done = loss.ops[0].complete or loss.ops[0].invoke
            later = [i for i, killed in enumerate(kills) if killed >= done]
            if later:
                counts[later[0]] += 1
        return counts

    def describe(self, *, full: bool = True) -> str:
        """A few lines for people: the counts, the failovers, and (``full``) the checker's report if not ok."""
        counts = self.result.report.counts
        unknown = sum(v for k, v in counts.items() if k.endswith(":unknown"))
        unconfirmed = sum(1 for op in self.result.ops if (op.cause or "").startswith("unconfirmed"))
        lines = [
            f"failover run ({self.config.name}), seed {self.config.seed}: {'ok' if self.ok else 'VIOLATIONS'}; "
            f"{len(self.promotions)} promotions in {self.seconds:.0f}s",
            f"  {counts.get('total', 0)} operations ({unknown} indeterminate: connection lost, or commit "
            f"unconfirmed ({unconfirmed})), {self.acknowledged_grants()} acknowledged grants, "
            f"{len(self.result.audit)} lease changes on the last primary, "
            f"{len(self.result.writes)} fenced writes accepted, "
            f"{counts.get('write:fail', 0)} refused; {self.result.refused_connections} connection attempts "
            "refused (no server accepting writes)",
            "  " + ", ".join(f"{name} {value}" for name, value in self.summary.items()),
        ]
        report = self.result.report
        if not report.ok:
            kinds: dict[str, int] = {}
            for violation in report.violations + report.clock_violations:
                kinds[violation.kind] = kinds.get(violation.kind, 0) + 1
            lines.append("  violations by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        losses = self.result.report.losses
        if losses:
            grants = sum(1 for v in losses if v.kind == "lost_grant")
            writes = sum(1 for v in losses if v.kind == "lost_write")
            lines.append(
                f"  lost by the asynchronous failovers: {grants} acknowledged grants (their epochs not "
                f"granted again), {writes} acknowledged fenced writes; per failover "
                f"{self.lost_per_promotion()}"
            )
        if self.promotions:

            def span(values: list[float]) -> str:
                return f"{min(values):.2f}-{max(values):.2f}s"

            lines.append(
                "  per failover: promoted "
                + span([p.promoted_after for p in self.promotions])
                + " after the kill, first lease change there "
                + span([p.first_change_after for p in self.promotions])
                + (
                    ", advance committed " + span([p.advanced_after for p in self.promotions if p.advanced_after])
                    if self.config.advance_by
                    else ""
                )
                + ", new standby ready "
                + span([p.standby_after for p in self.promotions])
                + f"; {sum(p.changes_before for p in self.promotions)} lease changes before the kills"
            )
        if full and not self.ok:
            lines.append(self.result.describe())
        return "\n".join(lines)


def _count(node: Node, database: str) -> int:
    return int(node.query(AUDIT_COUNT, dbname=database)[0][0])


def _wait_changes(node: Node, database: str, at_least: int, what: str, timeout: float = 120) -> None:
    """Wait until ``node`` has committed at least ``at_least`` lease changes (audit rows) in all."""
    poll(lambda: _count(node, database) >= at_least, timeout=timeout, what=what, interval=0.01)


#: Whether the standby has replayed all it can of what it received. Its WAL cut off mid-record
#: (`Cluster.detach_standby` under load), the received position stays past the last whole record,
#: which replay never reaches (promotion drops the partial one): then done once its startup process
#: waits for more WAL (it has replayed everything before) and no WAL receiver streams any.
REPLAYED_ALL_IT_CAN = """
SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()
    OR (NOT EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming')
        AND EXISTS (SELECT 1 FROM pg_stat_activity WHERE backend_type = 'startup'
                       AND wait_event IN ('RecoveryRetrieveRetryInterval', 'RecoveryWalStream')))
"""


def _wait_replayed_what_it_received(standby: Node) -> None:
    poll(lambda: standby.query(REPLAYED_ALL_IT_CAN)[0][0], timeout=30, what="the standby to replay what it received")


def _set_read_only(node: Node, on: bool) -> None:
    """``default_transaction_read_only`` on ``node`` (server-wide): on, libpq's
    ``target_session_attrs=read-write`` refuses the server, so clients stay away."""
    node.query(
        "ALTER SYSTEM SET default_transaction_read_only = on"
        if on
        else "ALTER SYSTEM RESET default_transaction_read_only"
    )
    node.query("SELECT pg_reload_conf()")
    wanted = "on" if on else "off"
    poll(
        lambda: node.query("SHOW default_transaction_read_only")[0][0] == wanted, timeout=30, what=f"read-only {wanted}"
    )


def advance_epochs(run: Run, node: Node, by: int) -> dict[str, Any]:
    """``manage.py leases advance-epochs --by N --json`` on ``node`` alone (its session read-write
    while the server turns clients away); logs one ``advance`` operation per key; the JSON reply."""
    url = f"postgresql://postgres@127.0.0.1:{node.port}/{run.database}"
    invoke = time.monotonic()
    output = _run_django(
        url,
        "from django.core.management import call_command\n"
        f"call_command('leases', 'advance-epochs', '--by', '{by}', '--json')\n",
        options={"options": "-c default_transaction_read_only=off"},
    )
    complete = time.monotonic()
    run.extra_ops += [Op("operator", key, "advance", invoke, complete, "ok", by=by) for key in run.keys]
    return dict(json.loads(output))


def nemesis(run: Run, cluster: Cluster, config: FailoverConfig, promotions: list[Promotion]) -> None:
    """Kill, promote, (advance,) rebuild, ``config.promotions`` times, while the workers run."""
    rng = random.Random(config.seed)
    for _ in range(config.promotions):
        before = _count(cluster.primary, run.database)
        started = time.monotonic()
        _wait_changes(cluster.primary, run.database, before + config.min_changes, "lease changes on the primary")
        run.stopping.wait(max(0.0, rng.uniform(config.load_min, config.load_max) - (time.monotonic() - started)))
        if not run.alive():
            raise RuntimeError("every worker has exited before the nemesis was done")
        if config.lag and not config.synchronous:
            cluster.detach_standby()
            run.stopping.wait(config.lag)  # the primary acknowledges alone meanwhile
        if config.advance_by:
            _set_read_only(cluster.standby, True)
        changes = _count(cluster.primary, run.database) - before
        cluster.kill_primary()
        promotion = Promotion(killed_at=time.monotonic(), changes_before=changes)
        promotions.append(promotion)
        promoted = cluster.standby
        if config.advance_by:  # what the standby has, all of it replayed: the promoted server starts there
            _wait_replayed_what_it_received(promoted)
            held_back = _count(promoted, run.database)
        cluster.promote(clear_synchronous=True)
        promotion.promoted_after = time.monotonic() - promotion.killed_at
        if config.advance_by:
            advance_epochs(run, promoted, config.advance_by)
            promotion.advanced_after = time.monotonic() - promotion.killed_at
            # No client got in before the advance: the only changes since the standby's last
            # replayed one are the advance's (one per lease row).
            advanced = _count(promoted, run.database) - held_back
            rows = int(promoted.query("SELECT count(*) FROM pg_lease_django_lease", dbname=run.database)[0][0])
            if advanced != rows:
                raise RuntimeError(f"{advanced - rows} lease changes reached the promoted server before the advance")
            _set_read_only(promoted, False)
        at_promotion = _count(promoted, run.database)
        _wait_changes(promoted, run.database, at_promotion + 1, "a client's lease change on the promoted server", 60)
        promotion.first_change_after = time.monotonic() - promotion.killed_at
        cluster.rebuild_standby()
        promotion.standby_after = time.monotonic() - promotion.killed_at
    # Load on the last primary, with its new standby, before the workers stop.
    before = _count(cluster.primary, run.database)
    _wait_changes(cluster.primary, run.database, before + config.min_changes, "lease changes on the last primary")


def run_failover(config: FailoverConfig) -> FailoverResult:
    """Start a cluster, run the workers and the nemesis, check the history; always clean up."""
    bindir = config.bindir or find_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL server binaries with pg_basebackup (see devkit/pgcluster.py)")
    start = time.monotonic()
    cluster = Cluster(synchronous=config.synchronous, bindir=bindir)
    promotions: list[Promotion] = []
    try:
        cluster.start()
        stress = Config(
            cluster.url(),
            seed=config.seed,
            workers=config.workers,
            keys=config.keys,
            # An upper bound: the nemesis stops the workers when it is done.
            seconds=60.0 + config.promotions * 120.0,
            ttl_min=config.ttl_min,
            ttl_max=config.ttl_max,
            long_pause=config.long_pause,
            writes_durable=config.synchronous,
            grants_durable=config.synchronous,
        )
        run = Run(stress)
        run.create_database()
        try:
            run.start()
            try:
                nemesis(run, cluster, config, promotions)
            finally:
                run.stop()
            result = run.finish()
        finally:
            run.join(timeout=5)
            with suppress(Exception):  # the cluster goes anyway
                run.drop_database()
    finally:
        if not config.keep_database:
            cluster.destroy()
    return FailoverResult(config, result, promotions, time.monotonic() - start)


def suite(seed: int, promotions: int, lag: float, advance_by: int) -> list[tuple[FailoverResult, bool]]:
    """The three cases: synchronous; asynchronous with lag, no remedy; the same with the remedy.
    Each with whether its violations fail the suite (not for the unremedied asynchronous run)."""
    cases = [
        (FailoverConfig(synchronous=True, promotions=promotions, seed=seed), True),
        (FailoverConfig(synchronous=False, promotions=promotions, seed=seed + 1, lag=lag), False),
        (FailoverConfig(synchronous=False, promotions=promotions, seed=seed + 2, lag=lag, advance_by=advance_by), True),
    ]
    results = []
    for config, strict in cases:
        result = run_failover(config)
        print(result.describe(full=strict), flush=True)
        results.append((result, strict))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m stress failover [--suite | options]``; exit status 1 on a violation."""
    parser = argparse.ArgumentParser(prog="python -m stress failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="store_true", help="synchronous, asynchronous, asynchronous + remedy")
    parser.add_argument("--async", dest="asynchronous", action="store_true", help="asynchronous replication")
    parser.add_argument("--promotions", type=int, default=10, help="kills of the primary per run (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--lag", type=float, default=None, help="async: seconds cut off before each kill")
    parser.add_argument(
        "--advance-epochs",
        type=int,
        default=None,
        metavar="N",
        help="async: advance-epochs --by N after each promotion",
    )
    parser.add_argument("--keep", action="store_true", help="leave the cluster's directory in place")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    start = time.monotonic()
    if args.suite:
        results = suite(seed, args.promotions, 1.0 if args.lag is None else args.lag, args.advance_epochs or 1_000_000)
        failed = [r.config.name for r, strict in results if strict and not r.ok]
        print(f"failover suite in {elapsed(start)}; violations in: {failed or 'none'}")
        return 1 if failed else 0
    config = FailoverConfig(
        synchronous=not args.asynchronous,
        promotions=args.promotions,
        seed=seed,
        workers=args.workers,
        keys=args.keys,
        lag=args.lag or 0.0,
        advance_by=args.advance_epochs,
        keep_database=args.keep,
    )
    result = run_failover(config)
    print(result.describe(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
