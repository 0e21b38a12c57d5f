"""How a lease call reaches psycopg: through Django's cursor whenever anything watches it, else directly.

Skipping Django's CursorWrapper saves a few microseconds per call (docs/performance.md); it must never
hide a call from what watches Django's cursor nor skip a check Django's cursor makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

from pg_lease_django import Lease, MissingRowError
from pg_lease_django.sql import run as executor
from pg_lease_django.sql import statements

pytestmark = pytest.mark.django_db(transaction=True)

# The connection object itself, as the manager uses it (``django.db.connection`` is a proxy to it).
connection = connections[DEFAULT_DB_ALIAS]


def test_nothing_watching_takes_the_direct_path() -> None:
    with connection.cursor() as cursor:  # a statement: it drops the watch a rolled-back test left
        cursor.execute("SELECT 1")
    assert executor._nothing_in_between(connection)
    assert executor._loads_in_django_time_zone(connection, connection.connection)


def test_a_rolled_back_transaction_leaves_no_watch_on_the_connection(key: str) -> None:
    """Inside atomic() a lease call watches the caller's COMMIT with an execute wrapper; a rollback
    drops the hook that would remove it, so the wrapper removes itself at the next statement instead
    of slowing every statement of the connection until the next lease call."""
    with pytest.raises(RuntimeError), transaction.atomic():
        Lease.objects.acquire(key, "w1", 30)
        assert not executor._nothing_in_between(connection), "the caller's COMMIT is watched"
        raise RuntimeError
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert connection.execute_wrappers == []
    assert executor._nothing_in_between(connection)


def test_an_execute_wrapper_sees_every_lease_call(key: str) -> None:
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert not executor._nothing_in_between(connection)
        grant = Lease.objects.acquire(key, "w1", 30)
        assert grant is not None
        Lease.objects.renew(key, "w1", grant.epoch, 30)
        Lease.objects.inspect(key)
        Lease.objects.release(key, "w1", grant.epoch)
    names = ["pg_lease_acquire", "pg_lease_heartbeat", "pg_lease_inspect", "pg_lease_release"]
    assert [name for sql in seen for name in names if name in sql] == names


def test_the_query_log_counts_every_lease_call(key: str) -> None:
    with CaptureQueriesContext(connection) as captured:
        grant = Lease.objects.acquire(key, "w1", 30)
        assert grant is not None
        Lease.objects.release(key, "w1", grant.epoch)
    assert len(captured.captured_queries) == 2


@pytest.fixture
def patched_cursor() -> Iterator[None]:
    """What django-debug-toolbar does: replace ``cursor`` on the connection object."""
    original = connection.cursor
    connection.cursor = original  # type: ignore[method-assign]
    try:
        yield
    finally:
        del connection.cursor


def test_a_patched_connection_cursor_is_used(patched_cursor: None) -> None:
    assert not executor._nothing_in_between(connection)


def test_the_direct_path_refuses_a_broken_transaction_as_django_does(key: str) -> None:
    with transaction.atomic():
        with pytest.raises(DatabaseError), transaction.atomic(savepoint=False), connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")
        assert executor._nothing_in_between(connection)
        with pytest.raises(TransactionManagementError):
            Lease.objects.inspect(key)


def test_the_direct_path_wraps_database_errors_as_django_does(key: str) -> None:
    assert executor._nothing_in_between(connection)
    with pytest.raises(DatabaseError) as info:  # django.db's, not psycopg's
        executor.one(connection, statements.INSPECT, key="x" * 300)  # invalid_input, raised by the function
    assert type(info.value).__module__ == "django.db.utils"


def test_a_zone_change_after_a_call_is_seen_by_the_next_call(key: str) -> None:
    """The direct path's verdict on the connection's loader is remembered per psycopg connection and
    zone: a call before the change (the verdict kept) and one after it load in the zone of each."""
    first = Lease.objects.acquire(key, "w1", 30)
    assert first is not None and first.server_time.utcoffset() == timedelta(0)
    original = connection.settings_dict["TIME_ZONE"]
    connection.settings_dict["TIME_ZONE"] = "Asia/Tokyo"
    del connection.timezone
    try:
        second = Lease.objects.acquire(key, "w1", 30)
        assert second is not None and second.server_time.utcoffset() == timedelta(hours=9)
    finally:
        connection.settings_dict["TIME_ZONE"] = original
        del connection.timezone
        connection.close()


@pytest.fixture
def database_time_zone_changed_after_connecting() -> Iterator[str]:
    """DATABASES['default']['TIME_ZONE'] changed once the connection is open (as Django's own tests
    do): Django's cursor then loads timestamps in the new zone, the connection's loader in the old."""
    connection.ensure_connection()
    zone = "Asia/Tokyo"
    original = connection.settings_dict["TIME_ZONE"]
    connection.settings_dict["TIME_ZONE"] = zone
    del connection.timezone
    try:
        yield zone
    finally:
        connection.settings_dict["TIME_ZONE"] = original
        del connection.timezone
        connection.close()


def test_timestamps_come_in_the_zone_djangos_cursor_would_use(
    database_time_zone_changed_after_connecting: str, key: str
) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        django_zone = cursor.fetchone()[0].tzinfo
    assert str(django_zone) == database_time_zone_changed_after_connecting
    assert not executor._loads_in_django_time_zone(connection, connection.connection)
    grant = Lease.objects.acquire(key, "w1", 30)
    assert grant is not None
    assert (grant.expires_at.tzinfo, grant.server_time.tzinfo) == (django_zone, django_zone)
    state = Lease.objects.inspect(key)
    assert state.expires_at is not None and state.expires_at.tzinfo == django_zone


def test_a_statement_sent_for_its_one_row_raises_when_it_answers_none() -> None:
    """`run.one` promises a row: none is a package error naming the statement, never a None returned."""
    with pytest.raises(MissingRowError, match="superuser_owner"):
        executor.one(connection, statements.SUPERUSER_OWNER, relation="pg_lease_django_no_such_table")
    assert executor.first(connection, statements.SUPERUSER_OWNER, relation="pg_lease_django_no_such_table") is None


def test_a_call_passes_exactly_the_parameters_its_statement_names(key: str) -> None:
    with pytest.raises(TypeError, match="needs the parameter 'key'"):
        executor.one(connection, statements.INSPECT, name=key)
    with pytest.raises(TypeError, match="takes"):
        executor.one(connection, statements.INSPECT, key=key, owner="w1")
    assert executor.one(connection, statements.INSPECT, key=key).key == key


def test_a_call_made_between_a_statement_and_its_fetch_reads_its_own_row(key: str) -> None:
    """The direct path keeps one psycopg cursor per connection and lends it to one call at a time. A
    lease call made after a statement was sent and before its row is read (a signal handler's, or
    another thread's on a shared connection) takes a cursor of its own: each reads its own row."""
    Lease.objects.inspect(key)  # the connection's cursor is kept from here on
    kept = connection.__dict__["_pg_lease_cursor"]
    inner: list[Any] = []

    def fetch_after_another_call(cursor: Any) -> Any:
        inner.append(Lease.objects.inspect(f"{key}:other"))
        return cursor.fetchone()

    row = executor._execute(connection, statements.INSPECT, {"key": key}, None, None, fetch_after_another_call)
    assert row[0] == key
    assert inner[0].key == f"{key}:other"
    assert connection.__dict__["_pg_lease_cursor"] is kept, "the outer call sent on the kept cursor"


def test_the_kept_cursor_follows_the_connection(key: str) -> None:
    """A call after Django reconnected sends on a cursor of the new psycopg connection, never on one
    of the closed connection."""
    Lease.objects.inspect(key)
    before = connection.__dict__["_pg_lease_cursor"]
    assert before.connection is connection.connection
    connection.close()
    assert Lease.objects.inspect(key).key == key
    after = connection.__dict__["_pg_lease_cursor"]
    assert after is not before and after.connection is connection.connection


@pytest.mark.parametrize("database_zone", [None, "Asia/Tokyo", "UTC"])
def test_the_direct_path_loads_timestamps_as_djangos_cursor_does(database_zone: str | None, key: str) -> None:
    """The direct path loads timestamptz with psycopg's own loader where the session's zone is the one
    Django sets on each value: the same instants with the same ``tzinfo`` object as Django's cursor
    gives, by default (``timezone.utc``) and with DATABASES' TIME_ZONE set before connecting: with
    "UTC" Django sets ``ZoneInfo("UTC")``, which psycopg's loader would not, and Django's loader stays."""
    original = connection.settings_dict["TIME_ZONE"]
    connection.close()
    connection.settings_dict["TIME_ZONE"] = database_zone
    del connection.timezone
    try:
        grant = Lease.objects.acquire(key, "w1", 30)
        assert grant is not None
        with connection.cursor() as cursor:
            cursor.execute("SELECT expires_at FROM pg_lease_django_lease WHERE key = %s", [key])
            (django_expires_at,) = cursor.fetchone()
        assert grant.expires_at == django_expires_at
        assert grant.expires_at.tzinfo is django_expires_at.tzinfo is connection.timezone
        assert grant.server_time.tzinfo is connection.timezone
        state = Lease.objects.inspect(key)
        assert state.expires_at is not None
        assert (state.expires_at, state.expires_at.tzinfo) == (django_expires_at, connection.timezone)
    finally:
        connection.close()
        connection.settings_dict["TIME_ZONE"] = original
        del connection.timezone
