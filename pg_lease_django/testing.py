"""Testing support: test databases that may be flushed, and helpers for testing your lease code.

The lease table refuses ``TRUNCATE``, and so do the tables of fenced models. A truncated table
would restart every epoch at 1 and un-fence every stale holder. Django's ``TransactionTestCase``
and ``LiveServerTestCase`` empty the database with ``TRUNCATE`` after every test, so a test
database must opt in: ``ALTER DATABASE <test db> SET pg_lease.allow_truncate = on``. This module
does that for the test databases Django creates, and only for those:

- Django's test runner: ``TEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner"``;
- pytest-django: nothing to configure; the ``pytest11`` plugin, `pg_lease_django.pytest_plugin`,
  does it when ``django_db_setup`` has created the test databases;
- another runner: call `allow_truncate_on_test_databases` with what ``setup_databases`` returned.

The helpers `unique_lease_key`, `assert_lease_held`, `assert_lease_free`, `take_over_lease` and
`run_as_other_owner` work under both runners; the pytest plugin also offers them as fixtures.
See docs/testing.md.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, connections, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.creation import TEST_DATABASE_PREFIX
from django.test.runner import DiscoverRunner
from psycopg import sql as pgsql

from .exceptions import OperatorRefusalError
from .holds import lease_pool
from .holds.lease import HeldLease
from .managers import Grant, LeaseManager, LeaseState
from .sql import run, statements

__all__ = [
    "LeaseTestRunner",
    "OtherOwner",
    "allow_truncate_on_test_databases",
    "assert_lease_free",
    "assert_lease_held",
    "run_as_other_owner",
    "start_as_other_owner",
    "take_over_lease",
    "unique_lease_key",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: What ``django.test.utils.setup_databases`` returns: (connection, original NAME, created here).
OldConfig = Sequence[tuple[BaseDatabaseWrapper, str, bool]]

#: The owner `take_over_lease` acquires as, unless told otherwise.
TAKEOVER_OWNER = "pg_lease_django.testing:takeover"

_SETTING = "pg_lease.allow_truncate"


# ---- test databases ---------------------------------------------------------------------------


def allow_truncate_on_test_databases(old_config: OldConfig, *, parallel: int = 0) -> list[str]:
    """Let the test databases that ``setup_databases`` just created be flushed.

    Runs ``ALTER DATABASE <name> SET pg_lease.allow_truncate = on`` for every PostgreSQL test
    database in ``old_config``, and for its clones in a parallel run. Then it closes the connection
    and its pool, because the setting applies only to sessions opened afterwards. It is idempotent,
    so a database kept by ``--keepdb`` or ``--reuse-db`` is simply set again.

    Only test databases qualify. An entry is skipped unless this connection created it, which its
    third element says. It is skipped too unless its name now differs from the original ``NAME``:
    Django replaces that with the test database's name. A mirror, ``TEST["MIRROR"]``, shares its
    primary's database and is skipped. ``CREATE DATABASE ... TEMPLATE`` does not copy database
    settings, so each clone of a parallel run is set on its own.

    The fenced tables' triggers honour the setting only for roles that may run
    ``pg_lease_allow_unfenced()``. The role that runs the tests migrated the test database, so it
    owns that function and may.

    Args:
        old_config: the list that ``django.test.utils.setup_databases`` or
            ``DiscoverRunner.setup_databases`` returned: ``(connection, original name, created)``
            per alias.
        parallel: the number of parallel test processes, whose clones are set too; 0 or 1 for none.

    Returns:
        The names of the databases set.

    Raises:
        DatabaseError: the setting could not be stored, because the role running the tests does not
            own the test database; a note says what to do.
    """
    done: list[str] = []
    seen: set[tuple[str, str, str]] = set()  # (host, port, name): two aliases may share a database
    for connection, original_name, created in old_config:
        test_name = connection.settings_dict["NAME"]
        if not created or connection.vendor != "postgresql" or not test_name or test_name == original_name:
            continue
        names = [test_name]
        if parallel > 1:
            names += [connection.creation.get_test_db_clone_settings(str(n))["NAME"] for n in range(1, parallel + 1)]
        server = (str(connection.settings_dict["HOST"]), str(connection.settings_dict["PORT"]))
        for name in names:
            if (*server, name) not in seen:
                _allow_truncate(connection, name)
                seen.add((*server, name))
                done.append(name)
        connection.close()
        close_pool = getattr(connection, "close_pool", None)  # PostgreSQL's wrapper has one
        if close_pool is not None:
            close_pool()  # pooled sessions opened before the ALTER would not have the setting
    return done


def _allow_truncate(connection: BaseDatabaseWrapper, name: str) -> None:
    database = pgsql.Identifier(name)
    try:
        run.run(connection, statements.ALLOW_TRUNCATE, parts={"database": database})
    except DatabaseError as exc:
        statement = statements.ALLOW_TRUNCATE.compose(None, database=database).as_string(None)
        exc.add_note(
            f"pg_lease_django could not let test database {name!r} be flushed; run `{statement}` as its owner, "
            "or run the tests as the role that creates the test database."
        )
        raise
    logger.debug("%s: %s = on (test database)", name, _SETTING)


class LeaseTestRunner(DiscoverRunner):
    """Django's test runner, with test databases that ``TransactionTestCase`` may flush.

    Set ``TEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner"``. Django creates the test
    databases, or reuses them with ``--keepdb``. Then each PostgreSQL one gets
    ``pg_lease.allow_truncate = on`` through `allow_truncate_on_test_databases`. Without it the
    flush after every ``TransactionTestCase`` / ``LiveServerTestCase`` test fails with "Database
    ... couldn't be flushed". A project with a runner of its own subclasses this one instead of
    ``DiscoverRunner``.
    """

    def setup_databases(self, **kwargs: Any) -> list[tuple[BaseDatabaseWrapper, str, bool]]:
        """Create the test databases as ``DiscoverRunner`` does, then let them be flushed."""
        old_config: list[tuple[BaseDatabaseWrapper, str, bool]] = super().setup_databases(**kwargs)
        allow_truncate_on_test_databases(old_config, parallel=self.parallel)
        return old_config

    def teardown_databases(self, old_config: list[tuple[BaseDatabaseWrapper, str, bool]], **kwargs: Any) -> None:
        """Close the idle lease connections of ``hold()``, then drop the test databases as ``DiscoverRunner`` does.

        DROP DATABASE fails while any session is connected to the database.
        """
        lease_pool.close_connections()
        super().teardown_databases(old_config, **kwargs)


# ---- helpers for tests of lease code ----------------------------------------------------------


def unique_lease_key(prefix: str = "test") -> str:
    """A lease key no other test (and no earlier run on a kept database) has used.

    Leases taken by ``hold()`` commit on connections of their own, so a test's rollback does not
    remove them: give each test its own keys.

    Args:
        prefix: the start of the key, cut to 100 bytes; a random suffix follows.
    """
    head = prefix.encode()[:100].decode(errors="ignore")
    return f"{head}:{uuid.uuid4().hex[:12]}"


def _manager(using: str | None) -> LeaseManager:
    from .models import Lease

    return Lease.objects.db_manager(using or router.db_for_write(Lease))


def _key_of(lease: str | HeldLease | Grant) -> str:
    return lease if isinstance(lease, str) else lease.key


def assert_lease_held(
    lease: str | HeldLease | Grant, owner: str | None = None, *, epoch: int | None = None, using: str | None = None
) -> LeaseState:
    """Fail unless the lease is held now, by the server clock, by ``owner`` and at ``epoch`` if given.

    Args:
        lease: the key; or a `HeldLease` / `Grant`, which must itself still hold it. Its owner and
            epoch are checked unless ``owner`` / ``epoch`` say otherwise.
        owner: the owner that must hold it; None accepts any, for a key.
        epoch: the epoch it must be held at; None accepts any, for a key.
        using: the database alias; default the router's write database for `Lease`.

    Returns:
        The `LeaseState` read, in one query on the caller's connection.

    Raises:
        AssertionError: the lease is free or lapsed, or held by another owner or at another epoch.
    """
    key = _key_of(lease)
    if not isinstance(lease, str):
        owner = lease.owner if owner is None else owner
        epoch = lease.epoch if epoch is None else epoch
    state = _manager(using).inspect(key)
    if not state.held:
        raise AssertionError(f"lease {key!r} is not held: {_describe(state)}")
    if owner is not None and state.owner != owner:
        raise AssertionError(f"lease {key!r} is held by {state.owner!r}, not {owner!r}: {_describe(state)}")
    if epoch is not None and state.epoch != epoch:
        raise AssertionError(f"lease {key!r} is held at epoch {state.epoch}, not {epoch}: {_describe(state)}")
    return state


def assert_lease_free(lease: str | HeldLease | Grant, *, using: str | None = None) -> LeaseState:
    """Fail if anyone holds the lease now: it must be free or lapsed, and so may be acquired at once.

    Args:
        lease: the key, or a `HeldLease` / `Grant`, whose key is read.
        using: the database alias; default the router's write database for `Lease`.

    Returns:
        The `LeaseState` read; ``status`` tells ``"free"`` from ``"lapsed"``.

    Raises:
        AssertionError: the lease is held.
    """
    key = _key_of(lease)
    state = _manager(using).inspect(key)
    if state.held:
        raise AssertionError(f"lease {key!r} is held: {_describe(state)}")
    return state


def _describe(state: LeaseState) -> str:
    return f"status {state.status}, owner {state.owner!r}, epoch {state.epoch}, expires_at {state.expires_at}"


def take_over_lease(
    lease: str | HeldLease | Grant,
    *,
    owner: str = TAKEOVER_OWNER,
    ttl: float | timedelta = 60,
    wait: float | None = 30.0,
    using: str | None = None,
) -> Grant:
    """Make the holder lose the lease: free it whoever holds it and acquire it as ``owner``.

    It does in one transaction what another worker does after the holder lapsed, or what an
    operator's force release and a new worker do. The epoch goes up, so the old holder's fenced
    writes are refused from now on, and its next renewal hears ``not_owner``. Given a `HeldLease`,
    say ``current_lease()`` inside the job under test, it also waits until that hold has noticed
    through ``lease.lost``. So code that calls ``lease.check()`` next sees the loss.

    It runs on the caller's connection. The holder's heartbeat runs on connections of the lease's
    own, so it sees the takeover only once committed. In a test, use a transactional test:
    ``TransactionTestCase`` or ``@pytest.mark.django_db(transaction=True)``.

    Args:
        lease: the key, or a `HeldLease` / `Grant`, whose epoch must still be the current one.
        owner: the new holder's identity.
        ttl: the new grant's TTL, in seconds or a timedelta; release it with ``Lease.objects.release``.
        wait: with a `HeldLease`, the longest wait in seconds for it to notice; None does not wait.
        using: the database alias; default the router's write database for `Lease`.

    Returns:
        The new owner's `Grant`.

    Raises:
        EpochMovedOnError: a `HeldLease` / `Grant` was given and the lease had moved on already.
            It is an `OperatorRefusalError`, as ``force_release(epoch=...)`` raises, and is
            ``AlreadyFreeError`` instead when the lease was free.
        AssertionError: the `HeldLease` did not notice the loss within ``wait`` seconds.
    """
    key = _key_of(lease)
    epoch = None if isinstance(lease, str) else lease.epoch
    manager = _manager(using)
    with transaction.atomic(using=manager.db):
        try:
            manager.force_release(key, epoch=epoch)
        except OperatorRefusalError:  # free, or never acquired: nothing to free first
            if epoch is not None:
                raise
        grant = manager.acquire(key, owner, ttl)
    if grant is None:  # cannot happen: it was acquired in the transaction that freed it
        raise AssertionError(f"lease {key!r} could not be taken over")
    if isinstance(lease, HeldLease) and wait is not None and not lease.wait_lost(wait):
        raise AssertionError(f"{lease!r} did not notice the takeover within {wait} s")
    return grant


class OtherOwner(threading.Thread, Generic[R]):
    """A callable running in a thread of its own, as another worker would: see `start_as_other_owner`."""

    def __init__(self, fn: Callable[[], R]) -> None:
        super().__init__(name=f"pg_lease_django other owner {getattr(fn, '__name__', fn)!r}", daemon=True)
        self._fn = fn
        self._result: R | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:
            self._error = exc
        finally:
            connections.close_all()  # this thread's own Django connections

    def result(self, timeout: float | None = 30.0) -> R:
        """Wait for the callable and return its result, or raise what it raised.

        Raises:
            AssertionError: it did not finish within ``timeout`` seconds (it keeps running).
        """
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set by run() when there was no error


def start_as_other_owner(fn: Callable[[], R]) -> OtherOwner[R]:
    """Start ``fn`` in another thread, on its own database connections, and return at once.

    The thread starts with no active hold (``current_lease()`` is None there) and closes its
    Django connections when ``fn`` returns. Call ``.result()`` to wait for it. For code that must
    run concurrently with the test, such as a blocking acquire the test then releases.
    """
    other = OtherOwner(fn)
    other.start()
    return other


def run_as_other_owner(fn: Callable[[], R], *, timeout: float | None = 30.0) -> R:
    """Run ``fn`` as another worker would, and return its result or raise its exception.

    ``fn`` runs in another thread, on Django connections of its own, which are closed when it
    ends. No hold is active there: what it sees is what the test committed. Use a transactional
    test.

    Raises:
        AssertionError: ``fn`` did not finish within ``timeout`` seconds.
    """
    return start_as_other_owner(fn).result(timeout)


# ---- for the pytest plugin (internal: not in __all__, not documented API) ---------------------

#: Per PostgreSQL alias: its NAME before the test databases are set up, and the test NAME it will get.
PlannedNames = dict[str, tuple[str, str]]


def plan_test_databases() -> PlannedNames:
    """Before pytest-django's ``django_db_setup``: each alias's NAME and the name of its test database.

    Empty when ``pg_lease_django`` is not an installed app: then nothing is set.
    """
    from django.apps import apps

    if not apps.is_installed("pg_lease_django"):
        return {}
    planned: PlannedNames = {}
    for alias in connections:
        connection = connections[alias]
        if connection.vendor == "postgresql":
            # The name create_test_db() will use: TEST["NAME"], else "test_" + NAME (after
            # pytest-django's xdist/tox suffixes, which django_db_setup's own fixtures applied).
            name = connection.settings_dict["NAME"]
            planned[alias] = (name, connection.settings_dict["TEST"]["NAME"] or TEST_DATABASE_PREFIX + name)
    return planned


def allow_truncate_on_created(planned: PlannedNames) -> list[str]:
    """After ``django_db_setup``: set the databases whose alias moved from its NAME to its planned test name.

    That move is what ``create_test_db()`` does, and only it: an override of ``django_db_setup``
    that points an alias at another existing database, or creates nothing, leaves it alone.
    """
    old_config = [
        (connections[alias], name, True)
        for alias, (name, test_name) in planned.items()
        if connections[alias].settings_dict["NAME"] == test_name != name
    ]
    return allow_truncate_on_test_databases(old_config)
