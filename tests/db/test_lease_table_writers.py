"""Writers of the lease table other than the lease functions: a role granted UPDATE by hand moves
leases on (and has them recorded) through pg_lease_guard_update, which runs as the owner; nobody else
runs the tenure bookkeeping; and no plain UPDATE brings back a lapsed epoch, with acquire's grant
marker or with a shorter renewal that waited for a row lock past the expiry (review of migration 0005)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.test import override_settings
from psycopg import sql as pgsql

from pg_lease_django.provisioning.history import sync_scope
from tests.helpers import Background, conninfo, held, lapsed, wait_until, wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def updater(transactional_db: None) -> Iterator[Callable[[], psycopg.Connection[Any]]]:
    """A login role granted SELECT and UPDATE on the lease table by hand (docs/security.md, 'What
    your own grants add': it may extend or end any lease and take one over with a higher epoch)."""
    role = f"pgl_{uuid.uuid4().hex[:10]}_updater"
    admin = psycopg.connect(conninfo(), autocommit=True)
    opened: list[psycopg.Connection[Any]] = []
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    admin.execute(pgsql.SQL("GRANT SELECT, UPDATE ON pg_lease_django_lease TO {}").format(pgsql.Identifier(role)))

    def connect() -> psycopg.Connection[Any]:
        conn = psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), user=role), autocommit=True)
        opened.append(conn)
        return conn

    try:
        yield connect
    finally:
        for conn in opened:
            conn.close()
        admin.execute(pgsql.SQL("DROP OWNED BY {} CASCADE").format(pgsql.Identifier(role)))
        admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
        admin.close()


@pytest.fixture
def recorded(key: str) -> Iterator[str]:
    with override_settings(PG_LEASE_HISTORY=[key]):
        sync_scope()
        yield key
    sync_scope()


TAKE_OVER = (
    "UPDATE pg_lease_django_lease SET owner = 'by-hand', epoch = epoch + 1, acquired_at = clock_timestamp(), "
    "expires_at = clock_timestamp() + interval '1 minute' WHERE key = %s"
)
END = (
    "UPDATE pg_lease_django_lease SET owner = NULL, epoch = epoch + 1, acquired_at = NULL, expires_at = NULL, "
    "released_at = clock_timestamp() WHERE key = %s"
)


@pytest.mark.parametrize("statement", [TAKE_OVER, END], ids=["take-over", "end"])
def test_a_role_granted_update_may_still_move_an_unrecorded_lease_on(
    updater: Callable[[], psycopg.Connection[Any]], key: str, statement: str
) -> None:
    """UPDATE 1, as under the five triggers before 0005 (a guard running as the writer refused it:
    42501 on pg_lease_in_history_scope, checked for EXECUTE even when the flag did not change)."""
    epoch = lapsed(key, "w-old")
    conn = updater()
    assert conn.execute(statement, [key]).rowcount == 1
    row = conn.execute("SELECT epoch FROM pg_lease_django_lease WHERE key = %s", [key]).fetchone()
    assert row == (epoch + 1,)


def test_a_role_granted_update_ends_a_recorded_tenure_in_the_history(
    updater: Callable[[], psycopg.Connection[Any]], recorded: str, raw_connect: Connect
) -> None:
    """The tenure ends ('lapsed', by 'by-hand') and the new one is granted (a guard running as the
    writer refused it: 42501 on pg_lease_record_tenure)."""
    epoch = lapsed(recorded, "w-old")
    conn = updater()
    assert conn.execute(TAKE_OVER, [recorded]).rowcount == 1
    rows = (
        raw_connect()
        .execute(
            "SELECT epoch, owner, end_reason FROM pg_lease_django_tenure WHERE key = %s ORDER BY epoch", [recorded]
        )
        .fetchall()
    )
    assert rows == [(epoch, "w-old", "lapsed"), (epoch + 1, "by-hand", None)]


def test_nobody_but_the_owner_runs_the_tenure_bookkeeping(
    updater: Callable[[], psycopg.Connection[Any]], key: str
) -> None:
    """pg_lease_record_tenure writes any tenure it is handed: EXECUTE only for the owner."""
    held(key, "w1")
    conn = updater()
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(
            "SELECT pg_lease_record_tenure('INSERT', NULL, (SELECT l FROM pg_lease_django_lease l WHERE key = %s))",
            [key],
        )


def test_the_grant_marker_cannot_bring_back_a_lapsed_epoch(raw_connect: Connect, key: str) -> None:
    """The owner's plain UPDATE with acquire's marker and the same epoch was stamped as a grant, so
    the lapsed epoch was live again (fences on it answered 'ok'); a marker counts only with a new epoch."""
    epoch = lapsed(key, "w-old")
    conn = raw_connect()
    conn.execute(
        "UPDATE pg_lease_django_lease SET acquired_at = '-infinity', "
        "expires_at = 'epoch'::timestamptz + interval '1 hour' WHERE key = %s",
        [key],
    )
    row = conn.execute("SELECT pg_lease_fence(%s, 'w-old', %s)", [key, epoch]).fetchone()
    assert row == ("lapsed",)


def test_a_shorter_renewal_that_waited_past_the_expiry_is_refused(raw_connect: Connect, key: str) -> None:
    """A heartbeat with a shorter TTL than the grant's that waited on a lock-only locker past the
    expiry answered 'ok' with an expiry already past (the guard judged only an extended expiry)."""
    epoch = held(key, "w1", ttl=3)
    locker, caller, observer = raw_connect(autocommit=False), raw_connect(), raw_connect()
    locker.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE", [key])
    waiting = Background(
        lambda: caller.execute(
            "SELECT outcome FROM pg_lease_heartbeat(%s, 'w1', %s, interval '1 second')", [key, epoch]
        ).fetchone()[0]  # type: ignore[index]
    )
    waiting.start()
    wait_until_blocked(observer, caller.info.backend_pid)
    wait_until(
        lambda: bool(
            observer.execute(
                "SELECT expires_at <= clock_timestamp() FROM pg_lease_django_lease WHERE key = %s", [key]
            ).fetchone()[0]  # type: ignore[index]
        ),
        what="the lease to lapse while the heartbeat waits",
    )
    locker.commit()
    assert waiting.outcome() == "lapsed"


def test_a_raw_insert_cannot_store_the_markers(raw_connect: Connect, key: str) -> None:
    """'-infinity' marks a grant or a release for the update trigger; stored, it made every later
    UPDATE of the row a stamp or a skip (the scope's re-flag included)."""
    conn = raw_connect()
    with pytest.raises(psycopg.errors.CheckViolation, match="marks a grant or a release"):
        conn.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
            "VALUES (%s, 'w', 1, '-infinity', clock_timestamp() + interval '1 minute')",
            [key],
        )
    with pytest.raises(psycopg.errors.CheckViolation, match="marks a grant or a release"):
        conn.execute("INSERT INTO pg_lease_django_lease (key, epoch, released_at) VALUES (%s, 1, '-infinity')", [key])
