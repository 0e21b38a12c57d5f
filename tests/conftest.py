"""Shared fixtures: raw second connections to the test database, unique keys, row snapshots.

The test databases are made flushable (``pg_lease.allow_truncate``) by the package's own pytest
plugin, ``pg_lease_django.pytest_plugin``, as in any project that uses it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from django.db import connections

from tests import dbserver

_counter = itertools.count()


def conninfo(alias: str = "default") -> str:
    """libpq conninfo for the (test) database behind ``alias``.

    Behind PgBouncer (``DIRECT_DATABASE_URL`` set by .ci/with-pgbouncer) the tests' own
    orchestration connections go straight to the server, so backend pids and locks they observe
    are real; the code under test still goes through the pooler.
    """
    database = dict(connections[alias].settings_dict)
    direct = os.environ.get("DIRECT_DATABASE_URL")
    if direct:
        parts = urlsplit(direct)
        database.update(HOST=parts.hostname, PORT=str(parts.port or 5432))
    return dbserver.conninfo(database)


#: Tests that need the session of Django's own connection (its backend pid, LISTEN) cannot run
#: through a transaction-pooling PgBouncer, which hands each transaction another server session.
needs_session = pytest.mark.skipif(
    bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER")), reason="needs a server session; PgBouncer pools transactions"
)


@pytest.fixture
def raw_connect(transactional_db: None) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Open extra connections to the test database, outside Django (another client).

    Needs a transactional test: the other client only sees what Django committed.
    """
    opened: list[psycopg.Connection[Any]] = []

    def connect(autocommit: bool = True) -> psycopg.Connection[Any]:
        conn = psycopg.connect(conninfo(), autocommit=autocommit)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A key no other test uses (rows are never deleted, so keys must not collide)."""
    return f"{request.node.name[:200]}#{next(_counter)}"


def row_snapshot(conn: psycopg.Connection[Any], key: str) -> tuple[Any, ...] | None:
    """The row's content and its tuple identity: unchanged means no write and no row lock."""
    return conn.execute(
        "SELECT l::text, xmin::text, xmax::text, ctid::text FROM pg_lease_django_lease l WHERE key = %s", [key]
    ).fetchone()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_until_blocked(conn: psycopg.Connection[Any], pid: int, timeout: float = 10.0) -> None:
    """Wait until backend ``pid`` is waiting on a lock held by another backend."""
    wait_until(
        lambda: bool(conn.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", [pid]).fetchone()[0]),  # type: ignore[index]
        timeout,
        f"backend {pid} to block on a lock",
    )


class Background(threading.Thread):
    """Run ``fn`` in a thread, keeping its result or exception for the test to inspect."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc

    def outcome(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.result
