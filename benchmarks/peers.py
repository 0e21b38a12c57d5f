"""Stage ``peers``: acquire + release of a named lock, ours and each installed peer's, side by side.

The peers come from ``requirements-peers.txt``; one that is missing (or has no server) is a skipped row.
python-redis-lock is measured twice: against the Redis on 127.0.0.1:6379 (which keeps nothing on
disk here), and against a Redis this stage starts itself with ``appendonly yes`` and
``appendfsync always``, the configuration in which a granted lock survives a crash, as ours does.
"""

from __future__ import annotations

import importlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

from common import TTL, Cycle, Report, Row, Timer, available, interleave, ratio

DURABLE_REDIS = "python-redis-lock fsync=always"

PEERS = {
    "pg_lease_django": "durable row + fencing epoch + server-clock TTL",
    "django-pglock": "advisory lock: no TTL, no fencing token, not durable, needs a session",
    "django-db-mutex": "lock row: no fencing token, TTL on client clock, deleted on release",
    "tooz (pgsql)": "advisory lock: no TTL, no fencing, not durable; 16-bit key hash",
    "python-redis-lock": "Redis SET NX EX: no fencing token, not durable (no fsync per grant)",
    DURABLE_REDIS: "Redis SET NX EX, appendfsync always: durable grants, no fencing token",
}
#: The peers whose grants survive a crash: our target is to beat them (> 1x).
DURABLE = ("django-db-mutex", DURABLE_REDIS)


def _peer_module(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except Exception as exc:
        return None, f"not installed ({type(exc).__name__}); pip install -r benchmarks/requirements-peers.txt"


def redis_answers(host: str = "127.0.0.1", port: int = 6379) -> bool:
    """True if something answers PING with PONG on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def durable_redis() -> Iterator[int | None]:
    """A Redis of this stage's own that fsyncs every write before answering; its port, or None
    without ``redis-server``. Started on a free port in a temporary directory, stopped by its PID."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
        server = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", ""),
                *("--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not redis_answers(port=port):  # polling a server that is starting
                if server.poll() is not None or time.monotonic() > deadline:
                    yield None
                    return
                time.sleep(0.05)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=10)


def run(report: Report, database: dict[str, Any], rounds: int, block: float, owner: str) -> None:
    """acquire + release of a named lock, ours and each installed peer's, interleaved on one machine."""
    with ExitStack() as stack:  # the durable Redis, stopped however the stage ends
        _run(stack, report, database, rounds, block, owner)


def _run(stack: ExitStack, report: Report, database: dict[str, Any], rounds: int, block: float, owner: str) -> None:
    from pg_lease_django import Lease

    run_id = uuid.uuid4().hex[:8]
    cycles: dict[str, Cycle] = {}
    skipped: dict[str, str] = {}

    def ours(t: Timer) -> None:
        grant = t("acquire", Lease.objects.acquire, "bench:peer", owner, TTL)
        t("release", Lease.objects.release, "bench:peer", owner, grant.epoch)

    cycles["pg_lease_django"] = ours

    pglock, why = _peer_module("pglock")
    if pglock is not None:

        def advisory(t: Timer) -> None:
            lock = pglock.advisory(f"bench:peer:{run_id}", timeout=0)
            assert t("acquire", lock.__enter__)
            t("release", lock.__exit__, None, None, None)

        cycles["django-pglock"] = advisory
    else:
        skipped["django-pglock"] = why

    db_mutex, why = _peer_module("db_mutex.db_mutex")
    if db_mutex is not None:

        def mutex(t: Timer) -> None:
            lock = db_mutex.db_mutex(f"bench:peer:{run_id}")
            t("acquire", lock.__enter__)
            t("release", lock.__exit__, None, None, None)

        cycles["django-db-mutex"] = mutex
    else:
        skipped["django-db-mutex"] = why

    coordination, why = _peer_module("tooz.coordination")
    if coordination is not None and not available("psycopg2"):
        coordination, why = None, "tooz installed without psycopg2 (its PostgreSQL driver needs it)"
    coordinator = None
    if coordination is not None:
        url = (
            f"postgresql://{database['USER']}{':' + database['PASSWORD'] if database['PASSWORD'] else ''}"
            f"@{database['HOST']}:{database['PORT']}/{database['NAME']}"
        )
        coordinator = coordination.get_coordinator(url, f"bench-{run_id}".encode())
        coordinator.start()

        def tooz_lock(t: Timer) -> None:
            lock = coordinator.get_lock(f"bench:peer:{run_id}".encode())
            assert t("acquire", lock.acquire, blocking=False)
            t("release", lock.release)

        cycles["tooz (pgsql)"] = tooz_lock
    else:
        skipped["tooz (pgsql)"] = why

    redis_lock, why = _peer_module("redis_lock")
    redis_clients: list[Any] = []

    def redis_cycle_on(port: int) -> Cycle:
        assert redis_lock is not None
        client = importlib.import_module("redis").Redis(host="127.0.0.1", port=port)
        redis_clients.append(client)

        def redis_cycle(t: Timer) -> None:
            lock = redis_lock.Lock(client, f"bench:peer:{run_id}", expire=30)
            assert t("acquire", lock.acquire, blocking=False)
            t("release", lock.release)

        return redis_cycle

    if redis_lock is None:
        skipped["python-redis-lock"] = skipped[DURABLE_REDIS] = why
    else:
        if redis_answers():
            cycles["python-redis-lock"] = redis_cycle_on(6379)
        else:
            skipped["python-redis-lock"] = "no Redis answering on 127.0.0.1:6379"
        durable_port = stack.enter_context(durable_redis())
        if durable_port is None:
            skipped[DURABLE_REDIS] = "redis-server could not be started here (Debian: apt-get install redis-server)"
        else:
            cycles[DURABLE_REDIS] = redis_cycle_on(durable_port)
            assert redis_clients[-1].config_get("appendfsync") == {"appendfsync": "always"}

    series = interleave(cycles, rounds, block)
    us = series["pg_lease_django"]
    durable_peers_beaten = True
    for name in PEERS:
        if name in skipped:
            report.add(Row("peers", name, note=f"skipped: {skipped[name]}"))
            continue
        s = series[name]
        relative = ratio(us, s)
        durable = name in DURABLE
        if durable:
            durable_peers_beaten &= relative > 1
        report.add(
            Row(
                "peers",
                f"{name} acquire+release",
                s.rate,
                s.cycle_ms(0.5),
                s.cycle_ms(0.99),
                None if name == "pg_lease_django" else relative,
                "" if name == "pg_lease_django" else "us / peer (ops/s)",
                "> 1x" if durable else "",
                (relative > 1) if durable else None,
                PEERS[name],
            )
        )
    report.details["peers_skipped"] = skipped
    if coordinator is not None:
        coordinator.stop()
    for client in redis_clients:
        client.close()
