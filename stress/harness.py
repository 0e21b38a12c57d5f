"""Stress harness: worker processes run seeded random schedules of lease operations; a run records them all.

A :class:`Run` owns a database of its own (created on the server named by the URL, dropped at the
end), migrated, with an audit trigger on the lease table that logs every committed change in the
same transaction (the server record the checker compares the client history with). Workers are
separate processes (spawn: no inherited sockets), each with its own owner identity and seed. Every
operation is written to the worker's log *before* it is sent and again when it returns, so a
worker killed mid-operation leaves that operation recorded with an unknown outcome.

The fenced resource is the test app's models: per key one ``Invoice`` whose ``amount`` is a counter
incremented read -> pause -> fenced save, and one ``Entry`` row per accepted increment, inserted in
the same transaction with a commit-order ticket (the bump of a single ``CommitTicket`` row, whose
row lock hands out tickets in commit order).

The URL may name several hosts (``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``,
libpq's multi-host form): the workers' Django then gets a multi-host ``HOST``/``PORT`` with those
options, as a project on a replicated PostgreSQL does, and every connection of the run lands on
whichever server accepts writes (``python -m stress failover``, :mod:`stress.failover`). A worker
whose connection is gone reconnects before its next operation; while no server accepts it, it
starts no operation (the refused connection attempts are counted, not recorded as operations: no
request was sent).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

if TYPE_CHECKING:
    from pg_lease_django import Grant

from .checker import AuditRow, Op, Report, Violation, WriteRow, check
from .tenures import READ_TENURES, RECORD_EVERY_KEY, TenureRow, check_tenures

REPO = Path(__file__).resolve().parent.parent

# The audit trigger: every committed change of a lease row, in the same transaction as the change.
# Per key, changes are serialised by the row lock, so seq order is the order they committed in.
AUDIT_SQL = """
CREATE TABLE stress_lease_audit (
  seq bigserial PRIMARY KEY, key text NOT NULL, owner text, epoch bigint NOT NULL,
  acquired_at timestamptz, expires_at timestamptz, old_owner text, old_epoch bigint NOT NULL);
CREATE FUNCTION stress_lease_audit() RETURNS trigger LANGUAGE plpgsql
SET search_path = public, pg_catalog AS $$
BEGIN
  INSERT INTO stress_lease_audit (key, owner, epoch, acquired_at, expires_at, old_owner, old_epoch)
  VALUES (NEW.key, NEW.owner, NEW.epoch, NEW.acquired_at, NEW.expires_at,
          CASE WHEN TG_OP = 'UPDATE' THEN OLD.owner END,
          CASE WHEN TG_OP = 'UPDATE' THEN OLD.epoch ELSE 0 END);
  RETURN NULL;
END $$;
CREATE TRIGGER stress_lease_audit AFTER INSERT OR UPDATE ON pg_lease_django_lease
  FOR EACH ROW EXECUTE FUNCTION stress_lease_audit();
INSERT INTO testapp_committicket (id, value) VALUES (1, 0);
"""

TICKET_SQL = "UPDATE testapp_committicket SET value = value + 1 WHERE id = 1 RETURNING value"


@dataclass
class Config:
    """One run.

    Attributes:
        url: a PostgreSQL URL; the run creates (and drops) its own database on that server.
        seed: the run's seed; worker ``i`` of generation ``g`` uses a seed derived from it.
        workers: number of worker processes.
        keys: number of lease keys they contend for.
        seconds: how long workers keep starting operations.
        ttl_min, ttl_max: range of TTLs (seconds) for acquires and renewals.
        long_pause: probability that a pause lasts one to two TTLs (a holder that stalls).
        terminate_every: if set, ``pg_terminate_backend`` a random worker backend this often (seconds).
        writes_durable, grants_durable: see :func:`stress.checker.check`.
        keep_database: leave the run's database in place (to inspect it after a failure).
    """

    url: str
    seed: int = 1
    workers: int = 6
    keys: int = 3
    seconds: float = 10.0
    ttl_min: float = 0.05
    ttl_max: float = 0.5
    long_pause: float = 0.1
    terminate_every: float | None = None
    writes_durable: bool = True
    grants_durable: bool = True
    keep_database: bool = False


@dataclass
class Result:
    """A finished run: its config, the recorded history and server record, and the checker's report."""

    config: Config
    database: str
    ops: list[Op]
    audit: list[AuditRow]
    writes: list[WriteRow]
    counters: dict[str, int]
    report: Report
    terminated: int = 0
    logs: dict[str, str] = field(default_factory=dict)
    refused_connections: int = 0
    tenures: list[TenureRow] = field(default_factory=list)

    def describe(self) -> str:
        """Seed, database and the checker's report (with the offending history slices)."""
        return f"seed={self.config.seed} database={self.database} terminated_backends={self.terminated}\n" + (
            self.report.render()
        )


