"""Leaving a hold is bounded, whatever the database does.

``hold()`` returns to its caller within the trust window plus a bounded release attempt, even when
a renewal or the release never returns: a commit waiting for a synchronous standby that is gone
(``statement_timeout`` does not end that wait), or a server that stopped answering while its TCP
connections stay up (SIGSTOP). Before the bound, the exit joined the renewal in flight: it never
returned in the first case, and in the second only once the TCP keepalives gave up (about four renew
intervals later: 8.7 s against 5.0 s here with a 4 s TTL).

A hold in a child process (devkit/failover_child.py, Django over the cluster's multi-host settings)
on a primary with a synchronous standby (devkit/pgcluster.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from devkit.failover_child import REPO, Child
from devkit.pgcluster import Cluster, find_bindir, poll

BINDIR = find_bindir()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(BINDIR is None, reason="no PostgreSQL server binaries with pg_basebackup"),
]

TTL = 4.0  # trust window 3.6 s, renewals every 1.33 s
#: A hang guard: far beyond any stall of a loaded shared machine, far below the call's 60 s bound.
HANG = 20.0


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    assert BINDIR is not None
    cluster = Cluster(synchronous=True, bindir=BINDIR)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def holder(cluster: Cluster) -> Iterator[Child]:
    child = Child(cluster.django_database())
    try:
        assert child.call(op="migrate")["ok"]
        yield child
    finally:
        child.process.kill()  # a stuck child must not hold the test up
        child.process.wait(10)


def waiting_in(cluster: Cluster, wait_event: str, statement: str) -> Callable[[], list[int] | None]:
    def backends() -> list[int] | None:
        rows = cluster.primary.query(
            "SELECT pid FROM pg_stat_activity WHERE wait_event = %s AND position(%s in query) > 0",
            (wait_event, statement),
        )
        return [int(pid) for (pid,) in rows] or None

    return backends


def leave(holder: Child) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    reply = holder.call(op="unhold", timeout=60)
    return reply, time.monotonic() - started


def test_exit_is_bounded_when_commits_wait_for_a_standby_that_is_gone(cluster: Cluster, holder: Child) -> None:
    assert holder.call(op="hold", key="bounded-sync", ttl=TTL, owner="holder")["ok"]
    cluster.standby.stop("fast")  # every commit on the primary now waits for it, for ever
    poll(waiting_in(cluster, "SyncRep", "pg_lease_heartbeat"), timeout=30, what="a renewal to wait for the standby")
    reply, took = leave(holder)
    print(f"\nexit with a renewal stuck in its commit: {took:.2f}s (ttl {TTL}s)")
    assert reply["exited"] and reply["exit_error"] is None, reply
    # Within the trust window, plus the release's bound (max(renew interval, 1 s)) and the interrupt's
    # margins, and HANG for a loaded machine: the unbounded exit this guards against never ends.
    assert took < TTL * 0.9 + max(TTL / 3, 1.0) + HANG, took
    # Nothing of the hold's is left waiting on the primary: the stuck calls were cancelled.
    poll(
        lambda: not waiting_in(cluster, "SyncRep", "pg_lease_")(),
        timeout=10,
        what="the hold's cancelled calls to leave the primary",
    )


def test_exit_is_bounded_when_the_server_stops_answering(cluster: Cluster, holder: Child) -> None:
    assert holder.call(op="hold", key="bounded-stopped", ttl=TTL, owner="holder")["ok"]
    pgid = cluster.primary.pid
    os.killpg(pgid, signal.SIGSTOP)  # connections stay up; nothing answers
    try:
        # A renewal is due every ttl/3: once the trust left is below that much less than the window,
        # one was sent, and it hangs.
        poll(
            lambda: holder.call(op="held")["trust_remaining"] < TTL * 0.9 - TTL / 3 - 0.3,
            timeout=30,
            what="a renewal to be sent to the stopped server",
        )
        reply, took = leave(holder)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    print(f"\nexit with the server stopped: {took:.2f}s (ttl {TTL}s)")
    assert reply["exited"] and reply["exit_error"] is None, reply
    # The trust window, one interrupted renewal, and a release that cannot connect (connect_timeout 3 s,
    # tried twice on each of the two hosts) at most, and HANG for a loaded machine (unbounded: never).
    assert took < TTL * 0.9 + 2 * 2 * 3.0 + HANG, took


# ---- a lease call inside the caller's atomic(): the caller's COMMIT is the one checked -------------------

ATOMIC_CLIENT = """
import json, sys
from devkit.failover_child import configure
configure()
from django.core.management import call_command
from django.db import transaction
from pg_lease_django import Lease
call_command("migrate", "pg_lease_django", verbosity=0)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
try:
    with transaction.atomic():
        grant = Lease.objects.acquire("atomic-unconfirmed", "worker", ttl=60)
    print(json.dumps({"granted": grant is not None}), flush=True)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
