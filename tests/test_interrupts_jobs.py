"""Issue 44: the statement-by-statement interrupt harness over what is built on ``hold()``.

``@leased`` (sync and async) is interrupted just before and just after each statement it sends on
its lease connections (`_HoldStatements` of tests/test_interrupts.py), by a signal handler's
exception raised where the statement is sent. Each test is one point: a statement's index and
before/after. The number of statements of each call is pinned (`POINTS`): a change in what a call
sends shows here first, and the table of points stays what the tests say it is.

After each interruption: the call has ended (it raised the interruption), nothing is granted to the
interrupted owner (read from another session), no heartbeat renews it, and no session of ours is
left idle in a transaction.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync

from pg_lease_django import leased
from tests.helpers import held
from tests.test_interrupts import (
    HANG_GUARD,
    Connect,
    _fresh_lease_connections,
    _Interrupted,
    _no_hold_left,
    _no_hold_session_left,
    hold_statements,
)

pytestmark = pytest.mark.django_db(transaction=True)

#: Behind PgBouncer a lease connection sends more statements (``SET LOCAL`` in a transaction of its
#: own per renewal and release): the pinned counts are a direct connection's.
POOLED = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))

#: The statements each call sends on its lease connections, by form: the points are each one's
#: before and after.
POINTS: dict[str, int] = {
    "leased/free": 3,
    "leased/blocking": 5,
    "leased/contended": 7,
}


def _points(call: str) -> list[Any]:
    """``(step, when)`` for each point of ``call``: before and after each of its statements."""
    return [
        pytest.param(step, when, id=f"{step}-{when}")
        for step in range(1, POINTS[call] + 1)
        for when in ("before", "after")
    ]


def _check_count(call: str, sent: list[str]) -> None:
    """The counting run sent the pinned number of statements (behind PgBouncer: at least as many)."""
    if POOLED:
        assert len(sent) >= POINTS[call], sent
    else:
        assert len(sent) == POINTS[call], (call, len(sent), sent)


def _settled(watch: psycopg.Connection[Any], target: str, owner: str) -> None:
    """Nothing of ``target`` granted to ``owner`` (gone), and no session left idle in a transaction."""
    row = watch.execute(
        "SELECT owner, expires_at > clock_timestamp() FROM pg_lease_django_lease WHERE key = %s", [target]
    ).fetchone()
    assert row is None or row[0] != owner or not row[1], row
    idle = watch.execute(
        "SELECT pid, application_name, left(query, 120) FROM pg_stat_activity"
        " WHERE datname = current_database() AND state LIKE 'idle in transaction%%'"
    ).fetchall()
    assert idle == []


# -- @leased: a job's call, sync and async -----------------------------------------------------------


def _call_leased(mode: str, target: str, owner: str, how: str, body: Callable[[], None]) -> None:
    """Call a function decorated ``@leased(target, ...)`` (``def`` or ``async def``) whose body is ``body()``."""
    blocking = how != "free"
    timeout = HANG_GUARD if blocking else None  # a wait that never ended would fail, not hang
    _fresh_lease_connections()
    decorate = leased(target, ttl=60, owner=owner, blocking=blocking, timeout=timeout, on_busy="raise")
    if mode == "sync":

        @decorate
        def job() -> None:
            body()

        job()
        return

    @decorate
    async def ajob() -> None:
        body()

    async_to_sync(ajob)()


LEASED_CASES = [
    (mode, how, step, when)
    for mode in ("sync", "async")
    for how in ("free", "blocking", "contended")
    for step in range(1, POINTS[f"leased/{how}"] + 1)
    for when in ("before", "after")
]


@pytest.mark.parametrize(
    ("mode", "how", "step", "when"),
    [pytest.param(*case, id="-".join(map(str, case))) for case in LEASED_CASES],
)
def test_a_leased_call_interrupted_at_a_statement_leaves_nothing_granted(
    key: str, raw_connect: Connect, mode: str, how: str, step: int, when: str
) -> None:
    """A ``@leased`` call interrupted just ``when`` its ``step``-th statement (its hold's enter, then
    its exit): the interruption goes on, the body runs only if the enter was over, and the lease is
    not left to the interrupted owner (an interrupted exit still releases: free, one epoch on)."""
    watch = raw_connect()
    ran: list[int] = []
    with hold_statements(raw_connect) as statements:

        def prepare(target: str) -> None:
            if how == "contended":  # a holder that lets go as soon as the first attempt is refused
                statements.contender = (target, "contender", held(target, "contender", ttl=60))

        count = f"{key}/count"
        prepare(count)
        statements.arm()
        _call_leased(mode, count, "w-count", how, lambda: ran.append(len(statements.sent)))
        _check_count(f"leased/{how}", statements.sent)
        entered = ran.pop()
        assert any("pg_lease_release" in sql for sql in statements.sent[entered:]), statements.sent

        target = f"{key}/{step}/{when}"
        prepare(target)
        statements.arm({step: when})
        with pytest.raises(_Interrupted):
            _call_leased(mode, target, "w-int", how, lambda: ran.append(len(statements.sent)))
        assert len(ran) == (1 if step > entered else 0)  # the body ran once the enter was over
        _settled(watch, target, "w-int")
        if step > entered:
            state = watch.execute("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = %s", [target]).fetchone()
            assert state is not None and state[0] is None, state  # released by the interrupted exit
        _no_hold_left(key)
    _no_hold_session_left(watch)
