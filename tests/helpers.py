"""Helpers the tests share: raw connections, waiting, background calls, leases in a given state.

Fixtures live in ``conftest.py``; this is a plain module that tests import (pytest advises against
importing from ``conftest``).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import psycopg
import pytest
from django.core.checks import CheckMessage
from django.db import connections, transaction
from psycopg import sql as pgsql

from devkit import dbserver
from pg_lease_django import Lease
from tests.catalog import snapshot

REPO = Path(__file__).resolve().parent.parent

#: A role a test makes: ``pgl_<the test's tag>_<name>`` (test_tenants, test_security, test_deployment_whole).
TEST_ROLE = re.compile(r"\bpgl_([0-9a-f]{8,10})_")

#: A parameter grant to PUBLIC is the server's, and names no role: a test that makes one
#: (test_tenants, in the cluster-roles group) reads it by name; every other test leaves it out.
PUBLIC_PARAMETER = "role 'PUBLIC' may SET"

#: A check's id as ``manage.py check`` prints it: ``(pg_lease_django.W008)``.
CHECK_ID = re.compile(r"\(\w+\.[CEWID]\d{3}\)")

Finding = TypeVar("Finding")


def own_findings(found: Iterable[Finding], tag: str, text: Callable[[Finding], str] = str) -> list[Finding]:
    """What a cluster-wide check said, less what it said only of other tests' roles.

    Roles, memberships and parameter grants belong to the server, not to a test database: check
    W008 and E006 see every role on it, those of tests running beside this one (another xdist
    worker, another lane, a run that was killed before its clean-up) included. A test asserts only
    on findings that name its own roles or no test's role at all (the owner, PUBLIC's grants in this
    database; a parameter granted to PUBLIC is the server's, so left out); a test with no roles of
    its own passes ``tag=""`` and keeps only the latter.
    """
    return [
        f for f in found if all(seen == tag for seen in TEST_ROLE.findall(text(f))) and PUBLIC_PARAMETER not in text(f)
    ]


def checks_said(output: str, tag: str = "") -> list[str]:
    """The lines of ``manage.py check``'s output that report a check, less those only about other
    tests' roles (``own_findings``; a test with no roles of its own passes no tag)."""
    return own_findings([line for line in output.splitlines() if CHECK_ID.search(line)], tag)


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


#: Whether Django's connections go through a transaction-pooling PgBouncer (.ci/with-pgbouncer).
POOLED = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))

#: Tests that need the session of Django's own connection (its backend pid, LISTEN) cannot run
#: through a transaction-pooling PgBouncer, which hands each transaction another server session.
needs_session = pytest.mark.skipif(POOLED, reason="needs a server session; PgBouncer pools transactions")


def row_snapshot(conn: psycopg.Connection[Any], key: str) -> tuple[Any, ...] | None:
    """The row's content and its tuple identity: unchanged means no write and no row lock."""
    return conn.execute(
        "SELECT l::text, xmin::text, xmax::text, ctid::text FROM pg_lease_django_lease l WHERE key = %s", [key]
    ).fetchone()


def sessions_left(alias: str = "default", within: float = 10.0) -> list[tuple[Any, ...]]:
    """Client sessions on ``alias``'s database other than this thread's Django connections.

    ``(pid, application_name, state, backend_start, query)`` of each. Sessions that are closing
    (a client that hung up: its server process exits a moment later) get ``within`` seconds to go.
    """
    own = {
        c.connection.info.backend_pid
        for c in connections.all(initialized_only=True)
        if c.vendor == "postgresql" and c.connection is not None and not c.connection.closed
    }
    deadline = time.monotonic() + within
    with psycopg.connect(conninfo(alias), autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT pid, application_name, state, backend_start, left(query, 200) FROM pg_stat_activity"
                " WHERE datname = current_database() AND backend_type = 'client backend'"
                " AND pid <> pg_backend_pid() AND NOT pid = ANY(%s) ORDER BY backend_start",
                [sorted(own)],
            ).fetchall()
            if not rows or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


