"""Under Patroni (etcd, two nodes, HAProxy): a switchover keeps the epochs, a crash failover advances them.

Real processes (devkit/patroni_cluster.py), asynchronous replication, the package's hook
(:mod:`pg_lease_django.patroni`) configured as ``pre_promote``, ``on_role_change`` and
``on_start``. Clients as users connect: one Django process with the multi-host ``HOST``/``PORT``
and ``target_session_attrs=read-write`` (devkit/failover_child.py), one through HAProxy; a fenced
writer (``pg_lease_check_fence`` then its write, in one transaction) on the multi-host URL.

Skipped when patroni, patronictl, etcd or haproxy is not installed (``make patroni-packages``).
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from devkit.failover_child import Child
from devkit.patroni_cluster import (
    Member,
    PatroniCluster,
    Ports,
    epochs,
    haproxy_config,
    leftovers,
    missing_programs,
    patroni_config,
)
from devkit.pgcluster import find_bindir, poll

MISSING = missing_programs()
NEEDS_PATRONI = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.xdist_group("patroni"),
    pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (make patroni-packages)"),
    pytest.mark.skipif(find_bindir() is None, reason="no PostgreSQL server binaries"),
]
ADVANCE = 1_000_000
F = TypeVar("F", bound=Callable[..., None])


def needs_patroni(test: F) -> F:
    """A test that starts a Patroni cluster: marked ``cluster`` and ``slow``, skipped without the programs."""
    for mark in reversed(NEEDS_PATRONI):
        test = mark(test)
    return test


DOCS = Path(__file__).resolve().parents[2] / "docs" / "high-availability.md"


def test_the_docs_quote_the_configurations_the_tests_start() -> None:
    """docs/high-availability.md shows the renderer's patroni.yml and haproxy.cfg, verbatim (with a
    production layout's ports and paths)."""
    text = DOCS.read_text()
    node = patroni_config(
        scope="leases",
        name="node1",
        root=Path("/srv/patroni"),
        ports=Ports(5432, 8008),
        etcd_port=2379,
        bindir=Path("/usr/lib/postgresql/15/bin"),
        python="/srv/app/.venv/bin/python",
    )
    proxy = haproxy_config(port=5000, nodes=[("node1", Ports(5432, 8008)), ("node2", Ports(5433, 8009))])
    assert f"```yaml\n{node}```" in text
    assert f"```\n{proxy}```" in text


