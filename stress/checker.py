"""History checker: decides whether a recorded run of lease operations was safe.

Independent of Django and of the database: it reads plain records. Two sources are checked
against each other:

* the **client history** (:class:`Op`): what each worker invoked, when (client monotonic clock,
  system-wide on one machine, so comparable across processes), and what it was told;
* the **server record**, when available: every committed change of a lease row
  (:class:`AuditRow`, written by a trigger in the same transaction as the change), every accepted
  fenced write (:class:`WriteRow`, with its commit-order ticket) and the final counters.

An operation whose outcome the client could not learn (connection lost, process killed) is
``unknown``: it *may* have happened. The checker never assumes either way; it only requires that
whatever the server committed is explained by an ``ok`` or ``unknown`` operation, and that the
server record, including effects of unknown operations, never shows two holders.

Violations are split in two: ``violations`` (safety: epochs, fencing, lost updates, durability)
and ``clock_violations`` (properties that also need the server clock to run forward at the normal
rate: grant times in epoch order, no two holders overlapping in server time).

Failover histories (:mod:`stress.failover`: the primary SIGKILLed mid-load, a standby promoted)
add three things. An operation cut off by the kill, or answered with ``UnconfirmedCommitError``
(the commit's wait for the synchronous standby was cancelled), is ``unknown``, like any lost
connection: indeterminate, as in Jepsen histories; the server record is the promoted server's,
which decides what happened. An operator's ``advance`` (``leases advance-epochs --by N``, one
:class:`Op` per key, ``by`` = N) explains an audit row that raises an epoch by exactly N, owner and
expiry unchanged, or a first grant of a key at the raised floor. And ``grants_durable=False``
(asynchronous replication): an acknowledged grant missing from the promoted server is a *loss*
(``Report.losses``, counted), not a violation, unless its epoch went to someone else
(``regranted_epoch``, always a violation). :func:`summarize` sorts what was found into what a
failover must not do: lose acknowledged grants, move epochs back, grant an epoch twice, accept a
stale fenced write.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Outcome = Literal["ok", "fail", "unknown"]

#: Operations that change the epoch when they succeed.
EPOCH_BUMPING = frozenset({"acquire", "release"})
#: Kinds reported in ``clock_violations`` rather than ``violations``.
CLOCK_KINDS = frozenset({"grant_time_order", "overlap"})
#: Operations whose acceptance with a stale epoch lets a former holder act.
STALE_SENSITIVE = frozenset({"write", "renew", "release"})


@dataclass
class Op:
    """One operation as the client saw it.

    Attributes:
        worker: the worker (and owner identity) that ran it.
        key: the lease key.
        op: ``acquire``, ``renew``, ``release``, ``inspect``, ``write`` (a fenced write) or
            ``advance`` (an operator's ``advance-epochs``, ``by`` = N; its worker is the operator).
        invoke: client monotonic time just before the call.
        complete: client monotonic time just after it returned; None when it never did (killed).
        outcome: ``ok``, ``fail`` (a definite refusal, see ``cause``) or ``unknown``.
        cause: why it failed (``not_acquirable``, ``timeout``, ``not_owner``, ``lapsed``,
            ``epoch_mismatch``) or what made it unknown (``connection``, ``killed``).
        epoch: acquire: the granted epoch; renew/release/write: the epoch presented;
            inspect: the epoch seen.
        server_time: server clock of the decision (seconds since the Unix epoch), when returned.
        expires_at: acquire/renew: the new expiry; inspect: the expiry seen.
        ttl: seconds asked for (acquire, renew).
        owner: inspect: the holder seen. Otherwise the worker's identity.
        status: inspect: ``free``, ``held`` or ``lapsed``.
        tag: write: the unique id of the row the write inserts (to match :class:`WriteRow`).
        blocking: acquire: whether it waited.
        by: advance: how much every epoch (and the epoch floor) was raised.
    """

    worker: str
    key: str
    op: str
    invoke: float
    complete: float | None = None
    outcome: Outcome = "unknown"
    cause: str | None = None
    epoch: int | None = None
    server_time: float | None = None
    expires_at: float | None = None
    ttl: float | None = None
    owner: str | None = None
    status: str | None = None
    tag: str | None = None
    blocking: bool = False
    by: int | None = None

    @property
    def witnessed_epoch(self) -> int | None:
        """The lease's epoch right after this operation, if it succeeded and that is known."""
        if self.outcome != "ok" or self.epoch is None or self.op == "advance":
            return None
        return self.epoch + 1 if self.op == "release" else self.epoch

    def line(self) -> str:
        """One human-readable line for failure reports."""
        done = "never" if self.complete is None else f"{self.complete:.4f}"
        extra = "".join(
            f" {name}={value}"
            for name, value in (
                ("epoch", self.epoch),
                ("cause", self.cause),
                ("server_time", self.server_time),
                ("expires_at", self.expires_at),
                ("ttl", self.ttl),
                ("status", self.status),
                ("owner", self.owner if self.op == "inspect" else None),
                ("tag", self.tag),
                ("by", self.by),
            )
            if value is not None
        )
        op = f"{self.op}(blocking)" if self.blocking else self.op
        return f"[{self.invoke:.4f} .. {done}] {self.worker} {op} {self.key} -> {self.outcome}{extra}"


@dataclass(frozen=True)
class AuditRow:
    """One committed change of a lease row, in the order the row's changes happened.

    Attributes:
        seq: position in the audit log (per key, changes are serialised by the row lock).
        key, owner, epoch, acquired_at, expires_at: the row after the change (owner None: free).
        old_owner, old_epoch: the row before (None/0 for an insert).
    """

    seq: int
    key: str
    owner: str | None
    epoch: int
    acquired_at: float | None
    expires_at: float | None
    old_owner: str | None
    old_epoch: int


@dataclass(frozen=True)
class WriteRow:
    """A fenced write the server accepted (committed): its tag, key, epoch and commit-order ticket."""

    tag: str
    key: str
    epoch: int
    ticket: int


@dataclass
class Violation:
    """One property that failed, with the slice of history that shows it."""

    kind: str
    key: str
    message: str
    ops: list[Op] = field(default_factory=list)
    epoch: int | None = None  # the epoch concerned, where one is (lost and regranted grants)

    def render(self) -> str:
        """The violation and its history slice, one operation per line."""
        lines = [f"{self.kind} on key {self.key!r}: {self.message}"]
        lines += [f"    {op.line()}" for op in self.ops]
        return "\n".join(lines)


@dataclass
class Report:
    """What the checker found. ``ok`` means no safety violation and no clock violation.

    ``losses``: acknowledged effects missing from the server record where the run allowed it
    (``grants_durable=False`` / ``writes_durable=False``): measured, not violations.
    """

    violations: list[Violation] = field(default_factory=list)
    clock_violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    losses: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing at all was violated."""
        return not self.violations and not self.clock_violations

    @property
    def safe(self) -> bool:
        """True when no safety violation was found (clock-dependent ones aside)."""
        return not self.violations

    def kinds(self) -> set[str]:
        """The kinds of every violation found."""
        return {v.kind for v in self.violations + self.clock_violations}

    def add(self, violation: Violation) -> None:
        """File ``violation`` under safety or clock."""
        (self.clock_violations if violation.kind in CLOCK_KINDS else self.violations).append(violation)

    def render(self, limit: int = 20) -> str:
        """Counts and the first ``limit`` violations of each list."""
        lines = ["operations: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))]
        if self.losses:
            lost = ", ".join(f"{kind}={n}" for kind, n in sorted(_tally(v.kind for v in self.losses).items()))
            lines.append(f"losses allowed by the run (not violations): {lost}")
        for title, found in (("SAFETY VIOLATIONS", self.violations), ("CLOCK VIOLATIONS", self.clock_violations)):
            if found:
                lines.append(f"{title} ({len(found)}):")
                lines += [v.render() for v in found[:limit]]
        return "\n".join(lines)


def _tally(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        counts[item] += 1
    return dict(counts)


def _end(op: Op) -> float:
    return math.inf if op.complete is None else op.complete


def _nearby(ops: Sequence[Op], *anchors: Op, width: int = 3) -> list[Op]:
    """The anchors plus up to ``width`` operations on either side of each (by invoke time)."""
    ordered = sorted(ops, key=lambda o: o.invoke)
    picked: set[int] = set()
    for anchor in anchors:
        for i, op in enumerate(ordered):
            if op is anchor:
                picked.update(range(max(0, i - width), min(len(ordered), i + width + 1)))
    return [ordered[i] for i in sorted(picked)]


def check(
    ops: Iterable[Op],
    audit: Sequence[AuditRow] | None = None,
    writes: Sequence[WriteRow] | None = None,
    counters: dict[str, int] | None = None,
    *,
    writes_durable: bool = True,
    grants_durable: bool = True,
) -> Report:
    """Check a history. See the module docstring for the properties.

    Args:
        ops: the client history of every worker.
        audit: every committed lease-row change (None: check the client history only).
        writes: every committed fenced write (None: skip the fenced-resource checks).
        counters: per key, the final value of the counter incremented by each fenced write.
        writes_durable: whether acknowledged fenced writes must survive (False on a server with
            ``synchronous_commit = off`` that crashed: the library forces durable commits for lease
            changes only; guarded data follows the server's setting). When False, acknowledged
            writes missing from the resource are counted in ``Report.losses``.
        grants_durable: whether every acknowledged grant must be in the server record (False
            after a failover to an asynchronous standby: missing ones are counted in
            ``Report.losses``; one whose epoch the server granted to another owner is still a
            ``regranted_epoch`` violation).
    """
    all_ops = list(ops)
    report = Report()
    for op in all_ops:
        report.counts[f"{op.op}:{op.outcome}"] = report.counts.get(f"{op.op}:{op.outcome}", 0) + 1
    report.counts["total"] = len(all_ops)
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in all_ops:
        by_key[op.key].append(op)
    audit_by_key: dict[str, list[AuditRow]] = defaultdict(list)
    for row in audit or ():
        audit_by_key[row.key].append(row)
    writes_by_key: dict[str, list[WriteRow]] = defaultdict(list)
    for write in writes or ():
        writes_by_key[write.key].append(write)
    for key in sorted(set(by_key) | set(audit_by_key) | set(writes_by_key)):
        key_ops = by_key.get(key, [])
        _check_grants(report, key, key_ops)
        _check_realtime(report, key, key_ops)
        if audit is not None:
            _check_audit(report, key, key_ops, audit_by_key.get(key, []), grants_durable)
        else:
            _check_overlap_from_client(report, key, key_ops)
        if writes is not None:
            counter = None if counters is None else counters.get(key, 0)
            _check_writes(report, key, key_ops, writes_by_key.get(key, []), counter, writes_durable)
    return report


def _check_grants(report: Report, key: str, ops: list[Op]) -> None:
    """Granted epochs are unique, and ordered like their server grant times."""
    grants = [op for op in ops if op.op == "acquire" and op.outcome == "ok" and op.epoch is not None]
    seen: dict[int, Op] = {}
    for grant in grants:
        assert grant.epoch is not None
        if grant.epoch in seen:
            report.add(
                Violation(
                    "duplicate_epoch",
                    key,
                    f"epoch {grant.epoch} granted twice",
                    [seen[grant.epoch], grant],
                    epoch=grant.epoch,
                )
            )
        seen[grant.epoch] = grant
    timed = sorted((g for g in grants if g.server_time is not None), key=lambda g: (g.server_time, g.epoch))
    for before, after in itertools.pairwise(timed):
        if after.epoch is not None and before.epoch is not None and after.epoch <= before.epoch:
            report.add(
                Violation(
                    "grant_time_order",
                    key,
                    f"epoch {after.epoch} was granted at a later server time than epoch {before.epoch}",
                    [before, after],
                )
            )


def _check_realtime(report: Report, key: str, ops: list[Op]) -> None:
    """If X completed before Y was invoked, Y saw an epoch at least X's (strictly above, if Y bumps it).

    Covers: acquires in real-time order get increasing epochs; a renew, release or fenced write
    accepted after a newer epoch was observed (a stale holder let through); inspect going back.
    """
    witnesses = sorted((op for op in ops if op.witnessed_epoch is not None), key=_end)
    ends = [_end(op) for op in witnesses]
    best: list[tuple[int, Op]] = []  # prefix maximum of witnessed epochs, by completion
    for op in witnesses:
        epoch = op.witnessed_epoch
        assert epoch is not None
        best.append((epoch, op) if not best or epoch > best[-1][0] else best[-1])
    for op in witnesses:
        n = bisect.bisect_left(ends, op.invoke)
        if n == 0:
            continue
        prior_epoch, prior = best[n - 1]
        mine = op.witnessed_epoch
        assert mine is not None
        if mine < prior_epoch or (op.op in EPOCH_BUMPING and mine == prior_epoch):
            report.add(
                Violation(
                    "realtime_order",
                    key,
                    f"{op.op} by {op.worker} saw epoch {mine} after {prior.op} by {prior.worker} had completed "
                    f"with epoch {prior_epoch}",
                    [prior, op],
                )
            )


def _lifetimes_from_client(ops: list[Op]) -> dict[int, tuple[Op, float]]:
    """Per granted epoch: the grant and the expiry set by its last renewal (or the grant itself).

    A renewal sets the expiry to its server time + its TTL, which may shorten it. One holder renews
    one epoch sequentially, so the last acknowledged renewal (by invocation) decides. An epoch with
    a renewal of unknown outcome is left out: that renewal may have moved the expiry either way.
    """
    grants = {op.epoch: op for op in ops if op.op == "acquire" and op.outcome == "ok" and op.epoch is not None}
    lives: dict[int, tuple[Op, float]] = {e: (g, g.expires_at) for e, g in grants.items() if g.expires_at is not None}
    unsure: set[int] = set()
    for op in sorted(ops, key=lambda o: o.invoke):
        if op.op != "renew" or op.epoch not in lives:
            continue
        if op.outcome == "unknown":
            unsure.add(op.epoch)
        elif op.outcome == "ok" and op.expires_at is not None:
            lives[op.epoch] = (lives[op.epoch][0], op.expires_at)
    return {e: life for e, life in lives.items() if e not in unsure}


def _check_overlap_from_client(report: Report, key: str, ops: list[Op]) -> None:
    """A takeover (epoch e+1 granted to another owner) starts no earlier than e's latest known expiry."""
    lives = _lifetimes_from_client(ops)
    renewals = defaultdict(list)
    for op in ops:
        if op.op == "renew" and op.outcome == "ok" and op.epoch is not None:
            renewals[op.epoch].append(op)
    for epoch, (grant, expiry) in lives.items():
        nxt = lives.get(epoch + 1)
        if nxt is None or nxt[0].worker == grant.worker or nxt[0].server_time is None:
            continue
        if nxt[0].server_time < expiry:
            report.add(
                Violation(
                    "overlap",
                    key,
                    f"epoch {epoch + 1} granted to {nxt[0].worker} at server time {nxt[0].server_time:.6f}, "
                    f"before epoch {epoch} of {grant.worker} expired at {expiry:.6f}",
                    [grant, *renewals[epoch], nxt[0]],
                )
            )


def _explained_by_advances(pending: list[int], jump: int) -> bool:
    """Whether a prefix of the pending advances (oldest first) adds up to ``jump``; consume it if so."""
    total = 0
    for n, by in enumerate(pending, 1):
        total += by
        if total == jump:
            del pending[:n]
            return True
        if total > jump:
            return False
    return False


def _check_audit(report: Report, key: str, ops: list[Op], rows: list[AuditRow], grants_durable: bool = True) -> None:
    """The server record: epochs step by one (or by an operator's advance), every grant explained,
    every acknowledged grant kept (or, when not durable, counted as lost), no overlap."""
    rows = sorted(rows, key=lambda r: r.seq)
    advances = [
        op.by for op in sorted(ops, key=lambda o: o.invoke) if op.op == "advance" and op.by and op.outcome != "fail"
    ]
    acquires = [op for op in ops if op.op == "acquire"]
    acknowledged = [op for op in acquires if op.outcome == "ok" and op.epoch is not None]
    acked = {(op.epoch, op.worker) for op in acknowledged}
    maybe = defaultdict(list)  # owner -> acquires that may have been granted without us learning the epoch
    for op in acquires:
        if op.outcome == "unknown":
            maybe[op.worker].append(op)
    previous: AuditRow | None = None
    granted: dict[int, AuditRow] = {}
    expiry: dict[int, float] = {}
    for row in rows:
        before_epoch = previous.epoch if previous else 0
        if row.old_epoch != before_epoch:
            report.add(
                Violation("audit_gap", key, f"audit row {row.seq} follows epoch {row.old_epoch}, not {before_epoch}")
            )
        step = row.epoch - row.old_epoch
        unchanged = previous is not None and row.owner == row.old_owner and row.expires_at == previous.expires_at
        if step > 1 and unchanged and _explained_by_advances(advances, step):
            previous = row  # every epoch raised by the operator's advance, the holder unchanged
            continue
        if previous is None and step > 1 and _explained_by_advances(advances, step - 1):
            step = 1  # a key's first grant, at the epoch floor raised by an advance
        if step not in (0, 1):
            report.add(
                Violation(
                    "epoch_regression", key, f"epoch went from {row.old_epoch} to {row.epoch} (audit row {row.seq})"
                )
            )
        if step == 1 and row.owner is not None:
            if row.epoch in granted:
                report.add(
                    Violation("duplicate_epoch", key, f"the server granted epoch {row.epoch} twice", epoch=row.epoch)
                )
            granted[row.epoch] = row
            # A grant nobody was told about must be the effect of an acquire whose outcome is
            # unknown; each such acquire explains at most one grant.
            if (row.epoch, row.owner) not in acked:
                if maybe.get(row.owner):
                    maybe[row.owner].pop(0)
                else:
                    report.add(
                        Violation(
                            "phantom_grant",
                            key,
                            f"the server granted epoch {row.epoch} to {row.owner}, which was told of no such grant "
                            "and had no acquire of unknown outcome left to explain it",
                            [op for op in acquires if op.worker == row.owner][-5:],
                        )
                    )
        if row.owner is not None and row.expires_at is not None:
            # The last change at an epoch decides its expiry: a renewal with a shorter TTL shortens it.
            expiry[row.epoch] = row.expires_at
        previous = row
    for op in acknowledged:
        epoch, worker = op.epoch, op.worker
        assert epoch is not None
        grant = granted.get(epoch)
        # The same owner granted the same epoch again: another grant (its grant time is the row's
        # acquired_at, which the acquire returns as its server time).
        another = (
            grant is not None
            and grant.owner == worker
            and grant.acquired_at is not None
            and op.server_time is not None
            and abs(grant.acquired_at - op.server_time) > 1e-5
        )
        if grant is not None and (grant.owner != worker or another):
            report.add(
                Violation(
                    "regranted_epoch",
                    key,
                    f"{worker} was told it holds epoch {epoch}, but the server granted that epoch to "
                    + (f"{worker} again, at server time {grant.acquired_at:.6f}" if another else f"{grant.owner}"),
                    [op],
                    epoch=epoch,
                )
            )
        elif grant is None:
            lost = Violation(
                "lost_grant",
                key,
                f"{worker} was told it holds epoch {epoch}, but the server has no such grant",
                [op],
                epoch=epoch,
            )
            if grants_durable:
                report.add(lost)
            else:
                report.losses.append(lost)
    for epoch, row in granted.items():
        nxt = granted.get(epoch + 1)
        if nxt is None or nxt.owner == row.owner or nxt.acquired_at is None:
            continue
        if nxt.acquired_at < expiry.get(epoch, -math.inf):
            report.add(
                Violation(
                    "overlap",
                    key,
                    f"epoch {epoch + 1} granted to {nxt.owner} at server time {nxt.acquired_at:.6f}, before epoch "
                    f"{epoch} of {row.owner} expired at {expiry[epoch]:.6f} (server record)",
                    [op for op in ops if op.epoch in (epoch, epoch + 1) and op.op != "inspect"],
                )
            )


def _check_writes(
    report: Report,
    key: str,
    ops: list[Op],
    rows: list[WriteRow],
    counter: int | None,
    durable: bool,
) -> None:
    """Fenced writes: epochs never decrease in commit order, none lost or invented, no lost update."""
    rows = sorted(rows, key=lambda r: r.ticket)
    for before, after in itertools.pairwise(rows):
        if after.epoch < before.epoch:
            report.add(
                Violation(
                    "fence_order",
                    key,
                    f"write {after.tag} at epoch {after.epoch} committed after "
                    f"write {before.tag} at epoch {before.epoch}",
                    [op for op in ops if op.tag in (before.tag, after.tag)],
                )
            )
    writes = {op.tag: op for op in ops if op.op == "write" and op.tag is not None}
    committed = {row.tag: row for row in rows}
    for tag, op in writes.items():
        if op.outcome == "ok" and tag not in committed:
            lost = Violation("lost_write", key, f"write {tag} was acknowledged but is not in the resource", [op])
            if durable:
                report.add(lost)
            else:
                report.losses.append(lost)
        if op.outcome == "ok" and tag in committed and committed[tag].epoch != op.epoch:
            report.add(
                Violation(
                    "write_epoch", key, f"write {tag} presented epoch {op.epoch}, stored {committed[tag].epoch}", [op]
                )
            )
    for tag, row in committed.items():
        writer = writes.get(tag)
        if writer is None or writer.outcome == "fail":
            report.add(
                Violation(
                    "phantom_write",
                    key,
                    f"write {tag} (epoch {row.epoch}) is in the resource, but "
                    + (
                        "no worker made it"
                        if writer is None
                        else f"its writer was told it was refused ({writer.cause})"
                    ),
                    [] if writer is None else [writer],
                )
            )
    if counter is not None and counter != len(rows):
        report.add(
            Violation(
                "lost_update",
                key,
                f"the counter is {counter} but {len(rows)} increments were accepted",
                [op for op in ops if op.op == "write" and op.outcome != "fail"][-6:],
            )
        )


def summarize(report: Report) -> dict[str, int]:
    """What a failover must not do, counted from a report (each count 0 in a safe run).

    - ``acknowledged_grants_lost``: acknowledged grants missing from the server record, or held
      there by another owner (``lost_grant``, ``regranted_epoch``), violations or allowed losses;
    - ``double_grants``: epochs granted to two owners (``duplicate_epoch``: both told so;
      ``regranted_epoch``: the server record shows the second), per key and epoch;
    - ``epoch_regressions``: an acquire or inspect that saw a lower epoch than one already seen
      (``realtime_order``), a lower epoch granted at a later server time (``grant_time_order``),
      or a server record whose epoch went back or jumped unexplained (one regression may be
      reported by several of these);
    - ``stale_fenced_writes_accepted``: a fenced write accepted with an epoch after a newer one had
      been seen (``realtime_order``), committed after one with a newer epoch (``fence_order``),
      stored with another epoch, or accepted though its writer was told it was refused;
    - ``stale_renewals_or_releases_accepted``: the same for a renewal or a release;
    - ``other``: every other violation (lost writes and updates, phantom grants, overlaps...).
    """
    everything = report.violations + report.clock_violations
    double = {(v.key, v.epoch) for v in everything if v.kind in ("regranted_epoch", "duplicate_epoch")}
    counts = {
        "acknowledged_grants_lost": sum(
            1 for v in everything + report.losses if v.kind in ("lost_grant", "regranted_epoch")
        ),
        "double_grants": len(double),
        "epoch_regressions": 0,
        "stale_fenced_writes_accepted": 0,
        "stale_renewals_or_releases_accepted": 0,
        "other": 0,
    }
    for v in everything:
        late = v.ops[-1].op if v.ops else None
        if (v.kind == "realtime_order" and late == "write") or v.kind in (
            "fence_order",
            "phantom_write",
            "write_epoch",
        ):
            counts["stale_fenced_writes_accepted"] += 1
        elif v.kind == "realtime_order" and late in STALE_SENSITIVE:
            counts["stale_renewals_or_releases_accepted"] += 1
        elif v.kind in ("realtime_order", "epoch_regression", "grant_time_order"):
            counts["epoch_regressions"] += 1
        elif v.kind not in ("lost_grant", "regranted_epoch", "duplicate_epoch"):
            counts["other"] += 1
    return counts


def to_json(op: Op) -> dict[str, Any]:
    """``op`` as a JSON-ready dict."""
    return asdict(op)
