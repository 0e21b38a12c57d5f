"""A Patroni cluster on this machine: etcd, two or three PostgreSQL nodes under Patroni, HAProxy.

What users run in front of a replicated PostgreSQL, started from Debian's packages (``apt-get
install patroni etcd-server haproxy``; ``make patroni-packages`` does it) with the machine's
PostgreSQL binaries, every process in a throwaway directory of its own, on free loopback ports:

- **etcd** (one member, the DCS), its data under the directory;
- **Patroni** per node (``patroni NODE.yml``, run as the server's user: initdb refuses root), which
  bootstraps the first node, clones the others (``pg_basebackup``), holds the leader key, promotes,
  demotes and rewinds (``use_pg_rewind``);
- **HAProxy** with one frontend routing to whichever node answers ``200`` on Patroni's REST
  ``GET /primary`` (health check every second).

:func:`patroni_config` and :func:`haproxy_config` render the configurations; docs/high-availability.md
quotes them verbatim (``tests/cluster/test_patroni.py`` checks that it does). With ``callback=True`` each
node runs the package's hook (:mod:`pg_lease_django.patroni`) as ``pre_promote`` and
``on_role_change``/``on_start``.

:meth:`PatroniCluster.destroy` stops HAProxy, every Patroni (SIGTERM: it stops its PostgreSQL)
and etcd, then SIGKILLs whatever is left of them: each was started in a process group of its own
(``start_new_session``), and each postmaster is the leader of its own group (its backends too);
:func:`leftovers` lists any patroni, etcd, haproxy or postgres process still carrying the
directory in its command line or belonging to one of those groups (the tests check it is empty).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from devkit.dbserver import free_port, service_user, throwaway_datadir
from devkit.pgcluster import find_bindir, poll

PROGRAMS = ("patroni", "patronictl", "etcd", "haproxy")
REPO = Path(__file__).resolve().parent.parent


def missing_programs() -> list[str]:
    """The programs of :data:`PROGRAMS` not on PATH (the tests skip when any is missing)."""
    return [name for name in PROGRAMS if shutil.which(name) is None]


@dataclass
class Ports:
    postgres: int
    rest: int


def hook_python() -> str:
    """How Patroni (run as the server's user) starts a Python that imports this package.

    This interpreter when that user can run it; else (a pyenv under root's private home) Debian's
    ``/usr/bin/python3`` with Django and psycopg installed once, by this interpreter's pip, into
    ``.pgdata/hook-site`` (same versions; wheels for the same Python minor version), and the
    repository on ``PYTHONPATH``.
    """
    user = service_user()
    probe = ["runuser", "-u", user or "", "--", sys.executable, "-c", "import psycopg, django"]
    if user is None or subprocess.run(probe, capture_output=True).returncode == 0:
        return sys.executable
    site = REPO / ".pgdata" / "hook-site"
    if not site.exists():
        partial = site.with_name(f"hook-site.{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        wanted = [f"Django=={metadata.version('django')}", f"psycopg[binary]=={metadata.version('psycopg')}"]
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"]
        subprocess.run([*pip, str(partial), *wanted], check=True, capture_output=True)
        try:
            partial.rename(site)
        except OSError:  # another process was first
            shutil.rmtree(partial, ignore_errors=True)
    return f"env PYTHONPATH={site}:{REPO} /usr/bin/python3"


def callback_command(conninfo: str, bindir: Path, *, python: str | None = None, by: int = 1_000_000) -> str:
    """The hook's command line, as Patroni's configuration carries it (Patroni appends its arguments)."""
    python = python or hook_python()
    return f"{python} -m pg_lease_django.patroni --conninfo '{conninfo}' --bindir {bindir} --by {by}"


def patroni_config(
    *,
    scope: str,
    name: str,
    root: Path,
    ports: Ports,
    etcd_port: int,
    bindir: Path,
    synchronous: str = "off",
    callback: bool = True,
    maximum_lag_on_failover: int = 1048576,
    python: str | None = None,
) -> str:
    """One node's ``patroni.yml``.

    Args:
        synchronous: ``"off"`` (asynchronous replication), ``"on"`` (``synchronous_mode``) or
            ``"strict"`` (``synchronous_mode`` and ``synchronous_mode_strict``).
        callback: run :mod:`pg_lease_django.patroni` as ``pre_promote``, ``on_role_change`` and ``on_start``.
        maximum_lag_on_failover: bytes a replica may lag behind the leader's last reported position
            and still be promoted (Patroni's default: 1 MiB).
        python: the hook's interpreter (default: :func:`hook_python`).
    """
    local = f"host=127.0.0.1 port={ports.postgres} user=postgres dbname=postgres"
    hooks = ""
    if callback:
        command = callback_command(local, bindir, python=python)
        hooks = f"""
  pre_promote: {command} pre_promote
  callbacks:
    on_role_change: {command}
    on_start: {command}"""
    return f"""\
scope: {scope}
namespace: /pg_lease/
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{ports.rest}
  connect_address: 127.0.0.1:{ports.rest}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: {maximum_lag_on_failover}
    primary_start_timeout: 0
    synchronous_mode: {"true" if synchronous in ("on", "strict") else "false"}
    synchronous_mode_strict: {"true" if synchronous == "strict" else "false"}
    synchronous_node_count: 1
    postgresql:
      use_pg_rewind: true
      remove_data_directory_on_rewind_failure: true
      remove_data_directory_on_diverged_timelines: true
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        synchronous_commit: "on"
        max_wal_senders: 8
        max_replication_slots: 8
        wal_keep_size: 256MB
        wal_sender_timeout: 5s
        wal_receiver_status_interval: 1s
  initdb:
    - encoding: UTF8
    - locale: C
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{ports.postgres}
  connect_address: 127.0.0.1:{ports.postgres}
  data_dir: {root / name / "data"}
  bin_dir: {bindir}
  pgpass: {root / name / "pgpass"}
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: {root / name}{hooks}
"""


def haproxy_config(*, port: int, nodes: list[tuple[str, Ports]]) -> str:
    """HAProxy: one TCP frontend on ``port``, routed to the node whose Patroni answers ``GET /primary`` with 200."""
    servers = "\n".join(
        f"    server {name} 127.0.0.1:{ports.postgres} maxconn 100 check port {ports.rest}" for name, ports in nodes
    )
    return f"""\
global
    maxconn 200

defaults
    mode tcp
    timeout connect 4s
    timeout client 30m
    timeout server 30m
    timeout check 2s

listen primary
    bind 127.0.0.1:{port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 1s fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""


@dataclass
class Member:
    """One Patroni node: its name, ports, configuration file and Patroni process."""

    name: str
    ports: Ports
    config: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def datadir(self) -> Path:
        return self.config.parent / self.name / "data"

    def kill_postgres(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to this node's postmaster and every child of it at once (SIGKILL: a crashed
        server, no backend left to commit); the postmaster's PID."""
        pid = self.postmaster_pid()
        if pid is None:
            raise RuntimeError(f"{self.name}: no postmaster.pid")
        targets = [pid, *children_of(pid)]
        for target in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, sig)
        if sig == signal.SIGKILL:
            poll(lambda: not ({pid, *targets} & {p for p, *_ in _processes()}), timeout=30, what="postgres to die")
        return pid

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class PatroniCluster:
    """etcd, ``nodes`` Patroni nodes, HAProxy; :meth:`start`, then :meth:`destroy` (always)."""

    nodes: int = 2
    synchronous: str = "off"
    callback: bool = True
    bindir: Path | None = None
    scope: str = "leases"
    maximum_lag_on_failover: int = 1048576
    root: Path = field(init=False)
    members: list[Member] = field(init=False, default_factory=list)
    etcd_port: int = field(init=False)
    haproxy_port: int = field(init=False)
    etcd: subprocess.Popen[bytes] | None = field(init=False, default=None)
    haproxy: subprocess.Popen[bytes] | None = field(init=False, default=None)
    groups: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.bindir = self.bindir or find_bindir()
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL server binaries (see devkit/pgcluster.py)")
        self.root = throwaway_datadir(f"patroni-{self.synchronous}")
        self.root.mkdir(parents=True)
        self.user = service_user()
        if self.user:
            shutil.chown(self.root, self.user)
        self.etcd_port = free_port()
        self.haproxy_port = free_port()
        for index in range(self.nodes):
            name = f"node{index + 1}"
            ports = Ports(postgres=free_port(), rest=free_port())
            config = self.root / f"{name}.yml"
            (self.root / name).mkdir()
            if self.user:
                shutil.chown(self.root / name, self.user)
            config.write_text(
                patroni_config(
                    scope=self.scope,
                    name=name,
                    root=self.root,
                    ports=ports,
                    etcd_port=self.etcd_port,
                    bindir=self.bindir,
                    synchronous=self.synchronous,
                    callback=self.callback,
                    maximum_lag_on_failover=self.maximum_lag_on_failover,
                )
            )
            self.members.append(Member(name, ports, config))

    # ---- life cycle ------------------------------------------------------------------------------

    def _spawn(self, command: list[str], log: str, *, as_service_user: bool = True) -> subprocess.Popen[bytes]:
        with open(self.root / log, "ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                start_new_session=True,
                user=self.user if as_service_user else None,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        self.groups.add(process.pid)
        return process

    def start_patroni(self, member: Member) -> None:
        """Start ``member``'s Patroni (again, after it was killed)."""
        member.process = self._spawn(["patroni", str(member.config)], f"{member.name}.log")

    def start(self, *, timeout: float = 120) -> None:
        """Start etcd, every Patroni node (the first bootstraps, the others clone it) and HAProxy;
        return once there is a leader and every replica streams from it."""
        peer = free_port()
        self.etcd = self._spawn(
            [
                "etcd",
                "--name=etcd0",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=etcd0=http://127.0.0.1:{peer}",
                "--initial-cluster-state=new",
            ],
            "etcd.log",
        )
        poll(lambda: self._http(self.etcd_port, "/health"), timeout=timeout, what="etcd to answer")
        haproxy_cfg = self.root / "haproxy.cfg"
        haproxy_cfg.write_text(haproxy_config(port=self.haproxy_port, nodes=[(m.name, m.ports) for m in self.members]))
        for index, member in enumerate(self.members):
            self.start_patroni(member)
            if index == 0:  # the first bootstraps alone; the others then clone it
                poll(self.leader, timeout=timeout, what="Patroni to elect a leader")
        self.haproxy = self._spawn(["haproxy", "-db", "-f", str(haproxy_cfg)], "haproxy.log")
        self.wait_healthy(timeout=timeout)

    def wait_healthy(self, *, timeout: float = 120) -> Member:
        """Wait until one leader runs and every other node is a streaming replica; the leader."""

        def healthy() -> Member | None:
            leader = self.leader()
            if leader is None:
                return None
            # Patroni 3.0 reports a replica "running" whether it streams or not: ask the leader.
            states = [
                str(r[0])
                for r in self.query(leader, "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'")
            ]
            if len(states) < len(self.members) - 1:
                return None
            if self.synchronous != "off" and "sync" not in states:
                return None
            return leader

        return poll(healthy, timeout=timeout, what="a leader and streaming replicas", interval=0.2)

    def destroy(self) -> None:
        """Stop everything, whatever state it is in (SIGSTOPped, killed), and delete the directory."""
        try:
            for process in [self.haproxy, *(m.process for m in self.members)]:
                if process is not None and process.poll() is None:
                    self._signal_group(process.pid, signal.SIGCONT)
                    self._signal_group(process.pid, signal.SIGTERM)
            for member in self.members:  # a postmaster Patroni could not stop (Patroni killed or stuck)
                pid = member.postmaster_pid()
                if pid is not None:
                    self.groups.add(pid)
                    self._signal_group(pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                p is not None and p.poll() is None for p in [self.haproxy, *(m.process for m in self.members)]
            ):
                time.sleep(0.1)
            if self.etcd is not None and self.etcd.poll() is None:
                self._signal_group(self.etcd.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.etcd.wait(10)
            for _ in range(3):
                found = leftovers(self.root, self.groups)
                if not found:
                    break
                for pid, _command in found:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(AssertionError):
                    poll(lambda: not leftovers(self.root, self.groups), timeout=10, what="leftovers to die")
            for process in [self.etcd, self.haproxy, *(m.process for m in self.members)]:
                if process is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(5)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    # ---- Patroni's view --------------------------------------------------------------------------

    @staticmethod
    def _http(port: int, path: str, *, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
        with urllib.request.urlopen(request, timeout=3) as response:
            text = response.read().decode()
        return json.loads(text) if text.strip().startswith("{") else text or True

    def cluster_state(self) -> dict[str, Any]:
        """Patroni's ``GET /cluster`` from the first node whose REST API answers ({} if none does)."""
        for member in self.members:
            with contextlib.suppress(OSError, ValueError):
                return dict(self._http(member.ports.rest, "/cluster"))
        return {}

    def leader(self) -> Member | None:
        """The member Patroni reports as leader, running, and whose PostgreSQL accepts writes; else None."""
        for entry in self.cluster_state().get("members", []):
            if entry.get("role") in ("leader", "master", "primary") and entry.get("state") == "running":
                member = self.member(entry["name"])
                with contextlib.suppress(psycopg.Error):
                    if not self.query(member, "SELECT pg_is_in_recovery()")[0][0]:
                        return member
        return None

    def wait_leader(
        self, *, other_than: Member | None = None, restarted_from: int | None = None, timeout: float = 180
    ) -> Member:
        """Wait for a leader that accepts writes: another than ``other_than`` when given, or, with
        ``restarted_from`` (a killed postmaster's PID), the same one restarted by Patroni too."""

        def found() -> Member | None:
            member = self.leader()
            if member is None:
                return None
            if member is other_than:
                pid = member.postmaster_pid()
                if restarted_from is None or pid is None or pid == restarted_from:
                    return None
            return member

        return poll(found, timeout=timeout, what="a leader", interval=0.1)

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def patronictl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``patronictl -c node1.yml ARGS`` (any node's configuration names the DCS)."""
        command = ["patronictl", "-c", str(self.members[0].config), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.root)

    # ---- what clients see ------------------------------------------------------------------------

    def query(self, member: Member, sql: str, params: tuple[Any, ...] = (), dbname: str = "postgres") -> list[Any]:
        conninfo = f"host=127.0.0.1 port={member.ports.postgres} user=postgres dbname={dbname} connect_timeout=3"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cursor = conn.execute(sql.encode(), params)
            return cursor.fetchall() if cursor.description else []

    def url(self, dbname: str = "postgres", *, via: str = "hosts") -> str:
        """A libpq URL: ``via="hosts"``: every node, ``target_session_attrs=read-write``;
        ``via="haproxy"``: HAProxy's port."""
        if via == "haproxy":
            return f"postgresql://postgres@127.0.0.1:{self.haproxy_port}/{dbname}?connect_timeout=3"
        hosts = ",".join(f"127.0.0.1:{m.ports.postgres}" for m in self.members)
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write&connect_timeout=3"

    def django_database(self, dbname: str = "postgres", *, via: str = "hosts") -> dict[str, Any]:
        """A Django ``DATABASES`` entry reaching the leader ``via`` the hosts list or HAProxy."""
        if via == "haproxy":
            return {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": dbname,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": str(self.haproxy_port),
                "OPTIONS": {"connect_timeout": 3},
            }
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": dbname,
            "USER": "postgres",
            "HOST": ",".join("127.0.0.1" for _ in self.members),
            "PORT": ",".join(str(m.ports.postgres) for m in self.members),
            "OPTIONS": {"target_session_attrs": "read-write", "connect_timeout": 3},
        }


def epochs(cluster: PatroniCluster, member: Member, keys: list[str]) -> dict[str, int]:
    """The epochs of ``keys`` on ``member``'s server (keys never granted are absent)."""
    rows = cluster.query(member, "SELECT key, epoch FROM pg_lease_django_lease WHERE key = ANY(%s)", (keys,))
    return {key: int(epoch) for key, epoch in rows}


def children_of(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _processes() -> Iterator[tuple[int, int, str, str]]:
    """(pid, pgid, comm, command line) of every live process (zombies left out)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        yield int(entry.name), int(fields[2]), comm, " ".join(a.decode(errors="replace") for a in argv if a)


def leftovers(root: Path, groups: set[int] = frozenset()) -> list[tuple[int, str]]:  # type: ignore[assignment]
    """Every patroni, etcd, haproxy or postgres process whose command line names ``root`` or whose
    process group is one of ``groups`` (pid, command line)."""
    found = []
    for pid, pgid, comm, command in _processes():
        if pid == os.getpid():
            continue
        ours = str(root) in command or pgid in groups
        kind = comm in ("etcd", "haproxy", "postgres", "patroni", "pg_rewind", "pg_basebackup") or any(
            word in command for word in ("patroni", "etcd", "haproxy", "postgres")
        )
        if ours and kind:
            found.append((pid, command))
    return found
