"""A lease client in its own process, connected to a replicated cluster the way a user's project is.

    python -m devkit.failover_child            (PG_LEASE_FAILOVER_DATABASE: a DATABASES entry, JSON)

Its Django settings are its own (below): one ``default`` database with a multi-host ``HOST``/``PORT``
and ``target_session_attrs=read-write`` (devkit/pgcluster.py, ``Cluster.django_database()``), so
every connection it opens, Django's own and ``hold()``'s heartbeat connections, lands on
whichever server accepts writes. It answers one JSON command per stdin line with one JSON reply
per stdout line (:class:`Child` is the parent's side).

Commands (``op``): ``migrate``; ``acquire`` (key, owner, ttl; optional ``blocking``, ``timeout``, and
``asynchronous``: ``aacquire`` in an event loop of its own); ``inspect`` (key); ``hold`` (key,
ttl, owner: enter ``hold()`` in a thread of its own, reply once it holds); ``held`` (how the hold
sees itself now); ``unhold`` (leave the hold, reply how it ended); ``leases`` (args: run ``manage.py
leases ARGS``, as an operator would, reply its output and exit code); ``elect`` (key, ttl, owner: campaign
with ``elect()`` in its thread, leading until told to stop); ``elected`` (whether it leads, the
epoch); ``unelect`` (stop the election); ``events`` (reply and clear this process's event log:
failed and recovered renewals from the heartbeat's log records, ``lease_lost``, the election's
terms, each with its ``time.monotonic()``). A failed call replies
``{"ok": false, "error": ..., "operational": ...}`` (``operational``: a ``django.db.OperationalError``,
an unknown outcome) and closes Django's connection, so the next call reconnects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def configure() -> None:
    from django.conf import settings

    settings.configure(
        SECRET_KEY="failover-child",
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        INSTALLED_APPS=["django.contrib.contenttypes", "pg_lease_django"],
        DATABASES={"default": json.loads(os.environ["PG_LEASE_FAILOVER_DATABASE"])},
        LOGGING_CONFIG=None,
        # "0": as behind a transaction pooler (a renewal is SET LOCAL, the call, COMMIT).
        PG_LEASE_LISTEN=os.environ.get("PG_LEASE_FAILOVER_LISTEN", "1") == "1",
    )
    import django

    django.setup()


EVENTS: list[dict[str, Any]] = []
_EVENTS_LOCK = threading.Lock()


def record(event: str, **fields: Any) -> None:
    """Append to the event log, stamped with ``time.monotonic()`` (one clock for every process here)."""
    with _EVENTS_LOCK:
        EVENTS.append({"event": event, "at": time.monotonic(), **fields})


class HeartbeatEvents(logging.Handler):
    """The heartbeat's own account of its renewals: each failed attempt, the first success after them."""

    def emit(self, log: logging.LogRecord) -> None:
        text = str(log.msg)
        if text.startswith("renewing lease %r failed"):
            record("renew_failed", key=log.args[0] if isinstance(log.args, tuple) else None)
        elif text.startswith("renewed lease %r after"):
            record("renewed", key=log.args[0] if isinstance(log.args, tuple) else None)


def watch_events() -> None:
    from pg_lease_django.signals import lease_lost

    heartbeat = logging.getLogger("pg_lease_django.holds.heartbeat")
    heartbeat.setLevel(logging.INFO)
    heartbeat.propagate = False
    heartbeat.addHandler(HeartbeatEvents())

    def lost(sender: Any, lease: Any, error: BaseException, **kwargs: Any) -> None:
        record("lost", key=lease.key, epoch=lease.epoch, error=type(error).__name__)

    lease_lost.connect(lost, weak=False)


def start_election(key: str, ttl: float, owner: str) -> Any:
    """``elect()``; each term is recorded (``leading`` with its epoch, ``stopped_leading``)."""
    from pg_lease_django import current_election, elect

    def lead(lease: Any) -> None:
        record("leading", key=key, epoch=lease.epoch)
        election = current_election()
        assert election is not None
        election.wait_stop()

    return elect(
        key,
        ttl=ttl,
        owner=owner,
        on_started_leading=lead,
        on_stopped_leading=lambda: record("stopped_leading", key=key),
    )


