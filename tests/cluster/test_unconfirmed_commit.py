"""Every acquire, sync or async, blocking or not, raises `UnconfirmedCommitError` for a grant whose
commit the synchronous standby did not confirm (docs/FAILURE-MODEL.md).

A throwaway server requires a synchronous standby that never comes (``synchronous_standby_names =
'nosuch'``, ``synchronous_commit = on``): every commit that writes waits in ``SyncRep`` for ever. The
test cancels each such wait from another connection (``pg_cancel_backend``), as a client-side
timeout or an operator would; PostgreSQL then answers the statement with success and a WARNING
(SQLSTATE 01000, "canceling wait for synchronous replication"). The calls run in a client process
(devkit/failover_child.py, Django on the throwaway server); the async ones in an event loop there.
Before the fix, ``aacquire(blocking=True)`` returned the grant: its wait sends its statements on an
async psycopg connection of its own, which had no notice handler.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from devkit.dbserver import LocalServer, database_settings, throwaway_datadir
from devkit.failover_child import Child
from devkit.pgcluster import poll

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.xdist_group("unconfirmed-commit")]

#: A hang guard for each answer: far beyond any stall of a loaded shared machine.
HANG = 60.0


@dataclass(frozen=True)
class Call:
    """One way to acquire: ``aacquire`` when ``asynchronous``; ``after_refusal``: the key is held when
    the call starts, and released while it waits (only a blocking call waits)."""

    asynchronous: bool
    blocking: bool
    after_refusal: bool = False

    @property
    def id(self) -> str:
        name = ("aacquire" if self.asynchronous else "acquire") + ("-blocking" if self.blocking else "")
        return name + ("-after-a-refusal" if self.after_refusal else "")


CALLS = [
    Call(asynchronous=False, blocking=False),
    Call(asynchronous=False, blocking=True),
    Call(asynchronous=False, blocking=True, after_refusal=True),
    Call(asynchronous=True, blocking=False),
    Call(asynchronous=True, blocking=True),
    Call(asynchronous=True, blocking=True, after_refusal=True),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    """A throwaway server whose every writing commit waits for a synchronous standby that never comes;
    the app migrated on it (by a session that does not wait: ``synchronous_commit = local``)."""
    server = LocalServer(throwaway_datadir("unconfirmed"))
    try:
        server.start("synchronous_standby_names=nosuch", "synchronous_commit=on")
        migrating = Child(database_settings(server.url(), OPTIONS={"options": "-c synchronous_commit=local"}))
        try:
            assert migrating.call(op="migrate", timeout=HANG)["ok"]
        finally:
            migrating.close()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def observer(server: LocalServer) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        yield conn


@pytest.fixture
def client(server: LocalServer) -> Iterator[Child]:
    child = Child(database_settings(server.url()))
    try:
        yield child
    finally:
        child.process.kill()  # a stuck child must not hold the test up
        child.process.wait(10)


def unreplicated(conn: psycopg.Connection[Any], statement: str, params: list[Any]) -> Any:
    """Run a lease function as a holder whose commit does not wait for the standby: the function forces
    ``synchronous_commit = on`` for its transaction, and ``SET LOCAL`` after it lowers it again."""
    with conn.transaction():
        row = conn.execute(statement, params).fetchone()
        conn.execute("SET LOCAL synchronous_commit = local")
    return row


def answer_cancelling_each_wait_for_the_standby(observer: psycopg.Connection[Any], client: Child) -> dict[str, Any]:
    """Cancel every commit that waits in ``SyncRep`` (once each) until the client answers; its answer,
    with ``cancelled``: the statements whose wait was cancelled, in order."""
    cancelled: list[str] = []
    seen: set[tuple[int, Any]] = set()

    def answered() -> dict[str, Any] | None:
        try:
            return client.replies.get_nowait()
        except queue.Empty:
            pass
        rows = observer.execute(
            "SELECT pid, xact_start, query FROM pg_stat_activity WHERE wait_event = 'SyncRep' ORDER BY xact_start"
        ).fetchall()
        for pid, xact_start, query in rows:
            if (pid, xact_start) not in seen:  # cancelled once: a second cancel could hit its next statement
                seen.add((pid, xact_start))
                observer.execute("SELECT pg_cancel_backend(%s)", [pid])
                cancelled.append(query)
        return None

    reply = poll(answered, timeout=HANG, what="the client's answer", interval=0.01)
    return {**reply, "cancelled": cancelled}


@pytest.mark.parametrize("call", CALLS, ids=[call.id for call in CALLS])
def test_a_grant_whose_wait_for_the_synchronous_standby_is_cancelled_raises_unconfirmed_commit(
    observer: psycopg.Connection[Any], client: Child, call: Call
) -> None:
    """The grant's commit waits for the standby and is cancelled: the call raises ``UnconfirmedCommitError``
    (an ``OperationalError``: outcome unknown), never returns the grant, though the primary committed it.
    After a refusal: the key is held when the call starts; the holder releases it once the waiter has
    registered (its refused attempt); the waiter's next attempt is the grant that waits."""
    key = f"unconfirmed-{call.id}"
    holder_epoch = None
    if call.after_refusal:
        (holder_epoch,) = unreplicated(observer, "SELECT epoch FROM pg_lease_acquire(%s, 'holder', '60 s')", [key])
    client.send(
        op="acquire",
        key=key,
        owner="waiter",
        ttl=60,
        blocking=call.blocking,
        timeout=HANG,
        asynchronous=call.asynchronous,
    )
    if call.after_refusal:
        poll(
            lambda: observer.execute("SELECT 1 FROM pg_lease_django_waiter WHERE key = %s", [key]).fetchone(),
            timeout=HANG,
            what="the waiter's refused attempt (its registration)",
        )
        (outcome,) = unreplicated(
            observer, "SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, holder_epoch]
        )
        assert outcome == "ok"
    reply = answer_cancelling_each_wait_for_the_standby(observer, client)
    assert not reply["ok"], reply
    assert reply["error"] == "UnconfirmedCommitError" and reply["operational"], reply
    assert "canceling wait for synchronous replication" in reply["message"], reply
    assert "pg_lease_acquire" in reply["cancelled"][0], reply
    (owner,) = observer.execute("SELECT owner FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone() or (0,)
    if call.blocking:
        # As for any attempt of a wait whose grant the caller did not get (settling.settle): the waiter
        # released the grant before raising; that release's commit waited for the standby too.
        assert owner is None and len(reply["cancelled"]) == 2, (owner, reply)
    else:
        # Committed on the primary only: the caller was told it cannot know.
        assert owner == "waiter" and len(reply["cancelled"]) == 1, (owner, reply)
