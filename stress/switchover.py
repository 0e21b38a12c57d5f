"""``python -m stress patroni --switchovers N``: leases held through planned ``patronictl switchover``\\ s.

A Patroni cluster of two asynchronous nodes with the hook (devkit/patroni_cluster.py). Per TTL, three
Django processes (devkit/failover_child.py) on the host list with ``target_session_attrs=read-write``
(or HAProxy: ``--via haproxy``): one in ``hold()``, two campaigning with ``elect()`` for one key (the
first leads, the other waits). Then ``N`` switchovers to the other node, each once the cluster is
healthy. Per switchover and per lease, from the clients' own event logs (``time.monotonic()``, one
clock for every process of the machine): the renewals that failed (first failure to the first
success after it), the longest wait between confirmed renewals (a sampler asks every client for its
last one every 0.1 s) against the trust window (``ttl * (1 - PG_LEASE_SAFETY_MARGIN)``), whether the lease was
lost, the epochs on the server before and after, and who led; with the seconds from the command to
the new Patroni leader accepting writes.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from devkit.failover_child import Child
from devkit.patroni_cluster import PatroniCluster, epochs, leftovers
from devkit.pgcluster import poll


@dataclass
class Clients:
    """One TTL's processes: a holder, the elect() leader and its rival."""

    ttl: float
    holder: Child
    campaigners: list[Child]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def keys(self) -> dict[str, str]:
        return {"hold": f"sw-hold-{self.ttl:g}", "elect": f"sw-elect-{self.ttl:g}"}

    def collect(self) -> list[dict[str, Any]]:
        """Every event so far, each child's tagged with its role."""
        for role, child in [("holder", self.holder), *((f"campaigner{i}", c) for i, c in enumerate(self.campaigners))]:
            self.events += [{**e, "role": role} for e in ok(child.call(op="events"))["events"]]
        return self.events

    def rehold(self) -> bool:
        """Enter the hold (again); False if the call failed (its connection is then closed)."""
        owner = f"holder-{self.ttl:g}"
        return bool(self.holder.call(op="hold", key=self.keys["hold"], ttl=self.ttl, owner=owner)["ok"])

    def leaders(self) -> list[tuple[int, dict[str, Any]]]:
        return [
            (i, s) for i, c in enumerate(self.campaigners) if (s := ok(c.call(op="elected", ttl=self.ttl)))["leading"]
        ]


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        raise RuntimeError(f"client call failed: {reply}")
    return reply


def start_clients(cluster: PatroniCluster, ttl: float, via: str) -> Clients:
    database = cluster.django_database("postgres", via=via)
    clients = Clients(ttl, Child(database), [Child(database), Child(database)])
    poll(clients.rehold, timeout=60, what="the hold")
    for index, child in enumerate(clients.campaigners):
        ok(child.call(op="elect", key=clients.keys["elect"], ttl=ttl, owner=f"campaigner{index}-{ttl:g}"))
        if index == 0:
            poll(lambda: clients.leaders(), timeout=60, what="a leader")
    return clients


def window(events: list[dict[str, Any]], key: str, start: float) -> tuple[int, float | None]:
    """Failed renewals of ``key`` from ``start`` on, and the seconds from the first to the first success after."""
    failed = [e["at"] for e in events if e["event"] == "renew_failed" and e["key"] == key and e["at"] >= start]
    if not failed:
        return 0, None
    renewed = [e["at"] for e in events if e["event"] == "renewed" and e["key"] == key and e["at"] > failed[0]]
    return len(failed), (renewed[0] - failed[0]) if renewed else None