def blocked_by(observer: psycopg.Connection[Any], blocker: psycopg.Connection[Any]) -> int:
    """How many backends wait for a lock ``blocker`` holds."""
    row = observer.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))", [blocker.info.backend_pid]
    ).fetchone()
    assert row is not None
    return int(row[0])


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
    """Run ``fn`` in a thread, keeping its result or exception for the test to inspect.

    The thread closes the Django connections it opened when ``fn`` returns: Django keeps them per
    thread and never closes them when a thread ends, so a session would stay open until the
    garbage collector found it, and the test database could not be dropped.
    """

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
        finally:
            connections.close_all()

    def outcome(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def url_of_test_database(alias: str = "default") -> str:
    """DATABASE_URL for a child process: this run's test database (``test_<name>``), not the configured one."""
    s = connections[alias].settings_dict
    auth = quote(s["USER"] or "postgres", safe="") + (":" + quote(s["PASSWORD"], safe="") if s["PASSWORD"] else "")
    host, port, name = s["HOST"] or "127.0.0.1", s["PORT"] or "5432", quote(s["NAME"], safe="")
    if host.startswith("/"):  # a unix socket directory
        return f"postgresql://{auth}@:{port}/{name}?host={quote(host, safe='')}"
    return f"postgresql://{auth}@{host}:{port}/{name}"


# ---- processes -----------------------------------------------------------------------------------


def session_members(sid: int) -> list[int]:
    """Every process of session ``sid``: here, what the unit's control group holds under systemd."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            except OSError:
                continue  # gone meanwhile
            if int(fields[3]) == sid and fields[0] != "Z":
                members.append(int(entry))
    return members


class ProcessEnd(threading.Thread):
    """When process ``pid`` (not necessarily a child of this one) ends, on this machine's monotonic clock.

    Its pidfd becomes readable when the process exits, reaped or not (Linux 5.3+).
    """

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pidfd = os.pidfd_open(pid)
        self.at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            select.select([self.pidfd], [], [])
            self.at = time.monotonic()
        finally:
            os.close(self.pidfd)


# ---- leases in a given state ---------------------------------------------------------------------


def held(key: str, owner: str = "w1", ttl: float = 30) -> int:
    """Acquire ``key`` for ``owner``; its epoch."""
    grant = Lease.objects.acquire(key, owner, ttl=ttl)
    assert grant is not None
    return grant.epoch


def lapsed(key: str, owner: str = "w-old") -> int:
    """``key`` held by ``owner`` and lapsed (not taken over); its epoch."""
    epoch = held(key, owner, ttl=0.001)
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")
    return epoch


def free(key: str) -> int:
    """``key`` acquired and released; its epoch now."""
    epoch = held(key, "w-gone")
    Lease.objects.release(key, "w-gone", epoch)
    return epoch + 1


# ---- writes and threads ----------------------------------------------------------------------


@contextmanager
def refused(error: type[BaseException], match: str | None = None, using: str = "default") -> Iterator[Any]:
    """Expect the database to refuse a write with ``error``, inside a savepoint so the test's own
    transaction carries on (a refused statement leaves its transaction to roll back, as in Django)."""
    with pytest.raises(error, match=match) as info, transaction.atomic(using=using):
        yield info


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap ``fn`` to run in another thread on that thread's own Django connections, closed after."""

    def run() -> Any:
        try:
            return fn()
        finally:
            connections.close_all()

    return run


# Throwaway databases on the test server (the ``new_database`` fixture makes them), built in real
# processes: ``python -m django`` and psql.


def database_url(dbname: str) -> str:
    """The URL of database ``dbname`` on the test server (straight to it behind a pooler)."""
    params: dict[str, str] = dict(psycopg.conninfo.conninfo_to_dict(conninfo()))  # type: ignore[arg-type]
    user = quote(params.get("user") or "postgres")
    password = f":{quote(params['password'])}" if params.get("password") else ""
    host = params.get("host") or "127.0.0.1"
    if host.startswith("/"):
        return f"postgresql://{user}{password}@/{dbname}?host={quote(host)}&port={params.get('port') or 5432}"
    return f"postgresql://{user}{password}@{host}:{params.get('port') or 5432}/{dbname}"


def manage(dbname: str, *args: str, cwd: Path = REPO) -> str:
    """``python -m django ARGS`` against ``dbname``, in a process of its own; its output.

    ``cwd`` comes first on the process's path: a directory holding a copy of ``pg_lease_django``
    runs that copy (the repository stays on the path for the tests' settings and ``devkit``).
    """
    env = {**os.environ, "DATABASE_URL": database_url(dbname), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("DIRECT_DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "django", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@contextmanager
def migrator(dbname: str, cwd: Path = REPO) -> Iterator[Callable[..., None]]:
    """A function that runs ``manage.py migrate pg_lease_django TARGET`` on ``dbname`` for each of its
    targets in turn ("" for the latest), in one process of its own kept between calls: Django's
    start-up costs 0.6-0.9 s of CPU and a migration almost none, so a test that migrates step by step and
    looks at the database in between pays it once (issue 56)."""
    script = (
        "import json, sys\nfrom django.core.management import call_command\n"
        "for line in sys.stdin:\n"
        "    for target in json.loads(line):\n"
        "        call_command('migrate', 'pg_lease_django', *filter(None, [target]), interactive=False, verbosity=0)\n"
        "    print('done', flush=True)\n"
    )
    env = {**os.environ, "DATABASE_URL": database_url(dbname), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("DIRECT_DATABASE_URL", None)
    command = [sys.executable, "-m", "django", "shell", "--no-imports", "-c", script]
    with (
        tempfile.TemporaryFile("w+") as errors,
        subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
        ) as process,
    ):
        assert process.stdin and process.stdout

        def migrate(*targets: str) -> None:
            assert process.stdin and process.stdout
            process.stdin.write(json.dumps(targets) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], 300)
            if not (ready and process.stdout.readline() == "done\n"):
                process.kill()
                errors.seek(0)
                pytest.fail(f"migrate {targets} on {dbname} failed or did not end: {errors.read()}")

        try:
            yield migrate
        finally:
            process.stdin.close()
            process.wait(60)


def psql(dbname: str, script: str) -> None:
    """Run ``script`` with psql on ``dbname``, in one transaction, stopping at the first error."""
    binary = shutil.which("psql")
    assert binary, "psql (the PostgreSQL client) is needed: apt-get install postgresql-client"
    done = subprocess.run(
        [binary, "-X", "-q", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-d", database_url(dbname)],
        input=script,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def catalog(dbname: str) -> dict[str, Any]:
    """What the lease app installed in ``dbname``'s public schema (``tests/catalog.py``)."""
    with psycopg.connect(database_url(dbname)) as conn:
        return snapshot(conn)


def sql(dbname: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    """The rows of ``query`` run on ``dbname``."""
    with psycopg.connect(database_url(dbname), autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


@contextmanager
def fails_with(sqlstate: str) -> Iterator[None]:
    with pytest.raises(psycopg.Error) as info:
        yield
    assert info.value.sqlstate == sqlstate, repr(info.value)


@dataclass
class Tenants:
    """Two tenants (A, B) and a third (C), each a NOLOGIN group role with a login member; an operator
    for every key; a role granted nothing. Prefixes are this test's own."""

    tag: str
    admin: psycopg.Connection[Any]
    opened: list[psycopg.Connection[Any]] = field(default_factory=list)
    made: list[str] = field(default_factory=list)

    def role(self, name: str) -> str:
        return f"pgl_{self.tag}_{name}"

    def prefix(self, tenant: str) -> str:
        return f"{self.tag}/{tenant}/"

    def connect(self, name: str) -> psycopg.Connection[Any]:
        conn = psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), user=self.role(name)), autocommit=True)
        self.opened.append(conn)
        return conn

    def findings(self) -> list[CheckMessage]:
        """Checks W008 and E006 as the owner runs them, less what they say of other tests' roles."""
        from pg_lease_django.checks import check_declared_roles_are_granted

        found = check_declared_roles_are_granted(databases=["default"])
        return own_findings(found, self.tag, lambda m: f"{m.msg} {m.hint}")

    def create(self, statement: str, *names: str) -> None:
        self.admin.execute(pgsql.SQL(statement).format(*(pgsql.Identifier(self.role(n)) for n in names)))

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "PG_LEASE_WORKER_ROLES": [self.role("a"), self.role("b"), self.role("c")],
            "PG_LEASE_OPERATOR_ROLES": [self.role("ops")],
            "PG_LEASE_KEY_SCOPES": {
                self.role("a"): [self.prefix("a")],
                self.role("b"): [self.prefix("b")],
                self.role("c"): [self.prefix("c")],
                self.role("ops"): "*",
            },
        }
