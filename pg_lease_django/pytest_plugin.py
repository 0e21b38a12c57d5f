"""The pytest plugin, entry point ``pytest11``: flushable test databases and lease fixtures.

Loaded by pytest in every project where pg-lease-django is installed; disable it with
``-p no:pg_lease_django``. Importing it needs no Django settings and loads no models, and it does
nothing for projects that do not use pytest-django with ``pg_lease_django`` installed:

- When pytest-django's ``django_db_setup``, or a ``conftest.py`` override of it, has created the
  test databases, each PostgreSQL one gets ``pg_lease.allow_truncate = on``. So
  ``transaction=True`` tests and ``live_server`` can flush it; `pg_lease_django.testing` says why.
- The idle lease connections of ``hold()`` are closed after each test and before the test
  databases are dropped. The library itself knows nothing of test runs.
- Fixtures: ``lease_key``, which needs no database; ``assert_lease_held``, ``assert_lease_free``,
  ``take_over_lease`` and ``run_as_other_owner``, which request ``transactional_db``. A test that
  uses one of these is transactional, because holds work on connections of their own, which only
  see what is committed. A test that uses none of them gets no database from this plugin.

See docs/testing.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .managers import Grant, LeaseState


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    """Around ``django_db_setup``: let the test databases it created be flushed."""
    if fixturedef.argname != "django_db_setup":
        return (yield)
    from . import testing

    # The fixtures django_db_setup depends on (settings tweaks for xdist and tox) have run by now.
    planned = testing.plan_test_databases()
    result = yield
    # Finalizers run last in, first out: this one before django_db_setup drops the test databases,
    # which fails while a session (an idle lease connection of hold()) is connected.
    request.addfinalizer(_close_lease_connections)
    if planned:
        with request.getfixturevalue("django_db_blocker").unblock():
            testing.allow_truncate_on_created(planned)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After each test's teardown: close the idle lease connections of ``hold()`` it left."""
    try:
        return (yield)
    finally:
        _close_lease_connections()


def _close_lease_connections() -> None:
    # Only if a hold opened one: a project that never imported the pool needs nothing imported for it.
    lease_pool = sys.modules.get("pg_lease_django.holds.lease_pool")
    if lease_pool is not None:
        lease_pool.close_connections()


@pytest.fixture
def lease_key(request: pytest.FixtureRequest) -> str:
    """A lease key no other test uses: the test's name and a random suffix."""
    from .testing import unique_lease_key

    return unique_lease_key(request.node.name)


@pytest.fixture
def assert_lease_held(transactional_db: None) -> Callable[..., LeaseState]:
    """`pg_lease_django.testing.assert_lease_held`: fail unless the lease is held (by ``owner``, at ``epoch``)."""
    from .testing import assert_lease_held

    return assert_lease_held


@pytest.fixture
def assert_lease_free(transactional_db: None) -> Callable[..., LeaseState]:
    """`pg_lease_django.testing.assert_lease_free`: fail if anyone holds the lease."""
    from .testing import assert_lease_free

    return assert_lease_free


@pytest.fixture
def take_over_lease(transactional_db: None) -> Callable[..., Grant]:
    """`pg_lease_django.testing.take_over_lease`: make the holder lose the lease to another owner."""
    from .testing import take_over_lease

    return take_over_lease


@pytest.fixture
def run_as_other_owner(transactional_db: None) -> Callable[..., Any]:
    """`pg_lease_django.testing.run_as_other_owner`: run a callable in another thread, on its own connection."""
    from .testing import run_as_other_owner

    return run_as_other_owner
