"""Blocking waiters in their own process, connected to a replicated cluster the way a user's project is.

    python -m tests.children.listen_child      (PG_LEASE_FAILOVER_DATABASE: a DATABASES entry, JSON)

For tests/cluster/test_failover_listen.py. Its Django settings are its own, as in devkit/failover_child.py: one
``default`` database with a multi-host ``HOST``/``PORT`` and ``target_session_attrs=read-write``, so
every connection it opens (Django's own, the lease connections of ``hold()``, the connection of an
async wait) lands on whichever server accepts writes. ``PG_LEASE_POLL_INTERVAL`` comes from
``PG_LEASE_LISTEN_CHILD_POLL`` (default one hour: a prompt grant can then only come from a release
notification), ``PG_LEASE_LISTEN`` from ``PG_LEASE_LISTEN_CHILD_LISTEN`` (default on).

One JSON command per stdin line, each with an ``id``; one JSON reply per command on stdout, carrying
its ``id``. A ``wait`` runs in a thread of its own and replies when the wait ends, so several waits
run at once and replies come in any order (:class:`Waiters` is the parent's side).

Commands (``op``): ``migrate`` (the lease app and devkit.testapp); ``wait`` (how: ``acquire`` for
``Lease.objects.acquire(blocking=True)``, ``hold`` for ``hold(blocking=True)`` (``blocking: false``:
``hold()`` as it is mostly used, no wait), ``aacquire`` for ``Lease.objects.aacquire(blocking=True)``;
key, owner, ttl, timeout): replies ``{"ok": true, "epoch", "port", "granted_at", "granted_wall",
"server_time", "expires_at"}`` (``granted_at``: ``time.monotonic()``, one clock for every process of
this machine; ``granted_wall``: ``time.time()``; ``server_time``/``expires_at``: the grant's, epoch
seconds, ``hold`` excepted; ``port``: the server it was granted on, when the connection can tell) or
``{"ok": false, "error", "message", "operational", "failed_at"}``; a hold stays entered until ``unhold``
(key), which replies how it ended; ``held`` (key) replies how the hold sees itself now. ``write``
(key, owner, epoch): a fenced write, ``Invoice(account=key).save(fence=...)`` with that owner and
epoch as the fence, checked by the server; replies ``{"ok": true}`` or the refusal (``code``).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def configure() -> None:
    from django.conf import settings

    settings.configure(
        SECRET_KEY="listen-child",
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        # devkit.testapp: its FencedModel Invoice, for fenced writes (``write``).
        INSTALLED_APPS=["django.contrib.contenttypes", "pg_lease_django", "devkit.testapp"],
        DATABASES={"default": json.loads(os.environ["PG_LEASE_FAILOVER_DATABASE"])},
        LOGGING_CONFIG=None,
        PG_LEASE_LISTEN=os.environ.get("PG_LEASE_LISTEN_CHILD_LISTEN", "1") == "1",
        PG_LEASE_POLL_INTERVAL=float(os.environ.get("PG_LEASE_LISTEN_CHILD_POLL", "3600")),
    )
    import django

    django.setup()


def failure(exc: BaseException) -> dict[str, Any]:
    from django.db import OperationalError

    return {
        "ok": False,
        "error": type(exc).__name__,
        "message": str(exc)[:400],
        "operational": isinstance(exc, OperationalError),
        "failed_at": time.monotonic(),
    }


class Waiter(threading.Thread):
    """One blocking wait; replies through ``reply`` when it ends (a hold: when entered)."""

    def __init__(self, command: dict[str, Any], reply: Any) -> None:
        super().__init__(daemon=True)
        self.command, self.reply = command, reply
        self.leave = threading.Event()
        self.lease: Any = None
        self.exit_error: str | None = None

    def run(self) -> None:
        command = self.command
        try:
            how, key, owner, ttl = (command[name] for name in ("how", "key", "owner", "ttl"))
            timeout = command.get("timeout")
            if how == "acquire":
                self.acquire(key, owner, ttl, timeout)
            elif how == "aacquire":
                self.aacquire(key, owner, ttl, timeout)
            elif how == "hold":
                self.hold(key, owner, ttl, timeout)
            else:
                self.reply({"ok": False, "error": "unknown how", "message": how})
        except BaseException as exc:
            if self.lease is None:
                self.reply(failure(exc))
            else:
                self.exit_error = f"{type(exc).__name__}: {str(exc)[:300]}"

    def acquire(self, key: str, owner: str, ttl: float, timeout: float | None) -> None:
        from django.db import connection

        from pg_lease_django import Lease

        try:
            grant = Lease.objects.acquire(key, owner, ttl=ttl, blocking=True, timeout=timeout)
            reply = granted(grant)
            reply["port"] = connection.connection.info.port if connection.connection is not None else None
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_listening_channels()")
                (reply["listening"],) = cursor.fetchone()
            self.reply(reply)
        finally:
            connection.close()

    def aacquire(self, key: str, owner: str, ttl: float, timeout: float | None) -> None:
        from pg_lease_django import Lease

        grant = asyncio.run(Lease.objects.aacquire(key, owner, ttl=ttl, blocking=True, timeout=timeout))
        self.reply(granted(grant))

    def hold(self, key: str, owner: str, ttl: float, timeout: float | None) -> None:
        from pg_lease_django import hold

        blocking = self.command.get("blocking", True)
        with hold(key, ttl=ttl, owner=owner, blocking=blocking, timeout=timeout if blocking else None) as lease:
            self.lease = lease
            reply = {"ok": True, "epoch": lease.epoch, "port": None, "granted_at": time.monotonic()}
            self.reply({**reply, "granted_wall": time.time(), "expires_at": lease.expires_at.timestamp()})
            self.leave.wait()

    def state(self) -> dict[str, Any]:
        """How the hold sees itself now."""
        lease = self.lease
        return {
            "ok": True,
            "epoch": lease.epoch,
            "lost": lease.lost,
            "error": None if lease.error is None else type(lease.error).__name__,
            "expires_at": lease.expires_at.timestamp(),
            "trust_remaining": lease.trust_remaining,
            "at": time.monotonic(),
        }

    def ended(self) -> dict[str, Any]:
        self.leave.set()
        self.join(60)
        lease = self.lease
        return {
            "ok": True,
            "exited": not self.is_alive(),
            "lost": None if lease is None else lease.lost,
            "exit_error": self.exit_error,
        }


def granted(grant: Any) -> dict[str, Any]:
    return {
        "ok": True,
        "epoch": grant.epoch,
        "port": None,
        "granted_at": time.monotonic(),
        "granted_wall": time.time(),
        "server_time": grant.server_time.timestamp(),
        "expires_at": grant.expires_at.timestamp(),
    }


def fenced_write(key: str, owner: str, epoch: int) -> dict[str, Any]:
    """``Invoice(account=key).save(fence=...)`` with ``(key, owner, epoch)`` as the fence."""
    from django.db import connection

    from devkit.testapp.models import Invoice
    from pg_lease_django import LeaseLostError

    fence = SimpleNamespace(key=key, owner=owner, epoch=epoch)
    try:
        Invoice(account=key, amount=epoch).save(fence=fence)
    except LeaseLostError as exc:
        return {"ok": False, "error": type(exc).__name__, "code": getattr(exc, "code", None), "at": time.monotonic()}
    finally:
        connection.close()
    return {"ok": True, "at": time.monotonic()}


def serve() -> None:
    from django.core.management import call_command

    lock = threading.Lock()
    holds: dict[str, Waiter] = {}

    def replier(ident: Any) -> Any:
        def reply(message: dict[str, Any]) -> None:
            with lock:
                sys.stdout.write(json.dumps({**message, "id": ident}) + "\n")
                sys.stdout.flush()

        return reply

    for line in sys.stdin:
        command = json.loads(line)
        reply = replier(command["id"])
        op = command["op"]
        try:
            if op == "migrate":
                call_command("migrate", verbosity=0)
                reply({"ok": True})
            elif op == "held":
                reply(holds[command["key"]].state())
            elif op == "write":
                reply(fenced_write(command["key"], command["owner"], command["epoch"]))
            elif op == "wait":
                waiter = Waiter(command, reply)
                if command["how"] == "hold":
                    holds[command["key"]] = waiter
                waiter.start()
            elif op == "unhold":
                reply(holds.pop(command["key"]).ended())
            else:
                reply({"ok": False, "error": "unknown op", "message": op})
        except Exception as exc:
            reply(failure(exc))


class Waiters:
    """The parent's handle on a listen child: send commands, collect replies by id."""

    def __init__(self, database: dict[str, Any], *, listen: bool = True, poll_interval: float = 3600.0) -> None:
        environ = {
            **os.environ,
            "PG_LEASE_FAILOVER_DATABASE": json.dumps(database),
            "PYTHONPATH": str(REPO),
            "PG_LEASE_LISTEN_CHILD_LISTEN": "1" if listen else "0",
            "PG_LEASE_LISTEN_CHILD_POLL": str(poll_interval),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.children.listen_child"],
            cwd=REPO,
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._next = 0
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            self._queue(message.pop("id")).put(message)

    def _queue(self, ident: int) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._replies.setdefault(ident, queue.Queue())

    def send(self, **command: Any) -> int:
        """Send a command; its id, to `receive` its reply later."""
        with self._lock:
            self._next += 1
            ident = self._next
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({**command, "id": ident}) + "\n")
        self.process.stdin.flush()
        return ident

    def receive(self, ident: int, timeout: float = 60.0) -> dict[str, Any]:
        """The reply to command ``ident`` (``queue.Empty`` after ``timeout`` seconds)."""
        return self._queue(ident).get(timeout=timeout)

    def replied(self, ident: int) -> bool:
        """Whether command ``ident`` has replied (the reply stays to `receive`)."""
        return not self._queue(ident).empty()

    def call(self, reply_within: float = 60.0, **command: Any) -> dict[str, Any]:
        """Send a command and wait for its reply (``queue.Empty`` after ``reply_within`` seconds)."""
        return self.receive(self.send(**command), reply_within)

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
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve()