class HoldThread(threading.Thread):
    """``with hold(key, ttl=..., owner=...) as lease`` until told to leave."""

    def __init__(self, key: str, ttl: float, owner: str) -> None:
        super().__init__(daemon=True)
        self.key, self.ttl, self.owner = key, ttl, owner
        self.entered: queue.Queue[dict[str, Any]] = queue.Queue()
        self.leave = threading.Event()
        self.lease: Any = None
        self.exit_error: str | None = None

    def run(self) -> None:
        from pg_lease_django import hold

        try:
            with hold(self.key, ttl=self.ttl, owner=self.owner) as lease:
                self.lease = lease
                self.entered.put({"ok": True, "epoch": lease.epoch, "expires_at": lease.expires_at.timestamp()})
                self.leave.wait()
        except BaseException as exc:
            if self.lease is None:
                self.entered.put({"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]})
            else:
                self.exit_error = f"{type(exc).__name__}: {str(exc)[:300]}"

    def state(self) -> dict[str, Any]:
        """How the hold sees itself (`lease_state`)."""
        return {"ok": True, **lease_state(self.lease, self.ttl)}


def lease_state(lease: Any, ttl: float) -> dict[str, Any]:
    """A held lease as its holder sees it; ``renewal_sent_at``: ``time.monotonic()`` (one clock for
    every process of this machine) when the last confirmed grant or renewal was sent."""
    from pg_lease_django import conf

    trust_span = ttl * (1 - conf.safety_margin())
    return {
        "epoch": lease.epoch,
        "lost": lease.lost,
        "error": None if lease.error is None else type(lease.error).__name__,
        "expires_at": lease.expires_at.timestamp(),
        "trust_remaining": lease.trust_remaining,
        "trust_span": trust_span,
        "renewal_sent_at": time.monotonic() + lease.trust_remaining - trust_span,
    }


def acquire(command: dict[str, Any]) -> Any:
    """``Lease.objects.acquire`` (``blocking``, ``timeout`` if given), or with ``asynchronous``
    ``aacquire`` run in an event loop of its own (``asyncio.run``)."""
    from pg_lease_django import Lease

    options: dict[str, Any] = {"ttl": command["ttl"]}
    if command.get("blocking"):
        options.update(blocking=True, timeout=command.get("timeout"))
    if command.get("asynchronous"):
        return asyncio.run(Lease.objects.aacquire(command["key"], command["owner"], **options))
    return Lease.objects.acquire(command["key"], command["owner"], **options)


def serve() -> None:
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError
    from django.db import OperationalError, connection

    from pg_lease_django import Lease

    holding: HoldThread | None = None
    election: Any = None
    watch_events()

    def reply(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "migrate":
                call_command("migrate", "pg_lease_django", verbosity=0)
                reply({"ok": True})
            elif op == "acquire":
                grant = acquire(command)
                port = connection.connection.info.port if connection.connection is not None else None
                reply({"ok": True, "granted": grant is not None, "epoch": grant and grant.epoch, "port": port})
            elif op == "inspect":
                state = Lease.objects.inspect(command["key"])
                reply({"ok": True, "status": str(state.status), "owner": state.owner, "epoch": state.epoch})
            elif op == "hold":
                holding = HoldThread(command["key"], command["ttl"], command["owner"])
                holding.start()
                reply(holding.entered.get(timeout=60))
            elif op == "leases":
                out = StringIO()
                try:
                    call_command("leases", *command["args"], stdout=out)
                    reply({"ok": True, "exit_code": 0, "output": out.getvalue()})
                except CommandError as exc:
                    reply({"ok": True, "exit_code": exc.returncode, "output": str(exc)})
            elif op == "elect":
                election = start_election(command["key"], command["ttl"], command["owner"])
                reply({"ok": True})
            elif op == "elected":
                lease = election and election.lease
                seen = lease_state(lease, command["ttl"]) if lease is not None else {"epoch": None}
                reply({"ok": True, **seen, "leading": bool(election and election.leading)})
            elif op == "unelect":
                election.stop()
                reply({"ok": True, "exited": election.join(60)})
            elif op == "events":
                with _EVENTS_LOCK:
                    events = EVENTS[:]
                    EVENTS.clear()
                reply({"ok": True, "events": events})
            elif op == "held":
                assert holding is not None
                reply(holding.state())
            elif op == "unhold":
                assert holding is not None
                holding.leave.set()
                holding.join(60)
                reply({**holding.state(), "exited": not holding.is_alive(), "exit_error": holding.exit_error})
            else:
                reply({"ok": False, "error": "unknown op", "message": op})
        except Exception as exc:
            operational = isinstance(exc, OperationalError)
            reply({"ok": False, "error": type(exc).__name__, "message": str(exc)[:300], "operational": operational})
            connection.close()


class Child:
    """The parent's handle on a failover child process."""

    def __init__(self, database: dict[str, Any], *, listen: bool = True) -> None:
        environ = {**os.environ, "PG_LEASE_FAILOVER_DATABASE": json.dumps(database), "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "devkit.failover_child"],
            cwd=REPO,
            env={**environ, "PG_LEASE_FAILOVER_LISTEN": "1" if listen else "0"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(json.loads(line))

    def call(self, timeout: float = 60.0, **command: Any) -> dict[str, Any]:
        """Send a command and wait for its reply (``queue.Empty`` after ``timeout`` seconds)."""
        self.send(**command)
        return self.receive(timeout)

    def send(self, **command: Any) -> None:
        """Send a command without waiting for its reply (`receive` it later)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply (``queue.Empty`` after ``timeout`` seconds)."""
        return self.replies.get(timeout=timeout)

    def close(self) -> None:
        """End the child (closing stdin; killing it if it does not exit in time)."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(20)
            except Exception:
                self.process.kill()
                self.process.wait(10)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    configure()
    logging.getLogger("pg_lease_django").setLevel(logging.ERROR)
    serve()