def with_dbname(url: str, dbname: str) -> str:
    """``url`` pointing at database ``dbname`` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(dbname)))


def django_database(url: str) -> dict[str, Any] | None:
    """The fields of a Django ``DATABASES`` entry for a multi-host URL (``HOST`` and ``PORT`` lists,
    the URL's other parameters as ``OPTIONS``); None for a single-host URL, which ``devkit.settings``
    parses itself."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    host = str(params.pop("host", "") or "")
    if "," not in host:
        return None
    return {
        "NAME": str(params.pop("dbname", "postgres")),
        "USER": str(params.pop("user", "postgres")),
        "PASSWORD": str(params.pop("password", "") or ""),
        "HOST": host,
        "PORT": str(params.pop("port", "")),
        "OPTIONS": {name: str(value) for name, value in params.items()},
    }


def _settings_url(url: str) -> str:
    """A URL ``devkit.settings`` can parse standing in for ``url`` (its first host) until the
    multi-host entry replaces it."""
    database = django_database(url)
    if database is None:
        return url
    host, port = database["HOST"].split(",")[0], database["PORT"].split(",")[0]
    return f"postgresql://{quote(database['USER'])}@{host}:{port}/{quote(database['NAME'])}"


def _seconds(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


# ---- the worker (runs in its own process) ---------------------------------------------------


class _Log:
    """Append-only JSON lines; each line is written with one ``write`` so a kill -9 loses at most the last."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())


def worker_main(spec: dict[str, Any], stopping: Any = None) -> None:
    """Entry point of a worker process: set up Django on ``spec["url"]``, then run the schedule
    (until its deadline or until ``stopping``, a multiprocessing Event, is set)."""
    os.environ["DATABASE_URL"] = _settings_url(spec["url"])
    os.environ["DJANGO_SETTINGS_MODULE"] = "devkit.settings"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from django.conf import settings

    database = django_database(spec["url"])
    if database is not None:
        settings.DATABASES["default"].update(database)
    settings.DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = f"stress-{spec['worker']}"
    import django

    django.setup()
    # A terminated backend makes the blocking acquire log a warning with a traceback; the outcome
    # is recorded anyway, so keep the run's output readable.
    logging.getLogger("pg_lease_django").setLevel(logging.ERROR)
    _Worker(spec, stopping).run()


class _Worker:
    """One worker's schedule: decisions come from its seeded RNG; outcomes from the database."""

    def __init__(self, spec: dict[str, Any], stopping: Any = None) -> None:
        from django.db import connection

        self.connection = connection
        self.stopping = stopping
        self.me: str = spec["worker"]
        self.keys: list[str] = spec["keys"]
        # Counted from here: starting a process and Django can take seconds on a busy machine.
        self.deadline: float = time.monotonic() + spec["seconds"]
        self.ttl_min: float = spec["ttl_min"]
        self.ttl_max: float = spec["ttl_max"]
        self.long_pause: float = spec["long_pause"]
        self.rng = random.Random(spec["seed"])
        self.log = _Log(spec["log"])
        self.n = 0
        self.held: dict[str, Grant] = {}  # key -> the grant we believe we hold
        self.stale: list[Grant] = []  # grants we lost or gave up

    def ttl(self) -> float:
        return round(self.rng.uniform(self.ttl_min, self.ttl_max), 3)

    def pause_for(self, ttl: float) -> float:
        if self.rng.random() < self.long_pause:
            return self.rng.uniform(ttl, 2 * ttl)  # a holder that stalls past its TTL
        return self.rng.uniform(0, ttl / 4)

    def connected(self) -> bool:
        """Whether Django's connection is open, opening it if not (through the host list: the server
        that accepts writes now). A refused attempt is counted in the log, not recorded as an
        operation (nothing was sent); the worker backs off a little before trying again."""
        from django.db import InterfaceError, OperationalError

        if self.connection.connection is not None:
            return True
        try:
            self.connection.ensure_connection()
            return True
        except (OperationalError, InterfaceError):
            with suppress(Exception):
                self.connection.close()
            self.log.write({"worker": self.me, "refused": time.monotonic()})
            time.sleep(self.rng.uniform(0.02, 0.06))
            return False

    def stopped(self) -> bool:
        return time.monotonic() >= self.deadline or (self.stopping is not None and self.stopping.is_set())

    def run(self) -> None:
        while not self.stopped():
            if not self.connected():
                continue
            key = self.rng.choice(self.keys)
            grant = self.held.get(key)
            r = self.rng.random()
            if grant is None:
                if r < 0.55:
                    self.acquire(key, blocking=False)
                elif r < 0.8:
                    self.acquire(key, blocking=True)
                elif r < 0.92 or not self.stale:
                    self.inspect(key)
                else:
                    self.stale_op(self.rng.choice(self.stale[-10:]))
            elif r < 0.3:
                self.renew(grant)
            elif r < 0.6:
                self.write(grant)
            elif r < 0.75:
                self.release(grant)
            elif r < 0.8:
                self.acquire(key, blocking=False)  # self-takeover: a new epoch fences the old one
            elif r < 0.9:
                self.inspect(key)
            else:
                time.sleep(self.pause_for(grant.expires_at.timestamp() - grant.server_time.timestamp()))
            time.sleep(min(self.rng.expovariate(50.0), 0.1))

    @contextmanager
    def record(self, key: str, op: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Log the invocation, run the body, log the completion; classify the exception if any."""
        from django.db import InterfaceError, OperationalError

        from pg_lease_django import LeaseLostError, LeaseTimeoutError, UnconfirmedCommitError

        self.n += 1
        entry: dict[str, Any] = {"worker": self.me, "key": key, "op": op, "n": self.n, **fields}
        entry["invoke"] = time.monotonic()
        self.log.write(entry)
        try:
            yield entry
        except LeaseTimeoutError:
            entry.update(outcome="fail", cause="timeout")
        except LeaseLostError as exc:
            entry.update(outcome="fail", cause=exc.code)
        except UnconfirmedCommitError as exc:  # committed on the primary, not confirmed by the standby
            entry.update(outcome="unknown", cause=f"unconfirmed: {str(exc).strip()[:200]}")
            with suppress(Exception):
                self.connection.close()
        except (OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError) as exc:
            entry.update(outcome="unknown", cause=f"connection: {type(exc).__name__}: {str(exc).strip()[:200]}")
            with suppress(Exception):
                self.connection.close()  # Django reconnects on next use
        except Exception as exc:
            if getattr(exc.__cause__, "sqlstate", getattr(exc, "sqlstate", None)) == "25006":
                # read_only_sql_transaction: a server that refuses writes (a standby, or a promoted one
                # whose failover hook keeps clients out) wrote nothing.
                entry.update(outcome="fail", cause="read-only server")
            else:
                entry.update(outcome="unknown", cause=f"unexpected: {type(exc).__name__}: {str(exc).strip()[:300]}")
            with suppress(Exception):
                self.connection.close()
        entry.setdefault("outcome", "ok")
        entry["complete"] = time.monotonic()
        self.log.write(entry)

    def acquire(self, key: str, *, blocking: bool) -> None:
        from pg_lease_django import Lease

        ttl = self.ttl()
        with self.record(key, "acquire", ttl=ttl, blocking=blocking) as entry:
            grant: Grant | None
            if blocking:
                grant = Lease.objects.acquire(
                    key, self.me, ttl, blocking=True, timeout=round(self.rng.uniform(0.05, 1.0), 3)
                )
            else:
                grant = Lease.objects.acquire(key, self.me, ttl)
            if grant is None:
                entry.update(outcome="fail", cause="not_acquirable")
                return
            old = self.held.get(key)
            if old is not None:
                self.stale.append(old)
            self.held[key] = grant
            entry.update(
                epoch=grant.epoch, server_time=_seconds(grant.server_time), expires_at=_seconds(grant.expires_at)
            )
        if entry["outcome"] == "unknown":
            self.held.pop(key, None)  # we may hold it without knowing the epoch: act as if we do not

    def _lost(self, grant: Grant, entry: dict[str, Any]) -> None:
        if entry["outcome"] == "fail" and self.held.get(grant.key) is grant:
            del self.held[grant.key]
            self.stale.append(grant)

    def renew(self, grant: Grant) -> None:
        from pg_lease_django import Lease

        ttl = self.ttl()
        with self.record(grant.key, "renew", ttl=ttl, epoch=grant.epoch) as entry:
            expires_at = Lease.objects.renew(grant.key, self.me, grant.epoch, ttl)
            entry["expires_at"] = expires_at.timestamp()
        self._lost(grant, entry)

    def release(self, grant: Grant) -> None:
        from pg_lease_django import Lease

        with self.record(grant.key, "release", epoch=grant.epoch) as entry:
            Lease.objects.release(grant.key, self.me, grant.epoch)
            if self.held.get(grant.key) is grant:
                del self.held[grant.key]
                self.stale.append(grant)
        self._lost(grant, entry)

    def inspect(self, key: str) -> None:
        from pg_lease_django import Lease

        with self.record(key, "inspect") as entry:
            state = Lease.objects.inspect(key)
            entry.update(
                epoch=state.epoch,
                status=state.status,
                owner=state.owner,
                expires_at=_seconds(state.expires_at),
                server_time=_seconds(state.server_time),
            )

    def write(self, grant: Grant) -> None:
        """Read the counter, pause (maybe past the TTL), write it back + 1 under the fence, log the row."""
        from django.db import transaction

        from devkit.testapp.models import Entry, Invoice

        tag = f"{self.me}-{self.n + 1}"
        ttl = grant.expires_at.timestamp() - grant.server_time.timestamp()
        pause = self.pause_for(ttl)
        with self.record(grant.key, "write", epoch=grant.epoch, tag=tag, pause=round(pause, 4)) as entry:
            with transaction.atomic():
                invoice = Invoice.objects.get(account=grant.key)
                value = invoice.amount
                time.sleep(pause)
                with self.connection.cursor() as cursor:
                    cursor.execute(TICKET_SQL)
                    (ticket,) = cursor.fetchone()
                invoice.amount = value + 1
                invoice.save(fence=grant, update_fields=["amount"])
                Entry(account=grant.key, writer=tag, ticket=ticket).save(fence=grant)
            entry["read"] = value
        self._lost(grant, entry)

    def stale_op(self, grant: Grant) -> None:
        """Act on a grant we lost or released: every one of these must be refused."""
        choice = self.rng.random()
        if choice < 0.4:
            self.renew(grant)
        elif choice < 0.7:
            self.write(grant)
        else:
            self.release(grant)


# ---- the driver (runs in the caller's process) ------------------------------------------------


def _run_django(url: str, code: str, *, options: dict[str, str] | None = None) -> str:
    """Run ``code`` in a Django process on ``url`` (devkit.settings; a multi-host URL, and
    ``options`` added to OPTIONS, applied before setup); its standard output."""
    import subprocess

    database = django_database(url) or {}
    if options:
        database["OPTIONS"] = {**database.get("OPTIONS", {}), **options}
    env = {
        **os.environ,
        "DATABASE_URL": _settings_url(url),
        "DJANGO_SETTINGS_MODULE": "devkit.settings",
        "PG_LEASE_STRESS_DATABASE": json.dumps(database),
    }
    prelude = (
        "import json, os\n"
        "from django.conf import settings\n"
        "database = json.loads(os.environ['PG_LEASE_STRESS_DATABASE'])\n"
        "options = {**settings.DATABASES['default'].get('OPTIONS', {}), **database.pop('OPTIONS', {})}\n"
        "settings.DATABASES['default'].update(database, OPTIONS=options)\n"
        "import django; django.setup()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"a Django process on the stress database failed:\n{done.stderr}")
    return done.stdout


def migrate(url: str) -> None:
    """Apply the lease app's and the test app's migrations to the database at ``url`` (in a subprocess)."""
    # Every migration of the lease app, not only those the test app depends on (0006 is nobody's dependency).
    _run_django(
        url,
        "from django.core.management import call_command\n"
        "call_command('migrate', 'pg_lease_django', verbosity=0)\n"
        "call_command('migrate', 'testapp', verbosity=0)",
    )


class Run:
    """One stress run: its database, worker processes, optional chaos, and the collected history.

    Use :func:`run` for the whole cycle; fault tests use the pieces (``start``, ``kill``, ``stop``,
    ``cont``, ``respawn``, ``finish``) to inject faults while workers run.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.database = f"pg_lease_stress_{uuid.uuid4().hex[:10]}"
        self.admin_url = config.url
        self.url = with_dbname(config.url, self.database)
        self.keys = [f"stress-{i}" for i in range(config.keys)]
        self.logdir = Path(tempfile.mkdtemp(prefix="pg_lease_stress_"))
        self.context = multiprocessing.get_context("spawn")
        self.processes: dict[str, BaseProcess] = {}
        self.generation: dict[int, int] = {}
        self.deadline = 0.0
        self.terminated = 0
        self.stopping = self.context.Event()  # set: workers finish their operation and exit
        self.extra_ops: list[Op] = []  # operations of others than the workers (an operator's)
        self._chaos_stop = threading.Event()
        self._chaos: threading.Thread | None = None

    # setup and teardown

    def create_database(self) -> None:
        """Create, migrate and instrument the run's database; one counter row per key."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
        migrate(self.url)
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(AUDIT_SQL)
            conn.execute(RECORD_EVERY_KEY)  # the lease history, checked against the workers' record
            with conn.transaction():  # setting up the resource is no lease holder's write: opt out
                conn.execute("SELECT pg_lease_allow_unfenced()")
                for key in self.keys:
                    conn.execute(
                        "INSERT INTO testapp_invoice (account, status, amount, lease_key) VALUES (%s, 'draft', 0, %s)",
                        [key, key],
                    )

    def drop_database(self) -> None:
        """Drop the run's database (unless ``keep_database``) and the worker logs."""
        shutil.rmtree(self.logdir, ignore_errors=True)
        if self.config.keep_database:
            return
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.database)))

    # workers

    def start(self) -> None:
        """Start every worker (and the chaos thread, if configured) for ``config.seconds``."""
        self.deadline = time.monotonic() + self.config.seconds
        for index in range(self.config.workers):
            self.spawn(index)
        if self.config.terminate_every:
            self._chaos = threading.Thread(target=self._terminate_backends, daemon=True)
            self._chaos.start()

    def spawn(self, index: int) -> str:
        """Start worker ``index`` (a new generation, with a new identity, if it ran before); return its name."""
        generation = self.generation.get(index, -1) + 1
        self.generation[index] = generation
        name = f"w{index}" if generation == 0 else f"w{index}g{generation}"
        spec = {
            "url": self.url,
            "worker": name,
            "keys": self.keys,
            "seconds": max(0.0, self.deadline - time.monotonic()),
            "ttl_min": self.config.ttl_min,
            "ttl_max": self.config.ttl_max,
            "long_pause": self.config.long_pause,
            "seed": self.config.seed * 1_000_003 + index * 1009 + generation,
            "log": str(self.logdir / f"{name}.jsonl"),
        }
        process = self.context.Process(target=worker_main, args=(spec, self.stopping), name=name, daemon=True)
        process.start()
        self.processes[name] = process
        return name

    def stop(self) -> None:
        """Tell every worker to finish its current operation and exit (before its deadline)."""
        self.stopping.set()

    def alive(self) -> list[str]:
        """Names of workers still running."""
        return [name for name, p in self.processes.items() if p.is_alive()]

    def signal(self, name: str, signum: int) -> None:
        """Send ``signum`` to worker ``name``."""
        pid = self.processes[name].pid
        assert pid is not None
        os.kill(pid, signum)

    def kill(self, name: str) -> None:
        """kill -9 worker ``name`` and reap it."""
        self.signal(name, signal.SIGKILL)
        self.processes[name].join(10)

    def _terminate_backends(self) -> None:
        rng = random.Random(self.config.seed)
        every = self.config.terminate_every or 1.0
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._chaos_stop.wait(rng.uniform(0.5 * every, 1.5 * every)):
                with suppress(psycopg.Error):
                    pids = [
                        pid
                        for (pid,) in conn.execute(
                            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                            " AND application_name LIKE 'stress-%%'"
                        )
                    ]
                    if pids:
                        conn.execute("SELECT pg_terminate_backend(%s)", [rng.choice(pids)])
                        self.terminated += 1

    def join(self, timeout: float = 60.0) -> None:
        """Wait for every worker to finish its schedule (kill stragglers after ``timeout``)."""
        end = time.monotonic() + max(0.0, self.deadline - time.monotonic()) + timeout  # + start-up time
        for process in self.processes.values():
            process.join(max(0.1, end - time.monotonic()))
            if process.is_alive():
                with suppress(ProcessLookupError):
                    os.kill(process.pid or 0, signal.SIGCONT)
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        self._chaos_stop.set()
        if self._chaos is not None:
            self._chaos.join(10)

    # history

    def history(self) -> list[Op]:
        """Every worker's operations; an invocation without a completion is unknown (cause ``killed``)."""
        known = {f.name for f in Op.__dataclass_fields__.values()}
        ops: dict[tuple[str, int], Op] = {}
        for path in sorted(self.logdir.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a worker killed mid-write
                    continue
                if "refused" in record:  # a refused connection attempt, no operation
                    continue
                fields = {k: v for k, v in record.items() if k in known}
                ident = (record["worker"], record["n"])
                if "complete" in record:  # the completion repeats every field of the invocation
                    ops[ident] = Op(**fields)
                else:
                    ops[ident] = Op(**{**fields, "outcome": "unknown", "cause": "killed"})
        return sorted([*ops.values(), *self.extra_ops], key=lambda op: op.invoke)

    def refused_connections(self) -> int:
        """How many connection attempts of the workers no server accepted."""
        refused = 0
        for path in self.logdir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                with suppress(json.JSONDecodeError):
                    refused += "refused" in json.loads(line)
        return refused

    def server_record(self) -> tuple[list[AuditRow], list[WriteRow], dict[str, int]]:
        """The audit log, the accepted fenced writes and the final counters."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            audit = [
                AuditRow(seq, key, owner, epoch, _seconds(acquired), _seconds(expires), old_owner, old_epoch)
                for seq, key, owner, epoch, acquired, expires, old_owner, old_epoch in conn.execute(
                    "SELECT seq, key, owner, epoch, acquired_at, expires_at, old_owner, old_epoch"
                    " FROM stress_lease_audit ORDER BY seq"
                )
            ]
            writes = [
                WriteRow(tag, key, epoch, ticket)
                for tag, key, epoch, ticket in conn.execute(
                    "SELECT writer, account, lease_epoch, ticket FROM testapp_entry ORDER BY ticket"
                )
            ]
            counters: dict[str, int] = dict(conn.execute("SELECT account, amount FROM testapp_invoice").fetchall())
        return audit, writes, counters

    def finish(self) -> Result:
        """Join the workers, collect the history and the server record, and check them."""
        self.join()
        ops = self.history()
        audit, writes, counters = self.server_record()
        report = check(
            ops,
            audit,
            writes,
            counters,
            writes_durable=self.config.writes_durable,
            grants_durable=self.config.grants_durable,
        )
        with psycopg.connect(self.url, autocommit=True) as conn:
            tenures = [TenureRow(*row) for row in conn.execute(READ_TENURES)]
        if self.config.grants_durable:  # after a lossy failover the history lost grants too
            for found in check_tenures(ops, tenures):
                kind, key = found.pop("kind"), found.pop("key")
                report.violations.append(Violation(f"history_{kind}", key, json.dumps(found, default=str)))
        for op in ops:
            if op.cause and op.cause.startswith("unexpected"):
                report.violations.append(
                    Violation("unexpected_error", op.key, f"{op.worker} {op.op}: {op.cause}", [op])
                )
        return Result(
            self.config,
            self.database,
            ops,
            audit,
            writes,
            counters,
            report,
            self.terminated,
            refused_connections=self.refused_connections(),
            tenures=tenures,
        )


def run(config: Config, during: Callable[[Run], None] | None = None) -> Result:
    """Create the database, run the workers (calling ``during(run)`` while they run), check, drop."""
    stress_run = Run(config)
    stress_run.create_database()
    try:
        stress_run.start()
        if during is not None:
            during(stress_run)
        return stress_run.finish()
    finally:
        stress_run.join(timeout=5)
        stress_run.drop_database()


def short_configs(url: str) -> list[Config]:
    """The CI mode: fixed seeds, about a minute in all."""
    return [
        Config(url, seed=1, workers=6, keys=3, seconds=15),
        Config(url, seed=2, workers=4, keys=1, seconds=10, ttl_min=0.05, ttl_max=0.15, long_pause=0.2),
        Config(url, seed=3, workers=6, keys=2, seconds=12, terminate_every=0.5),
    ]


def elapsed(start: float) -> timedelta:
    """Wall time since ``start`` (monotonic), for reports."""
    return timedelta(seconds=round(time.monotonic() - start))