class Sampler(threading.Thread):
    """Ask every pair's holder and leader how they see their lease, every ``interval`` seconds,
    until stopped: the sole caller of the children meanwhile. Each confirmed renewal shows as a new
    ``renewal_sent_at`` (renewals come every ``ttl / 3``, far apart from the samples)."""

    def __init__(self, pairs: list[Clients], interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pairs, self.interval = pairs, interval
        self.samples: dict[tuple[float, str], list[dict[str, Any]]] = {(c.ttl, k): [] for c in pairs for k in c.keys}
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                for clients in self.pairs:
                    self.samples[clients.ttl, "hold"].append(ok(clients.holder.call(op="held")))
                    leaders = clients.leaders()
                    if leaders:
                        self.samples[clients.ttl, "elect"].append(leaders[0][1])
                self.stopping.wait(self.interval)
        except BaseException as exc:
            self.error = exc

    def renewals(self, ttl: float, kind: str) -> list[float]:
        """The distinct confirmed renewals seen (their ``time.monotonic()`` when sent)."""
        sent: list[float] = []
        for sample in self.samples[ttl, kind]:
            if not sample["lost"] and (not sent or sample["renewal_sent_at"] > sent[-1] + 0.05):
                sent.append(sample["renewal_sent_at"])
        return sent

    def settled(self, after: float) -> bool:
        """Every lease either lost or renewed with a renewal sent after ``after``."""
        if self.error is not None:
            raise self.error
        return all(
            (samples := self.samples[key]) and (samples[-1]["lost"] or samples[-1]["renewal_sent_at"] > after)
            for key in self.samples
        )


def switchover(cluster: PatroniCluster, pairs: list[Clients]) -> list[dict[str, Any]]:
    """One planned switchover, measured for every pair."""
    old = cluster.wait_healthy(timeout=240)
    new = next(m for m in cluster.members if m is not old)
    keys = [k for c in pairs for k in c.keys.values()]
    before = epochs(cluster, old, keys)
    poll(lambda: epochs(cluster, new, keys) == before, timeout=60, what="the replica to replay the epochs")
    for clients in pairs:
        clients.collect()
    sampler = Sampler(pairs)
    sampler.start()
    try:
        poll(lambda: sampler.settled(0.0), timeout=60, what="a first sample of every lease")
        start = time.monotonic()
        done = cluster.patronictl("switchover", "--force", "--leader", old.name, "--candidate", new.name)
        returned = time.monotonic() - start
        if done.returncode != 0:
            raise RuntimeError(f"patronictl switchover failed: {done.stdout}{done.stderr}")
        leader = cluster.wait_leader(other_than=old)
        writable = time.monotonic()
        poll(lambda: sampler.settled(writable), timeout=120, what="renewals on the new leader")
    finally:
        sampler.stopping.set()
        sampler.join(30)
    rows = []
    for clients in pairs:
        events = clients.collect()
        now = epochs(cluster, leader, list(clients.keys.values()))
        for kind, key in clients.keys.items():
            failures, failed_for = window(events, key, start)
            terms = [
                e
                for e in events
                if e["key"] == key and e["at"] >= start and e["event"] in ("leading", "stopped_leading")
            ]
            lost = [e for e in events if e["key"] == key and e["at"] >= start and e["event"] == "lost"]
            sent = sampler.renewals(clients.ttl, kind)
            rows.append(
                {
                    "ttl": clients.ttl,
                    "lease": kind,
                    "to": leader.name,
                    "patronictl_s": returned,
                    "writable_s": writable - start,
                    "failures": failures,
                    "failed_for_s": failed_for,
                    # the longest wait between confirmed renewals across the command, while held
                    "gap_s": None if lost else max((b - a for a, b in itertools.pairwise(sent)), default=None),
                    "trust_s": sampler.samples[clients.ttl, kind][-1]["trust_span"],
                    "lost": ",".join(e["error"] for e in lost) or "-",
                    "epoch_before": before[key],
                    "epoch_after": now[key],
                    "terms": " ".join(f"{e['event']}:{e['role']}@{e['at'] - start:.1f}" for e in terms) or "-",
                }
            )
        if ok(clients.holder.call(op="held"))["lost"]:  # hold again for the next switchover
            clients.holder.call(op="unhold")
            poll(lambda: clients.rehold(), timeout=60, what="the hold again")  # noqa: B023
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (docs/high-availability.md quotes one)."""
    head = (
        "| # | TTL | lease | to | patronictl (s) | writable (s) | failed renewals | failing for (s) "
        "| renewal gap (s) | trust window (s) | lost | epoch before → after | terms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        failed_for = "-" if row["failed_for_s"] is None else f"{row['failed_for_s']:.2f}"
        gap = "-" if row["gap_s"] is None else f"{row['gap_s']:.2f}"
        lines.append(
            f"| {row['n']} | {row['ttl']:g} | {row['lease']} | {row['to']} | {row['patronictl_s']:.1f} | "
            f"{row['writable_s']:.1f} | {row['failures']} | {failed_for} | {gap} | {row['trust_s']:.1f} | "
            f"{row['lost']} | {row['epoch_before']} → {row['epoch_after']} | {row['terms']} |"
        )
    return "\n".join(lines)


def run_switchovers(count: int, ttls: tuple[float, ...], via: str) -> list[dict[str, Any]]:
    """Start a cluster, the clients of each TTL, ``count`` switchovers; always clean up."""
    cluster = PatroniCluster(nodes=2, synchronous="off", callback=True)
    pairs: list[Clients] = []
    rows: list[dict[str, Any]] = []
    try:
        cluster.start()
        migrator = Child(cluster.django_database("postgres", via=via))
        try:
            ok(migrator.call(op="migrate"))
        finally:
            migrator.close()
        pairs = [start_clients(cluster, ttl, via) for ttl in ttls]
        for index in range(count):
            rows += [{**row, "n": index + 1} for row in switchover(cluster, pairs)]
            print(table(rows[-2 * len(pairs) :]).split("\n", 2)[2], flush=True)
    finally:
        for clients in pairs:
            for child in [clients.holder, *clients.campaigners]:
                child.close()
        cluster.destroy()
        left = leftovers(cluster.root, cluster.groups)
        if left:
            raise RuntimeError(f"processes outlived the cluster: {left}")
    return rows
