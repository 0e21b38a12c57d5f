"""Shared fixtures: raw second connections to the test database, unique keys, leases in each state.

Helpers that are not fixtures live in ``tests/helpers.py``. The test databases are made flushable
(``pg_lease.allow_truncate``) by the package's own pytest plugin, ``pg_lease_django.pytest_plugin``,
as in any project that uses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from tests.helpers import conninfo, free, held, lapsed

_counter = itertools.count()


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


@pytest.fixture
def trio(key: str) -> dict[str, str]:
    """Three leases under the prefix ``key``, by state: held, lapsed and free (created out of key order)."""
    keys = {"held": f"{key}/b-held", "lapsed": f"{key}/a-lapsed", "free": f"{key}/c-free"}
    free(keys["free"])
    held(keys["held"], "worker-1")
    lapsed(keys["lapsed"], "worker-2")
    return keys