"""


def test_a_grant_whose_callers_commit_is_not_confirmed_raises_out_of_atomic(cluster: Cluster) -> None:
    """``with atomic(): Lease.objects.acquire(...)``: the COMMIT at the block's end waits for the stopped
    standby and is cancelled; PostgreSQL answers success with a WARNING. The block raises
    ``UnconfirmedCommitError`` (an on_commit hook of the lease call checks the commit), not a grant."""
    database = json.dumps(cluster.django_database())
    client = subprocess.Popen(
        [sys.executable, "-c", ATOMIC_CLIENT],
        cwd=REPO,
        env={**os.environ, "PG_LEASE_FAILOVER_DATABASE": database, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None and client.stdin is not None
        assert json.loads(client.stdout.readline()) == {"ready": True}
        cluster.standby.stop("fast")
        client.stdin.write("go\n")
        client.stdin.flush()
        (pid,) = poll(waiting_in(cluster, "SyncRep", "COMMIT"), timeout=30, what="the caller's COMMIT to wait")
        cluster.primary.query("SELECT pg_cancel_backend(%s)", (pid,))
        outcome = json.loads(client.stdout.readline())
    finally:
        client.kill()
        client.wait(10)
    assert outcome["error"] == "UnconfirmedCommitError", outcome
    assert "canceling wait for synchronous replication" in outcome["message"], outcome
    # Committed on the primary only: the caller was told it cannot know.
    assert cluster.primary.query("SELECT owner FROM pg_lease_django_lease WHERE key = 'atomic-unconfirmed'") == [
        ("worker",)
    ]


@pytest.mark.django_db(transaction=True)
def test_one_commit_check_per_transaction_and_none_left_after_a_rollback(key: str) -> None:
    """The watch costs one on_commit hook per transaction that writes a lease, and its notice handler
    goes with the transaction, committed or rolled back. A read arms none."""
    from django.db import connection, transaction

    from pg_lease_django import Lease

    Lease.objects.inspect(key)  # outside atomic(): drops the watch an earlier rolled-back test left
    raw = connection.connection
    handlers = len(raw._notice_handlers)
    wrappers = len(connection.execute_wrappers)
    with transaction.atomic():
        grant = Lease.objects.acquire(key, "w1", ttl=30)
        assert grant is not None
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
        assert len(connection.run_on_commit) == 1
    assert len(raw._notice_handlers) == handlers
    with pytest.raises(RuntimeError), transaction.atomic():
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
        raise RuntimeError("roll back")
    with transaction.atomic():
        Lease.objects.inspect(key)  # a read: nothing of the package's to confirm at COMMIT
        assert len(connection.run_on_commit) == 0
        Lease.objects.renew(key, "w1", grant.epoch, ttl=30)
        assert len(connection.run_on_commit) == 1
        assert len(raw._notice_handlers) == handlers + 1  # the rolled-back transaction's handler is gone
        assert len(connection.execute_wrappers) == wrappers + 1
    assert len(raw._notice_handlers) == handlers
    assert len(connection.execute_wrappers) == wrappers


@pytest.mark.django_db(transaction=True)
def test_a_warning_of_a_statement_is_not_taken_for_an_unconfirmed_commit(key: str) -> None:
    """SQLSTATE 01000 is any WARNING: one a statement of the transaction raises (a trigger's ``RAISE
    WARNING``) is not the COMMIT's, and the block commits without an error."""
    from django.db import connection, transaction

    from pg_lease_django import Lease

    with transaction.atomic():
        assert Lease.objects.acquire(key, "w1", ttl=30) is not None
        with connection.cursor() as cursor:
            cursor.execute("DO $$ BEGIN RAISE WARNING 'audit: row changed'; END $$")
    assert Lease.objects.inspect(key).owner == "w1"
