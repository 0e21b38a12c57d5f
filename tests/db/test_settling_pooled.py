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
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend

from pg_lease_django import Lease, operations
from pg_lease_django.sql import statements
from pg_lease_django.wait import settling
from tests.db.test_interrupts import HANG_GUARD, blocked_behind, not_running, row_locked
from tests.helpers import free, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


def _attempt_in_a_thread(
    key: str, owner: str, *, register: bool = False, server_side_binding: bool = False
) -> tuple[threading.Thread, list[BaseException], settling.InFlight]:
    """An attempt (as ``Lease.objects.acquire`` sends it) on a Django connection of another thread (as
    the interrupted caller's), carrying its marker; the thread, what it raised, and its identity.
    With ``server_side_binding`` the connection is one of its own whose cursors bind server-side."""
    raised: list[BaseException] = []
    identity: list[settling.InFlight] = []
    ready = threading.Event()

    def attempt() -> None:
        connection = _bound_server_side() if server_side_binding else connections[DEFAULT_DB_ALIAS]
        try:
            identity.append(settling.attempt_in_flight(connection))
            ready.set()
            ttl, marker = timedelta(seconds=60), identity[0].marker
            if register:  # a blocking wait's attempt
                operations.attempt_or_register(connection, key, owner, ttl, timedelta(seconds=60), marker)
            else:
                operations.acquire(connection, key, owner, ttl, marker)
        except BaseException as exc:  # the cancellation the settling sends
            raised.append(exc)
        finally:
            ready.set()
            connection.close()
            connections.close_all()

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    ready.wait(HANG_GUARD)
    return thread, raised, identity[0]


def _bound_server_side() -> BaseDatabaseWrapper:
    """A Django connection of its own to the test database with ``server_side_binding``."""
    source = connections[DEFAULT_DB_ALIAS].settings_dict
    settings = {**source, "OPTIONS": {**(source.get("OPTIONS") or {}), "server_side_binding": True}}
    wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, DEFAULT_DB_ALIAS)
    return wrapper


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
        thread, raised, sent = _attempt_in_a_thread(key, owner)
        attempt = blocked_behind(watch, locker)
        not_the_attempts = watch.info.backend_pid if pid == "an idle session's" else 2**31 - 1
        settling.settle(connection, key, owner, settling.InFlight(not_the_attempts, sent.marker))
        not_running(watch, attempt)  # cancelled while the row is locked: it cannot grant later
        thread.join(HANG_GUARD)
        assert not thread.is_alive()
    assert [type(exc).__name__ for exc in raised] == ["OperationalError"], raised  # QueryCanceled, wrapped
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


@pytest.mark.parametrize("server_side_binding", [False, True], ids=["client-side binding", "server-side binding"])
@pytest.mark.parametrize("register", [False, True], ids=["acquire", "acquire_or_register"])
def test_every_attempt_starts_with_its_marker(
    key: str, raw_connect: Connect, register: bool, server_side_binding: bool
) -> None:
    """The settling finds a blocking wait's attempt (``acquire_or_register``) by its marker too: the
    start of the text the server shows, whatever it shows of the values. Bound client-side (Django's
    default) the marker is a parameter inside the comment, which the server shows quoted; bound
    server-side, where a parameter would show as $1, it is written into the text."""
    free(key)
    watch = raw_connect()
    with row_locked(raw_connect, key) as locker:
        thread, _, sent = _attempt_in_a_thread(
            key, "w-marked", register=register, server_side_binding=server_side_binding
        )
        attempt = blocked_behind(watch, locker)
        shown = watch.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [attempt]).fetchone()
        comment = f"/* {sent.marker} */" if server_side_binding else f"/* '{sent.marker}' */"
        assert shown is not None and shown[0].startswith(f"{comment} SELECT"), shown
        assert ("$1" in shown[0]) is server_side_binding  # the binding the test means
        found = watch.execute(
            "SELECT pid FROM pg_stat_activity WHERE strpos(query, %s) > 0 AND pid <> pg_backend_pid()", [sent.marker]
        ).fetchall()
        assert found == [(attempt,)]  # the settling's search (cancel_attempt) finds it, and only it
    thread.join(HANG_GUARD)


