"""A remote-controlled lease client in its own process, for fault tests (kill, SIGSTOP, restarts, clock steps).

``python -m stress.agent URL OWNER`` sets Django up on ``URL`` (devkit.settings) and answers one JSON
command per stdin line with one JSON reply per stdout line. :class:`Agent` is the parent's side.

Commands (``op``): ``pid``; ``acquire`` (key, ttl, blocking, timeout); ``renew`` (key, epoch, ttl);
``release`` (key, epoch); ``inspect`` (key); ``counter`` (key: create the key's counter row if
needed, return its value); ``write`` (key, epoch: increment the key's counter under the fence; with
``hold`` it replies ``{"stage": "fenced"}`` after the fenced save and waits for a ``commit`` or
``rollback`` line before finishing the transaction). Errors come back as
``{"ok": false, "error": class name, "code": LeaseError code or SQLSTATE}``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _error(exc: BaseException) -> dict[str, Any]:
    cause = getattr(exc, "__cause__", None)
    code = getattr(exc, "code", None) or getattr(exc, "sqlstate", None) or getattr(cause, "sqlstate", None)
    return {
        "ok": False,
        "error": type(exc).__name__,
        "module": type(exc).__module__,
        "code": code,
        "message": str(exc)[:300],
    }


def serve(owner: str) -> None:
    """Answer commands from stdin until it closes."""
    from django.db import connection, transaction

    from devkit.testapp.models import Invoice
    from pg_lease_django import Grant, Lease, unfenced_writes

    def reply(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    def grant(command: dict[str, Any]) -> Grant:
        return Grant(command["key"], owner, command["epoch"], datetime.now(), datetime.now())

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "pid":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    reply({"ok": True, "pid": cursor.fetchone()[0]})
            elif op == "acquire":
                got = Lease.objects.acquire(
                    command["key"],
                    owner,
                    command["ttl"],
                    blocking=command.get("blocking", False),
                    timeout=command.get("timeout"),
                )
                if got is None:
                    reply({"ok": False, "error": "not_acquirable", "code": "not_acquirable"})
                else:
                    reply(
                        {
                            "ok": True,
                            "epoch": got.epoch,
                            "server_time": _ts(got.server_time),
                            "expires_at": _ts(got.expires_at),
                        }
                    )
            elif op == "renew":
                expires_at = Lease.objects.renew(command["key"], owner, command["epoch"], command["ttl"])
                reply({"ok": True, "expires_at": _ts(expires_at)})
            elif op == "release":
                Lease.objects.release(command["key"], owner, command["epoch"])
                reply({"ok": True})
            elif op == "inspect":
                state = Lease.objects.inspect(command["key"])
                reply(
                    {
                        "ok": True,
                        "status": state.status,
                        "owner": state.owner,
                        "epoch": state.epoch,
                        "expires_at": _ts(state.expires_at),
                        "server_time": _ts(state.server_time),
                    }
                )
            elif op == "counter":
                with unfenced_writes():  # setting up the resource is no lease holder's write
                    invoice, _ = Invoice.objects.get_or_create(account=command["key"])
                reply({"ok": True, "value": invoice.amount, "lease_epoch": invoice.lease_epoch})
            elif op == "write":
                with transaction.atomic():
                    invoice = Invoice.objects.get(account=command["key"])
                    invoice.amount += 1
                    invoice.save(fence=grant(command), update_fields=["amount"])
                    if command.get("hold"):
                        reply({"ok": True, "stage": "fenced"})
                        if sys.stdin.readline().strip() != "commit":
                            transaction.set_rollback(True)
                reply({"ok": True, "value": invoice.amount})
            else:
                reply({"ok": False, "error": "unknown_command", "code": op})
        except Exception as exc:
            reply(_error(exc))
            if connection.connection is not None and connection.connection.closed:
                connection.close()


def main() -> None:
    """``python -m stress.agent URL OWNER``."""
    url, owner = sys.argv[1], sys.argv[2]
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "devkit.settings"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    import logging

    logging.getLogger("pg_lease_django").setLevel(logging.ERROR)
    serve(owner)


class Agent:
    """The parent's handle on an agent process."""

    def __init__(self, url: str, owner: str) -> None:
        self.owner = owner
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stress.agent", url, owner],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        """The agent's process id."""
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(json.loads(line))

    def send(self, **command: Any) -> None:
        """Send a command without waiting for its reply."""
        self.send_line(json.dumps(command))

    def send_line(self, line: str) -> None:
        """Send a raw line (``commit`` / ``rollback`` for a held write)."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply (raises ``queue.Empty`` after ``timeout`` seconds)."""
        return self.replies.get(timeout=timeout)

    def call(self, timeout: float = 60.0, **command: Any) -> dict[str, Any]:
        """Send a command and wait for its reply."""
        self.send(**command)
        return self.reply(timeout)

    def close(self) -> None:
        """End the agent (closing stdin; killing it if it does not exit)."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(10)
            except Exception:
                self.process.kill()
                self.process.wait(10)


if __name__ == "__main__":
    main()