@pytest.fixture
def patroni() -> Iterator[PatroniCluster]:
    """Two nodes, asynchronous, with the hook; afterwards no process of it may be left."""
    cluster = PatroniCluster(nodes=2, synchronous="off", callback=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()
        assert leftovers(cluster.root, cluster.groups) == []


@pytest.fixture
def children() -> Iterator[Callable[[dict[str, Any]], Child]]:
    started: list[Child] = []

    def start(database: dict[str, Any]) -> Child:
        child = Child(database)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return reply


def fenced_write(url: str, key: str, owner: str, epoch: int) -> str:
    """One fenced write: the fence presented, then the write, one transaction; "ok" or the SQLSTATE."""
    try:
        with psycopg.connect(url) as conn, conn.transaction():
            conn.execute("SELECT pg_lease_check_fence(%s::text, %s::text, %s::bigint)", (key, owner, epoch))
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS fenced_effect (n int)")
            conn.execute("INSERT INTO fenced_effect VALUES (1)")
        return "ok"
    except psycopg.Error as exc:
        return exc.sqlstate or type(exc).__name__


def hook_log(cluster: PatroniCluster, member: Member) -> str:
    return "\n".join(
        line for line in (cluster.root / f"{member.name}.log").read_text().splitlines() if "pg_lease_django:" in line
    )


def new_leader(cluster: PatroniCluster, old: Member) -> Member:
    return cluster.wait_leader(other_than=old)


@needs_patroni
def test_switchover_keeps_the_epochs_and_a_crash_failover_advances_them_before_clients_get_in(
    patroni: PatroniCluster, children: Callable[[dict[str, Any]], Child]
) -> None:
    """A ``patronictl switchover`` is a clean hand-over: the hook leaves every epoch and the hold as
    they were. A SIGKILL of the leader's PostgreSQL (``primary_start_timeout: 0``: Patroni fails
    over at once) may have lost writes: the hook closes the gate before the promotion, advances
    every epoch by 1,000,000, then opens it. The writer fenced before the kill is refused, the
    hold entered before it reports the loss, and the first lease change any client makes on the
    promoted server comes after the advance."""
    cluster = patroni
    client = children(cluster.django_database("postgres", via="hosts"))
    holder = children(cluster.django_database("postgres", via="haproxy"))
    ok(client.call(op="migrate"))
    first = cluster.leader()
    assert first is not None
    writer = ok(client.call(op="acquire", key="pat-writer", owner="writer", ttl=120))
    assert writer["granted"], writer
    held = ok(holder.call(op="hold", key="pat-hold", ttl=15, owner="holder"))
    url = cluster.url("postgres")
    assert fenced_write(url, "pat-writer", "writer", writer["epoch"]) == "ok"

    # ---- planned switchover: nothing lost, nothing advanced
    other = next(m for m in cluster.members if m is not first)
    poll(
        lambda: epochs(cluster, other, ["pat-writer"]) == {"pat-writer": writer["epoch"]},
        timeout=60,
        what="the replica to replay the grant",
    )
    done = cluster.patronictl("switchover", "--force", "--leader", first.name, "--candidate", other.name)
    assert done.returncode == 0, done.stdout + done.stderr
    second = new_leader(cluster, first)
    assert second is other
    assert "clean hand-over" in hook_log(cluster, second), hook_log(cluster, second)
    assert epochs(cluster, second, ["pat-writer"]) == {"pat-writer": writer["epoch"]}
    assert fenced_write(url, "pat-writer", "writer", writer["epoch"]) == "ok"
    # The hold (through HAProxy) renews on the new leader at the same epoch, or reports the loss
    # (if the switchover took longer than its trust window): never another holder meanwhile.
    switched_at = time.monotonic()
    state = poll(
        lambda: (s := ok(holder.call(op="held")))["lost"] or (s["renewal_sent_at"] > switched_at and s),
        timeout=60,
        what="the hold to renew on the new leader or report the loss",
    )
    assert state is True or state["epoch"] == held["epoch"], state
    cluster.wait_healthy()

    # ---- crash failover: the epochs advance before any client gets in
    acknowledged = epochs(cluster, second, ["pat-writer", "pat-hold"])
    poll(lambda: epochs(cluster, first, list(acknowledged)) == acknowledged, timeout=60, what="the replica to catch up")
    second.kill_postgres(signal.SIGKILL)
    killed_at = time.monotonic()
    third = new_leader(cluster, second)
    advanced = poll(
        lambda: (e := epochs(cluster, third, list(acknowledged))) and min(e.values()) > ADVANCE and e,
        timeout=120,
        what="the hook's advance on the promoted server",
    )
    after_kill = time.monotonic() - killed_at
    assert advanced == {key: epoch + ADVANCE for key, epoch in acknowledged.items()}, (advanced, acknowledged)

    # The hook logs the advance after its commit, so the log may trail the epochs seen above.
    def advance_logged() -> str | None:
        text = hook_log(cluster, third)
        return text if "advanced" in text else None

    log = poll(advance_logged, timeout=60, what="the hook's log of the advance")
    assert "gate closed" in log, log
    assert log.index("gate closed") < log.index("advanced"), log
    assert fenced_write(url, "pat-writer", "writer", writer["epoch"]) not in ("ok", None)

    lost = poll(lambda: (s := ok(holder.call(op="held")))["lost"] and s, timeout=60, what="the hold to report the loss")
    ended = ok(holder.call(op="unhold"))
    assert ended["exited"], ended
    rival = poll(
        lambda: (r := client.call(op="acquire", key="pat-hold", owner="rival", ttl=30))["ok"] and r["granted"] and r,
        timeout=60,
        what="the held key to be granted again after its expiry",
    )
    assert rival["epoch"] > acknowledged["pat-hold"] + ADVANCE
    kept = "lost" if state is True else "kept"
    print(
        f"\npatroni: switchover clean (epochs kept, hold {kept}); crash failover to {third.name}: epochs advanced "
        f"{after_kill:.2f}s after the kill; stale fenced write refused; hold lost ({lost.get('error')}); "
        f"rival granted epoch {rival['epoch']}"
    )


@needs_patroni
def test_no_patroni_etcd_or_haproxy_process_outlives_the_cluster() -> None:
    """Destroyed with one Patroni SIGKILLed (its PostgreSQL orphaned) and the other SIGSTOPped:
    nothing of the cluster is left, and no process names its directory."""
    cluster = PatroniCluster(nodes=2, synchronous="off", callback=False)
    try:
        cluster.start()
        leader = cluster.leader()
        assert leader is not None and leader.process is not None
        replica = next(m for m in cluster.members if m is not leader)
        assert replica.process is not None
        replica.process.send_signal(signal.SIGKILL)
        leader.process.send_signal(signal.SIGSTOP)
        assert leftovers(cluster.root, cluster.groups)  # the check sees them while they run
    finally:
        cluster.destroy()
    assert leftovers(cluster.root, cluster.groups) == []
    assert not cluster.root.exists()


@needs_patroni
def test_an_elect_leader_keeps_its_term_or_a_single_successor_wins_above_its_epoch_across_a_switchover(
    patroni: PatroniCluster, children: Callable[[dict[str, Any]], Child]
) -> None:
    """Two processes campaign with ``elect()`` on the host list; a ``patronictl switchover``. The
    epoch is unchanged on the new leader (a clean hand-over: the hook did nothing); the leader's
    term goes on at that epoch, or (if its renewals missed the trust window) ends, and each next
    term's epoch is higher."""
    cluster = patroni
    campaigners = [children(cluster.django_database("postgres", via="hosts")) for _ in range(2)]
    ok(campaigners[0].call(op="migrate"))
    key, ttl = "pat-elect", 15
    for index, child in enumerate(campaigners):
        ok(child.call(op="elect", key=key, ttl=ttl, owner=f"campaigner{index}"))
    leading = poll(
        lambda: [i for i, c in enumerate(campaigners) if ok(c.call(op="elected", ttl=ttl))["leading"]],
        timeout=60,
        what="a leader",
    )
    assert len(leading) == 1, leading
    term = ok(campaigners[leading[0]].call(op="elected", ttl=ttl))
    first = cluster.wait_healthy()
    other = next(m for m in cluster.members if m is not first)
    poll(lambda: epochs(cluster, other, [key]) == {key: term["epoch"]}, timeout=60, what="the replica to replay it")
    switched_at = time.monotonic()
    done = cluster.patronictl("switchover", "--force", "--leader", first.name, "--candidate", other.name)
    assert done.returncode == 0, done.stdout + done.stderr
    second = new_leader(cluster, first)
    assert "clean hand-over" in hook_log(cluster, second), hook_log(cluster, second)

    def renewed_on_the_new_leader() -> dict[str, Any] | None:
        states = [ok(c.call(op="elected", ttl=ttl)) for c in campaigners]
        leaders = [s for s in states if s["leading"]]
        return leaders[0] if len(leaders) == 1 and leaders[0]["renewal_sent_at"] > switched_at else None

    after = poll(renewed_on_the_new_leader, timeout=90, what="a leader renewing on the new Patroni leader")
    # Each process's terms: from ``leading`` to its first ``lost`` or ``stopped_leading``.
    terms: list[tuple[float, float, int]] = []
    for child in campaigners:
        started: dict[str, Any] | None = None
        for event in ok(child.call(op="events"))["events"]:
            if event["event"] == "leading":
                started = event
            elif started is not None and event["event"] in ("lost", "stopped_leading"):
                terms.append((started["at"], event["at"], started["epoch"]))
                started = None
        if started is not None:
            terms.append((started["at"], float("inf"), started["epoch"]))
    terms.sort()
    # Each term at a higher epoch than the one before. (Whether one ended before the next began is
    # the processes' own clocks and schedulers: a stalled process notices its loss late, which is
    # what fencing is for; not asserted here.)
    for (_, _, epoch), (_, _, later) in itertools.pairwise(terms):
        assert later > epoch, terms
    if after["epoch"] == term["epoch"]:
        assert terms == [(terms[0][0], float("inf"), term["epoch"])], terms  # the first term goes on
    else:
        assert after["epoch"] > term["epoch"], (after, term)
    assert epochs(cluster, second, [key]) == {key: after["epoch"]}
    for child in campaigners:
        assert ok(child.call(op="unelect"))["exited"]
