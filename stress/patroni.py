"""``python -m stress patroni``: the history-checked stress harness against a Patroni cluster.

etcd, two PostgreSQL nodes under Patroni and HAProxy (devkit/patroni_cluster.py). The workers of
:mod:`stress.harness` connect either with the multi-host URL and ``target_session_attrs=read-write``
(``--via hosts``) or through HAProxy (``--via haproxy``). The nemesis, ``failovers`` times, lets the
load run, then applies one fault to the leader, in turn from ``faults``:

- ``kill-postgres``: SIGKILL of the leader's postmaster and every backend (``primary_start_timeout:
  0``: Patroni fails over at once instead of restarting it). Asynchronous with ``lag``: the
  leader's WAL senders are SIGSTOPped ``lag`` seconds first (the leader acknowledges alone, as
  behind a slow network), so the promoted node misses what it acknowledged meanwhile;
- ``kill-patroni``: SIGKILL of the leader's Patroni (its PostgreSQL runs on); the leader key
  expires after ``ttl``; Patroni is started again once the other node leads;
- ``stop``: SIGSTOP of the leader's PostgreSQL until the other node leads, then SIGCONT;
- ``switchover``: ``patronictl switchover --force``; ``failover``: ``patronictl failover --force``.

After each fault it waits for a new leader, a first lease change there, and a healthy cluster (the
old leader rewound and streaming). Then :func:`stress.checker.check` checks the whole history
against the last leader's record; :func:`stress.checker.summarize` counts the violations. With
``callback`` every node runs :mod:`pg_lease_django.patroni` (``pre_promote``, ``on_role_change``,
``on_start``), which advances the epochs after a promotion that may have lost writes.

``python -m stress patroni --suite`` (``make stress-patroni``): the asynchronous ``kill-postgres``
run with lag without the hook, then with it (10 failovers each), then every fault in turn with
``synchronous_mode`` strict, not strict, and asynchronous with the hook; exit status 1 if a run
with the hook or with synchronous replication has a violation.

``python -m stress patroni --switchovers N [--ttls 30,5]`` (``make stress-switchover``): instead, a
``hold()`` and an ``elect()`` leader per TTL through ``N`` planned switchovers, measured from the
clients' own event logs (:mod:`stress.switchover`).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime

from devkit.patroni_cluster import Member, PatroniCluster, children_of, leftovers, missing_programs
from devkit.pgcluster import poll

from .checker import Op, summarize
from .harness import Config, Result, Run, elapsed

AUDIT_COUNT = "SELECT count(*) FROM stress_lease_audit"
FAULTS = ("kill-postgres", "kill-patroni", "stop", "switchover", "failover")


@dataclass
class PatroniConfig:
    """One run: replication mode, hook, faults, client path, load."""

    synchronous: str = "off"  # "off", "on" (synchronous_mode), "strict" (and synchronous_mode_strict)
    callback: bool = True
    failovers: int = 10
    faults: tuple[str, ...] = ("kill-postgres",)
    via: str = "hosts"
    lag: float = 0.0
    seed: int = 1
    workers: int = 5
    keys: int = 3
    load_min: float = 1.0
    load_max: float = 2.5
    min_changes: int = 20
    #: Patroni's bound on what an asynchronous failover may lose (bytes of WAL behind the leader's
    #: last reported position); 64 MiB here, so that the stalled replica is promoted all the same.
    maximum_lag_on_failover: int = 64 * 1024 * 1024

    @property
    def name(self) -> str:
        mode = {"off": "asynchronous", "on": "synchronous_mode", "strict": "synchronous_mode_strict"}[self.synchronous]
        return (
            f"{mode}, {'+'.join(self.faults)}, via {self.via}"
            + (f", lag {self.lag:g}s" if self.lag else "")
            + (", hook" if self.callback else ", no hook")
        )


@dataclass
class PatroniResult:
    config: PatroniConfig
    result: Result
    promotions: int = 0
    seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    promoted_after: list[float] = field(default_factory=list)
    advances: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # the hook's pre_promote decisions
    stuck: str | None = None  # why the nemesis gave up (the cluster did not recover in time)

    @property
    def ok(self) -> bool:
        return self.result.report.ok and self.stuck is None

    def figures(self) -> dict[str, int]:
        """Promotions, operations, acknowledged grants, losses, violations (and the checker's counts)."""
        report = self.result.report
        return {
            "promotions": self.promotions,
            "hook_advances": self.advances,
            "operations": report.counts.get("total", 0),
            "acknowledged_grants": sum(1 for op in self.result.ops if op.op == "acquire" and op.outcome == "ok"),
            "violations": len(report.violations) + len(report.clock_violations),
            **summarize(report),
        }

    def describe(self, *, full: bool = True) -> str:
        lines = [
            f"patroni run ({self.config.name}), seed {self.config.seed}: {'ok' if self.ok else 'VIOLATIONS'}; "
            f"{self.seconds:.0f}s; faults {self.faults}; hook {self.decisions}"
            + (f"; STUCK: {self.stuck}" if self.stuck else ""),
            "  " + ", ".join(f"{k} {v}" for k, v in self.figures().items()),
        ]
        if self.promoted_after:
            lines.append(
                f"  new leader writable {min(self.promoted_after):.2f}-{max(self.promoted_after):.2f}s after the fault"
            )
        if not self.ok:
            kinds: dict[str, int] = {}
            for violation in self.result.report.violations + self.result.report.clock_violations:
                kinds[violation.kind] = kinds.get(violation.kind, 0) + 1
            lines.append("  violations by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
            if full:
                lines.append(self.result.describe())
        return "\n".join(lines)


def _count(cluster: PatroniCluster, member: Member, database: str) -> int:
    return int(cluster.query(member, AUDIT_COUNT, dbname=database)[0][0])


def _leader(cluster: PatroniCluster, *, other_than: Member | None = None) -> Member:
    return cluster.wait_leader(other_than=other_than)


def _walsenders(cluster: PatroniCluster, member: Member) -> list[int]:
    return [int(r[0]) for r in cluster.query(member, "SELECT pid FROM pg_stat_replication")]


def _signal_postgres(member: Member, sig: int) -> None:
    pid = member.postmaster_pid()
    if pid is None:
        return
    for target in [pid, *children_of(pid)]:
        with suppress(ProcessLookupError):
            os.kill(target, sig)


def fault(cluster: PatroniCluster, run: Run, config: PatroniConfig, kind: str, leader: Member) -> Member:
    """Apply ``kind`` to ``leader``; return the new leader once it accepts writes (and the old node is back)."""
    other = next(m for m in cluster.members if m is not leader)
    if kind == "kill-postgres":
        if config.lag and config.synchronous == "off":
            for pid in _walsenders(cluster, leader):
                os.kill(pid, signal.SIGSTOP)  # killed with the rest below
            run.stopping.wait(config.lag)
        killed = leader.kill_postgres()
        # Patroni fails over, or (no replica close enough: maximum_lag_on_failover) restarts it in place.
        return cluster.wait_leader(other_than=leader, restarted_from=killed)
    if kind == "kill-patroni":
        assert leader.process is not None
        leader.process.kill()
        leader.process.wait()
        # As a service manager would, Patroni is started again: once the other node leads, or after
        # the leader key's TTL and a margin if it does not (then the old leader may lead again).
        try:
            new: Member | None = cluster.wait_leader(other_than=leader, timeout=60)
        except AssertionError:
            new = None
        cluster.start_patroni(leader)
        return new or _leader(cluster)
    if kind == "stop":
        _signal_postgres(leader, signal.SIGSTOP)
        try:
            return _leader(cluster, other_than=leader)
        finally:
            _signal_postgres(leader, signal.SIGCONT)
    if kind in ("switchover", "failover"):
        args = ["--force", "--candidate", other.name]
        if kind == "switchover":
            args += ["--leader", leader.name]
        done = cluster.patronictl(kind, *args)
        if done.returncode != 0:
            raise RuntimeError(f"patronictl {kind} failed: {done.stdout}{done.stderr}")
        return _leader(cluster, other_than=leader)
    raise ValueError(kind)


def nemesis(cluster: PatroniCluster, run: Run, config: PatroniConfig, outcome: PatroniResult) -> None:
    rng = random.Random(config.seed)
    index = 0
    # ``failovers`` promotions (a kill that Patroni answered by restarting the leader in place does
    # not count), at most three faults per promotion asked for.
    while outcome.promotions < config.failovers and index < 3 * config.failovers:
        leader = _leader(cluster)
        before = _count(cluster, leader, run.database)
        started = time.monotonic()
        poll(
            lambda: _count(cluster, leader, run.database) >= before + config.min_changes,  # noqa: B023
            timeout=120,
            what="lease changes on the leader",
        )
        run.stopping.wait(max(0.0, rng.uniform(config.load_min, config.load_max) - (time.monotonic() - started)))
        if not run.alive():
            raise RuntimeError("every worker has exited before the nemesis was done")
        kind = config.faults[index % len(config.faults)]
        index += 1
        at = time.monotonic()
        new = fault(cluster, run, config, kind, leader)
        if new is leader:
            outcome.faults["restarted in place"] = outcome.faults.get("restarted in place", 0) + 1
        else:
            outcome.promotions += 1
        outcome.faults[kind] = outcome.faults.get(kind, 0) + 1

        def changed(leader: Member, here: int) -> bool:
            return _count(cluster, leader, run.database) > here

        here = _count(cluster, new, run.database)
        try:
            poll(lambda: changed(new, here), timeout=30, what="a client's lease change on the new leader")  # noqa: B023
        except AssertionError:  # the new leader lost its key meanwhile: wait for the cluster to settle
            new = cluster.wait_healthy(timeout=240)
            here = _count(cluster, new, run.database)
            poll(lambda: changed(new, here), timeout=120, what="a client's lease change on the leader")  # noqa: B023
        outcome.promoted_after.append(time.monotonic() - at)
        cluster.wait_healthy(timeout=240)
    last = _leader(cluster)
    before = _count(cluster, last, run.database)
    poll(
        lambda: _count(cluster, last, run.database) >= before + config.min_changes, timeout=120, what="load at the end"
    )


def hook_advances(cluster: PatroniCluster, run: Run) -> list[Op]:
    """The hook's advances in the run's database, from the nodes' Patroni logs, as an operator's
    ``advance`` operations (one per key each; the checker explains the epoch jumps by them). Their
    times: the log's wall clock moved onto this process's monotonic clock."""
    offset = time.monotonic() - time.time()
    pattern = re.compile(r"^(\S+ \S+),\d+ WARNING: pg_lease_django: advanced \d+ lease\(s\) in (\S+) by (\d+)")
    advances = []
    for member in cluster.members:
        for line in (cluster.root / f"{member.name}.log").read_text(errors="replace").splitlines():
            found = pattern.match(line)
            if found and found.group(2) == run.database:
                wall = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                advances.append((wall + offset, int(found.group(3))))
    return [
        Op("operator", key, "advance", at - 1.0, at + 1.0, "ok", by=by)
        for at, by in sorted(advances)
        for key in run.keys
    ]


def hook_decisions(cluster: PatroniCluster) -> dict[str, int]:
    """How often the hook's ``pre_promote`` found a clean hand-over, and how often it closed the gate."""
    found = {"clean": 0, "gate closed": 0}
    for member in cluster.members:
        text = (cluster.root / f"{member.name}.log").read_text(errors="replace")
        found["clean"] += text.count("pg_lease_django: clean hand-over")
        found["gate closed"] += text.count("gate closed until the advance")
    return found


def run_patroni(config: PatroniConfig) -> PatroniResult:
    """Start a cluster, run the workers and the nemesis, check the history; always clean up."""
    start = time.monotonic()
    cluster = PatroniCluster(
        nodes=2,
        synchronous=config.synchronous,
        callback=config.callback,
        maximum_lag_on_failover=config.maximum_lag_on_failover,
    )
    try:
        cluster.start()
        stress = Config(
            cluster.url(via=config.via),
            seed=config.seed,
            workers=config.workers,
            keys=config.keys,
            seconds=60.0 + config.failovers * 180.0,  # an upper bound: the nemesis stops the workers
            ttl_min=0.1,
            ttl_max=1.5,
            long_pause=0.05,
            writes_durable=config.synchronous != "off",
            grants_durable=config.synchronous != "off",
        )
        run = Run(stress)
        # The database is created on the leader directly (HAProxy or the host list would do too).
        run.admin_url = cluster.url(via="hosts")
        run.create_database()
        outcome = PatroniResult(config, result=None)  # type: ignore[arg-type]
        try:
            run.start()
            try:
                nemesis(cluster, run, config, outcome)
            except AssertionError as exc:  # the cluster did not recover: a finding, the history is still checked
                outcome.stuck = str(exc)
            finally:
                run.stop()
                run.deadline = time.monotonic()  # a worker stuck in a call is killed after join's grace
            run.extra_ops += hook_advances(cluster, run)
            outcome.decisions = hook_decisions(cluster)
            outcome.advances = len(run.extra_ops) // max(1, len(run.keys))
            outcome.result = run.finish()
        finally:
            run.join(timeout=5)
            # No DROP DATABASE: the cluster goes with its directory (and under synchronous_mode_strict
            # with no replica left, the DROP would wait for one forever).
            shutil.rmtree(run.logdir, ignore_errors=True)
    finally:
        cluster.destroy()
        left = leftovers(cluster.root, cluster.groups)
        if left:
            raise RuntimeError(f"processes outlived the cluster: {left}")
    outcome.seconds = time.monotonic() - start
    return outcome


def suite(seed: int, failovers: int, lag: float) -> list[tuple[PatroniResult, bool]]:
    """The key pair (asynchronous, lag, kill -9 of the leader's PostgreSQL: without, then with the
    hook), then every fault in turn per replication mode. With whether violations fail the suite."""
    cases = [
        (PatroniConfig(synchronous="off", callback=False, failovers=failovers, lag=lag, seed=seed), False),
        (PatroniConfig(synchronous="off", callback=True, failovers=failovers, lag=lag, seed=seed + 1), True),
    ]
    for offset, mode in enumerate(("strict", "on", "off"), start=2):
        for via in ("hosts", "haproxy"):
            cases.append(
                (
                    PatroniConfig(
                        synchronous=mode,
                        callback=True,
                        failovers=len(FAULTS),
                        faults=FAULTS,
                        via=via,
                        seed=seed + offset * 10 + (via == "haproxy"),
                    ),
                    True,
                )
            )
    results = []
    for config, strict in cases:
        result = run_patroni(config)
        print(result.describe(), flush=True)
        results.append((result, strict))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress patroni", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="store_true", help="the runs of docs/high-availability.md")
    parser.add_argument("--synchronous", choices=("off", "on", "strict"), default="off")
    parser.add_argument("--no-hook", dest="callback", action="store_false", help="without pg_lease_django.patroni")
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--faults", default="kill-postgres", help=f"comma-separated, in turn: {', '.join(FAULTS)}")
    parser.add_argument("--via", choices=("hosts", "haproxy"), default="hosts")
    parser.add_argument("--lag", type=float, default=1.0, help="asynchronous kill-postgres: WAL senders stalled first")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--switchovers", type=int, default=0, help="instead: a hold() and an elect() leader through N switchovers"
    )
    parser.add_argument("--ttls", default="30,5", help="--switchovers: the leases' TTLs, comma-separated")
    args = parser.parse_args(argv)
    missing = missing_programs()
    if missing:
        parser.error(f"not installed: {', '.join(missing)} (make patroni-packages)")
    if args.switchovers:
        from .switchover import run_switchovers, table

        rows = run_switchovers(args.switchovers, tuple(float(t) for t in args.ttls.split(",")), args.via)
        print(table(rows), flush=True)
        return 0
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    start = time.monotonic()
    if args.suite:
        results = suite(seed, args.failovers, args.lag)
        failed = [r.config.name for r, strict in results if strict and not r.ok]
        print(f"patroni suite in {elapsed(start)}; violations in: {failed or 'none'}")
        return 1 if failed else 0
    faults = tuple(args.faults.split(","))
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    config = PatroniConfig(
        synchronous=args.synchronous,
        callback=args.callback,
        failovers=args.failovers,
        faults=faults,
        via=args.via,
        lag=args.lag,
        seed=seed,
    )
    result = run_patroni(config)
    print(result.describe(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
