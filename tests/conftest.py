"""Shared fixtures: raw second connections to the test database, unique keys, leases in each state.

Helpers that are not fixtures live in ``tests/helpers.py``. The test databases are made flushable
(``pg_lease.allow_truncate``) by the package's own pytest plugin, ``pg_lease_django.pytest_plugin``,
as in any project that uses it.
"""

from __future__ import annotations

import itertools
import os
import signal
import uuid
from collections.abc import Callable, Generator, Iterator
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.apps import apps
from django.core.management import call_command
from django.core.management.color import no_style
from django.db import connections
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase, override_settings
from psycopg import sql as pgsql

from pg_lease_django.provisioning import history, privileges
from tests import tiers
from tests.helpers import Tenants, conninfo, free, held, lapsed, manage, sessions_left

_counter = itertools.count()

# A suite started as a background job of a shell without job control (`make test &`, a CI script
# run with `&`) inherits SIGINT ignored, and so would every process the tests start: the tests of
# SIGINT (forwarded to COMMAND, a KeyboardInterrupt in a job) need it as a terminal gives it.
# Ignored dispositions survive exec, handlers do not: Python's default handler here restores both.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: Tests that take long start first (in the random order among themselves): parallel workers then
#: end together, rather than three waiting while the fourth runs a long test drawn last.
LONG = ("slow", "soak", "acceptance")


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which this keeps within each group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not any(item.get_closest_marker(name) for name in LONG))


def pytest_configure(config: pytest.Config) -> None:
    # A plugin, not a hook of this conftest: pytest calls a conftest's hooks only for the fixtures of
    # its directory, and django_db_setup is pytest-django's, set up at the session's level.
    config.pluginmanager.register(NoSessionLeft(), "tests-no-session-left")
    tiers.register(config)  # the legs' markers (pooler, server_version) and make test's last line
    TransactionTestCase._fixture_teardown = _flush_keeping_content_types  # type: ignore[attr-defined]  # Django's, unstubbed


#: The tables a transactional test's flush leaves as they are: the rows Django's post_migrate would
#: write again, the same, after every flush (content types and the permissions built on them).
KEPT_BY_FLUSH = frozenset({"django_content_type", "auth_permission"})
_django_fixture_teardown = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]  # Django's, unstubbed


def _flush_keeping_content_types(self: TransactionTestCase) -> None:
    """Django's flush after a transactional test, without rebuilding what no test changes.

    Django's flush empties every table, content types and permissions included, then sends
    post_migrate to every app, which writes them back: about 100 statements, ~46 ms of the test's CPU
    and ~26 ms of the server's, after each of the suite's ~760 transactional tests, in every leg
    CI runs. This flush keeps those two tables and sends post_migrate to the lease app alone, whose
    receivers copy its settings into the database as after any flush. Tests that name
    ``available_apps`` or ``serialized_rollback`` get Django's own teardown.
    """
    if self.available_apps is not None or self.serialized_rollback:
        _django_fixture_teardown(self)
        return
    lease_app = apps.get_app_config("pg_lease_django")
    for alias in self._databases_names(include_mirrors=False):  # type: ignore[attr-defined]  # Django's, unstubbed
        connection = connections[alias]
        tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
        emptied = [table for table in tables if table not in KEPT_BY_FLUSH]
        connection.ops.execute_sql_flush(connection.ops.sql_flush(no_style(), emptied))
        post_migrate.send(
            sender=lease_app, app_config=lease_app, verbosity=0, interactive=False, using=alias, apps=apps, plan=None
        )


class NoSessionLeft:
    """Fails the run if a session is left on a test database at the end.

    Such a session (a thread's Django connection, a psycopg connection never closed, a child process)
    makes the test databases impossible to drop: pytest-django only warns then, and the database
    stays. The check runs just before the databases are dropped (a finalizer of ``django_db_setup``
    added after its own teardown: finalizers run last-in, first-out) and raises, naming the
    sessions: an error at the teardown of the last test, and a failed run. Behind PgBouncer the
    pooler keeps server sessions by design: not checked there.

    ``trylast``: the innermost wrapper, so its finalizer is added before the package's pytest plugin
    adds the one that closes the idle lease connections of ``hold()``, and runs after it, as the drop
    does. (As the outermost wrapper it ran first and found, when the session's last test had used
    ``hold()``, the pooled connection the plugin was about to close.)
    """

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, Any, Any]:
        result = yield
        if fixturedef.argname == "django_db_setup" and not os.environ.get("PG_LEASE_TEST_PGBOUNCER"):
            fixturedef.addfinalizer(_no_session_left)
        return result