@pytest.mark.parametrize("server_side_binding", [False, True], ids=["client-side binding", "server-side binding"])
def test_settling_cancels_an_attempt_found_by_its_marker_under_either_binding(
    key: str, raw_connect: Connect, server_side_binding: bool
) -> None:
    """An attempt sent by the package, bound either way, is found by its marker alone (no pid) and
    cancelled while the row is still locked: nothing is granted once the lock goes."""
    epoch = free(key)
    watch = raw_connect()
    owner = "w-bound"
    with row_locked(raw_connect, key) as locker:
        thread, raised, sent = _attempt_in_a_thread(key, owner, server_side_binding=server_side_binding)
        attempt = blocked_behind(watch, locker)
        settling.settle(connection, key, owner, settling.InFlight(2**31 - 1, sent.marker))
        not_running(watch, attempt)
        thread.join(HANG_GUARD)
        assert not thread.is_alive()
    assert [type(exc).__name__ for exc in raised] == ["OperationalError"], raised  # QueryCanceled, wrapped
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


def test_settling_leaves_another_owners_attempt_alone(key: str, raw_connect: Connect) -> None:
    """The marker identifies the attempt: another owner's attempt on the same key, blocked beside it,
    runs on and is granted once the lock goes."""
    epoch = free(key)
    watch = raw_connect()
    with row_locked(raw_connect, key) as locker:
        thread, raised, _ = _attempt_in_a_thread(key, "w-other")
        blocked_behind(watch, locker)
        settling.settle(
            connection, key, "w-pooled", settling.InFlight(2**31 - 1, settling.attempt_in_flight(connection).marker)
        )
    thread.join(HANG_GUARD)
    assert not thread.is_alive() and not raised, raised
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "w-other", epoch + 1)


def test_a_statement_quoting_the_key_and_owner_is_neither_cancelled_nor_taken_for_the_attempt(
    key: str, raw_connect: Connect
) -> None:
    """Issue 52, finding 4: settling by statement text cancelled an unrelated session whose query
    merely quoted the key and owner (listed first). Only the attempt carrying the marker is."""
    epoch = free(key)
    watch, decoy = raw_connect(), raw_connect()
    owner = "w-quoted"
    quoted = f"SELECT pg_sleep(60) /* pg_lease_acquire('{key}'::text, '{owner}'::text, */"
    decoy_thread = threading.Thread(target=lambda: _swallow(decoy, quoted), daemon=True)
    decoy_thread.start()
    wait_until(lambda: _running(watch, decoy.info.backend_pid), HANG_GUARD, "the decoy to run")
    with row_locked(raw_connect, key) as locker:
        thread, raised, sent = _attempt_in_a_thread(key, owner)
        attempt = blocked_behind(watch, locker)
        settling.settle(connection, key, owner, settling.InFlight(2**31 - 1, sent.marker))
        not_running(watch, attempt)  # the attempt: cancelled while the row is locked
        assert _running(watch, decoy.info.backend_pid)  # the decoy: left alone
    thread.join(HANG_GUARD)
    assert [type(exc).__name__ for exc in raised] == ["OperationalError"], raised
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)
    watch.execute("SELECT pg_cancel_backend(%s)", [decoy.info.backend_pid])
    decoy_thread.join(HANG_GUARD)


def test_an_attempt_sent_with_server_side_binding_is_found_by_its_marker(key: str, raw_connect: Connect) -> None:
    """Issue 52, finding 4: with server-side binding the server shows $1 for the key and owner, so
    settling by text found nothing and returned while the attempt still ran (it was granted after).
    The marker is part of the text, not a value."""
    epoch = free(key)
    watch, sender = raw_connect(), raw_connect()  # psycopg's own cursor binds server-side
    sent = settling.attempt_in_flight(connection)
    text = f"/* {sent.marker} */ " + statements.ACQUIRE.compose("public").as_string(sender)
    outcome: list[Any] = []
    with row_locked(raw_connect, key) as locker:
        sent_params = {"key": key, "owner": "w-bound", "ttl": "60 seconds"}
        thread = threading.Thread(target=lambda: _swallow(sender, text, sent_params, outcome))
        thread.start()
        attempt = blocked_behind(watch, locker)
        shown = watch.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [attempt]).fetchone()
        assert shown is not None and "$1" in shown[0]
        settling.settle(connection, key, "w-bound", settling.InFlight(2**31 - 1, sent.marker))
        not_running(watch, attempt)
    thread.join(HANG_GUARD)
    assert outcome == ["57014"]  # cancelled
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("free", epoch)


def _running(watch: psycopg.Connection[Any], pid: int) -> bool:
    return watch.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == ("active",)


def _swallow(conn: psycopg.Connection[Any], query: str, params: Any = None, outcome: list[Any] | None = None) -> None:
    """Run ``query`` on ``conn``; the SQLSTATE it failed with goes to ``outcome``."""
    try:
        conn.execute(query, params)
    except psycopg.Error as exc:
        if outcome is not None:
            outcome.append(exc.sqlstate)
