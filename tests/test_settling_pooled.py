"""Issue 44, item 3: settling an interrupted acquire without the server's pid.

Behind a transaction-pooling PgBouncer the pid a client sees is the pooler's, not the server
process running its statement, and the client's own cancel request can reach the server before the
statement does. The settling then cannot wait out the attempt by pid: it finds the attempt by what
it sent (the key and the owner, in the statement's text), cancels it and waits it out while the
row is still locked, so the attempt cannot grant after the settling has looked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from pg_lease_django import Lease
from pg_lease_django.sql import Statement, statements
from pg_lease_django.wait import settling
from tests.helpers import free
from tests.test_interrupts import HANG_GUARD, blocked_behind, not_running, row_locked

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


def _attempt_in_a_thread(key: str, owner: str) -> tuple[threading.Thread, list[BaseException]]:
    """``Lease.objects.acquire`` on a Django connection of another thread (as the interrupted caller's)."""
    raised: list[BaseException] = []

    def attempt() -> None:
        try:
            Lease.objects.acquire(key, owner, ttl=60)
        except BaseException as exc:  # the cancellation the settling sends
            raised.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    return thread, raised


@pytest.mark.parametrize("pid", ["an idle session's", "none running"])
def test_settling_finds_an_attempt_by_its_key_and_owner_without_its_pid(
    key: str, raw_connect: Connect, pid: str
) -> None:
    """The attempt is still blocked on the row lock when the settling runs, and the pid the settling
    has is not the attempt's (behind PgBouncer it is the pooler's): the attempt is cancelled on the
    server while the row is still locked, so nothing is granted once the lock goes. Before the fix
    the settling saw a free key and returned, and the attempt granted a lease nobody received. The
    owner's quote and backslash are rendered as the client renders them."""
    epoch = free(key)
    watch = raw_connect()
    owner = "w-pooled's \\ worker"
    with row_locked(raw_connect, key) as locker:
        thread, raised = _attempt_in_a_thread(key, owner)
        attempt = blocked_behind(watch, locker)
        not_the_attempts = watch.info.backend_pid if pid == "an idle session's" else 2**31 - 1
        settling.settle(connection, key, owner, not_the_attempts)
        not_running(watch, attempt)  # cancelled while the row is locked: it cannot grant later
        thread.join(HANG_GUARD)
        assert not thread.is_alive()
    assert [type(exc).__name__ for exc in raised] == ["OperationalError"], raised  # QueryCanceled, wrapped
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


@pytest.mark.parametrize("statement", [statements.ACQUIRE, statements.ACQUIRE_OR_REGISTER], ids=lambda s: s.name)
def test_every_acquire_shows_its_key_and_owner_as_attempt_text_expects(statement: Statement[Any]) -> None:
    """The settling finds a blocking wait's attempt (``acquire_or_register``) by the same text."""
    assert "pg_lease_acquire" in statement.text
    assert "(%s::text, %s::text," in statement.text


def test_settling_leaves_another_owners_attempt_alone(key: str, raw_connect: Connect) -> None:
    """The text that identifies the attempt names its owner: another owner's attempt on the same key,
    blocked beside it, runs on and is granted once the lock goes."""
    epoch = free(key)
    watch = raw_connect()
    with row_locked(raw_connect, key) as locker:
        thread, raised = _attempt_in_a_thread(key, "w-other")
        blocked_behind(watch, locker)
        settling.settle(connection, key, "w-pooled", None)
    thread.join(HANG_GUARD)
    assert not thread.is_alive() and not raised, raised
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "w-other", epoch + 1)