def _no_session_left() -> None:
    from django.db import connections
    from django.db.backends.base.creation import TEST_DATABASE_PREFIX

    # The PostgreSQL aliases whose test database was created (the others keep their own NAME).
    databases = {
        settings["NAME"]: alias
        for alias in connections
        if connections[alias].vendor == "postgresql"
        and (
            (settings := connections[alias].settings_dict)["NAME"] == settings["TEST"]["NAME"]
            or settings["NAME"].startswith(TEST_DATABASE_PREFIX)
        )
    }
    left = {name: rows for name, alias in databases.items() if (rows := sessions_left(alias))}
    if left:
        described = "; ".join(
            f"{name}: "
            + ", ".join(
                f"pid {pid} {app!r} {state} since {since:%H:%M:%S} ({query!r})"
                for pid, app, state, since, query in rows
            )
            for name, rows in left.items()
        )
        pytest.fail(f"sessions left open on the test databases (they cannot be dropped): {described}", pytrace=False)


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


_databases = itertools.count()


@pytest.fixture(scope="session")
def migrated_template(django_db_setup: None) -> Iterator[str]:
    """A database ``manage.py migrate pg_lease_django`` built from empty, once per worker: its copies
    are what the migrations build, for the price of a file copy rather than a Django process and
    every migration's DDL (issue 56). Dropped at the session's end; nobody else connects to it, as
    ``CREATE DATABASE ... TEMPLATE`` requires."""
    name = f"pg_lease_tpl_{os.getpid()}"
    with psycopg.connect(conninfo(), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    try:
        manage(name, "migrate", "pg_lease_django", "--noinput")
        yield name
    finally:
        with psycopg.connect(conninfo(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def new_database(request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """Make databases on the test server (dropped afterwards); returns each one's name. Empty, or
    with ``migrated=True`` a copy of ``migrated_template``: the lease app migrated to its last
    migration, as a fresh ``manage.py migrate pg_lease_django`` leaves it."""
    made: list[str] = []
    admin = psycopg.connect(conninfo(), autocommit=True)

    def make(*, migrated: bool = False) -> str:
        template = request.getfixturevalue("migrated_template") if migrated else "template0"
        name = f"pg_lease_src_{os.getpid()}_{next(_databases)}"
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        made.append(name)
        return name

    yield make
    for name in made:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.fixture
def tenants(transactional_db: None) -> Iterator[Tenants]:
    admin = psycopg.connect(conninfo(), autocommit=True)
    made = Tenants(uuid.uuid4().hex[:8], admin)
    try:
        for tenant in ("a", "b", "c"):
            made.create("CREATE ROLE {} NOLOGIN", tenant)
            made.create("CREATE ROLE {} LOGIN IN ROLE {}", f"{tenant}_login", tenant)
            made.made += [f"{tenant}_login", tenant]
        made.create("CREATE ROLE {} LOGIN", "ops")
        made.create("CREATE ROLE {} LOGIN", "nobody")
        made.made += ["ops", "nobody"]
        for name in ("a", "b", "c", "ops"):
            made.create("GRANT SELECT, INSERT, UPDATE, DELETE ON testapp_invoice TO {}", name)
            made.create("GRANT USAGE ON SEQUENCE testapp_invoice_id_seq TO {}", name)
        with override_settings(**made.settings):
            call_command("leases", "grant", stdout=StringIO())
            yield made
    finally:
        for conn in made.opened:
            conn.close()
        with override_settings(PG_LEASE_KEY_SCOPES={}, PG_LEASE_ROLE_LIMITS={}, PG_LEASE_HISTORY=[]):
            privileges.sync_key_scopes()
            privileges.sync_role_limits()
            history.sync_scope()
        for name in made.made:  # every grant first (a grant one of them made to another goes with its grantor)
            admin.execute(pgsql.SQL("DROP OWNED BY {} CASCADE").format(pgsql.Identifier(made.role(name))))
        for name in made.made:
            admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(made.role(name))))
        admin.close()
