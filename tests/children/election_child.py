"""A campaigner in a process of its own, for tests/chaos/test_election.py; and `Campaigner`, the parent's handle.

    python -m tests.children.election_child sync|async KEY TTL NAME     (DATABASE_URL: the test database)
    python -m tests.children.election_child command                     (the COMMAND of ``leases run --campaign``)

It campaigns with ``elect()`` (``sync``) or ``aelect()`` (``async``) until its stdin closes, then
stops and exits. Each event is one JSON line on stdout with ``at`` (``time.monotonic()``: one clock
for every process of this machine): ``ready`` (owner, pid), ``leader`` (identity: on_new_leader),
``leading`` (epoch), ``wrote`` (epoch: its first fenced write of the term), ``freezing`` (after
SIGUSR1, right before it stops itself with SIGSTOP between two writes), ``refused`` (a fenced write
was refused: the lease had moved on), ``stepping`` (epoch, lost, handoff: the callback returns),
``stopped`` (on_stopped_leading), ``exit``.

While it leads it writes a fenced ``Entry`` row (account=KEY, writer=NAME) every `STEP` seconds,
and stamps it in the same transaction with the server clock read after the fence check
(``ticket``, microseconds). The fence keeps the lease row locked until commit, so no takeover
completes before the stamp: the table is the history of the terms, on the server clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: Seconds between two fenced writes of a leader.
STEP = 0.1


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def record(lease: Any, name: str) -> None:
    """One fenced write, stamped with the server clock inside its transaction (raises LeaseLostError once stale)."""
    from django.db import transaction
    from django.db.models.expressions import RawSQL

    from devkit.testapp.models import Entry

    with transaction.atomic():
        entry = Entry(account=lease.key, writer=name)
        entry.save(fence=lease)
        now_us = RawSQL("(extract(epoch FROM clock_timestamp()) * 1000000)::bigint", ())
        Entry.objects.fenced(lease).filter(pk=entry.pk).update(ticket=now_us)


def run_sync(key: str, ttl: float, name: str) -> None:
    from pg_lease_django import LeaseLostError, current_election, elect

    freeze = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: freeze.set())

    def lead(lease: Any) -> None:
        emit("leading", epoch=lease.epoch)
        election = current_election()
        assert election is not None
        try:
            record(lease, name)
            emit("wrote", epoch=lease.epoch)
            while True:
                if freeze.is_set():
                    # SIGSTOP between two writes, never inside a fenced transaction: a leader frozen
                    # there keeps the lease row locked, and the takeover waits for it (docs/fencing.md).
                    freeze.clear()
                    emit("freezing", epoch=lease.epoch)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if election.wait_stop(timeout=STEP):
                    break
                record(lease, name)
        except LeaseLostError as exc:
            emit("refused", epoch=lease.epoch, error=type(exc).__name__)
        emit("stepping", epoch=lease.epoch, lost=lease.lost, handoff=lease.handoff_requested)

    election = elect(
        key,
        ttl=ttl,
        owner=name,
        on_started_leading=lead,
        on_stopped_leading=lambda: emit("stopped"),
        on_new_leader=lambda identity: emit("leader", identity=identity),
    )
    emit("ready", owner=election.owner, pid=os.getpid())
    sys.stdin.read()  # until the parent closes our stdin
    election.stop()
    election.join()


def run_async(key: str, ttl: float, name: str) -> None:
    import asyncio
    import contextlib

    from asgiref.sync import sync_to_async

    from pg_lease_django import LeaseLostError, aelect

    async def lead(lease: Any) -> None:
        emit("leading", epoch=lease.epoch)
        try:
            await sync_to_async(record)(lease, name)
            emit("wrote", epoch=lease.epoch)
            while True:
                await asyncio.sleep(STEP)
                await sync_to_async(record)(lease, name)
        except LeaseLostError as exc:
            emit("refused", epoch=lease.epoch, error=type(exc).__name__)
        finally:
            emit("stepping", epoch=lease.epoch, lost=lease.lost, handoff=lease.handoff_requested)

    async def main() -> None:
        campaign = asyncio.ensure_future(
            aelect(
                key,
                ttl=ttl,
                owner=name,
                on_started_leading=lead,
                on_stopped_leading=lambda: emit("stopped"),
                on_new_leader=lambda identity: emit("leader", identity=identity),
            )
        )
        emit("ready", owner=name, pid=os.getpid())
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        campaign.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await campaign

    asyncio.run(main())


def run_command() -> None:
    """COMMAND for tests/chaos/test_campaign.py: fenced writes under ``leases run``'s lease, from raw SQL.

    Reports ``running`` (pid, owner, epoch) and ``wrote`` after its first write; writes an ``Entry``
    (writer: the owner) every `STEP` seconds, presenting the fence first so that the stamp is read
    under the locked lease row; reports ``refused`` for a write the fence refused. SIGUSR1: report ``done`` and exit 0;
    SIGTERM: report ``terminated`` and exit 143.
    """
    import psycopg

    key, owner, epoch = os.environ["PG_LEASE_KEY"], os.environ["PG_LEASE_OWNER"], int(os.environ["PG_LEASE_EPOCH"])

    def leave(event: str, status: int) -> Any:
        def handler(signum: int, frame: Any) -> None:
            emit(event, epoch=epoch)
            raise SystemExit(status)

        return handler

    signal.signal(signal.SIGUSR1, leave("done", 0))
    signal.signal(signal.SIGTERM, leave("terminated", 143))
    emit("running", pid=os.getpid(), owner=owner, epoch=epoch)
    fence = [key, owner, epoch]
    wrote = False
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        while True:
            try:
                with conn.transaction():
                    conn.execute("SELECT pg_lease_check_fence(%s, %s, %s::bigint)", fence)
                    conn.execute(
                        "INSERT INTO testapp_entry (lease_key, lease_epoch, account, writer, ticket) VALUES "
                        "(%s, %s, %s, %s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)",
                        [key, epoch, key, owner],
                    )
            except psycopg.Error as exc:
                emit("refused", epoch=epoch, sqlstate=exc.sqlstate)
            else:
                if not wrote:
                    emit("wrote", epoch=epoch)
                    wrote = True
            time.sleep(STEP)


class Campaigner:
    """The parent's handle on one campaigner process: its events, and signals to send it."""

    def __init__(self, mode: str, key: str, ttl: float, name: str, database_url: str) -> None:
        self.name = name
        env = {**os.environ, "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.children.election_child", mode, key, str(ttl), name],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.events.append({"name": self.name, **json.loads(line)})
                self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def of(self, event: str) -> list[dict[str, Any]]:
        """The events of that kind so far."""
        with self._changed:
            return [e for e in self.events if e["event"] == event]

    def expect(self, event: str, count: int = 1, timeout: float = 90.0) -> dict[str, Any]:
        """Wait for the ``count``-th event of that kind; it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(found := [e for e in self.events if e["event"] == event]) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{self.name}: no {event!r} #{count}; stderr:\n{''.join(self.stderr)[-3000:]}")
                self._changed.wait(remaining)
            return found[count - 1]

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def close(self, timeout: float = 30.0) -> int | None:
        """Close stdin (the child stops campaigning and exits); kill it if it does not in time."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


if __name__ == "__main__":
    if sys.argv[1:] == ["command"]:
        run_command()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"{sys.argv[4]} %(levelname)s %(name)s: %(message)s")
    mode, key, ttl, name = sys.argv[1:5]
    {"sync": run_sync, "async": run_async}[mode](key, float(ttl), name)
    emit("exit")
