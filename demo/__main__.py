"""Run the demo: three worker processes, one lease, a kill -9, a takeover with a higher epoch.

Exits non-zero if an invariant it shows is broken: one holder at a time (in server time), and
every new grant's epoch higher than all earlier ones.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

from demo.worker import KEY, TTL

WORKERS = ["worker-a", "worker-b", "worker-c"]


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    import django

    django.setup()  # starts the embedded PostgreSQL unless DATABASE_URL is set
    from django.core.management import call_command

    from pg_lease_django import Lease

    call_command("migrate", "pg_lease_django", verbosity=0)
    print(f"Database: {os.environ['DATABASE_URL']}")
    print(f"Lease {KEY!r}, TTL {TTL}s, starting at epoch {Lease.objects.inspect(KEY).epoch}\n")

    events: queue.Queue[dict[str, Any]] = queue.Queue()
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[str]] = {}

    def pump(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            event["t"] = time.monotonic() - started
            events.put(event)

    for name in WORKERS:
        proc = subprocess.Popen([sys.executable, "-m", "demo.worker", name], stdout=subprocess.PIPE, text=True)
        procs[name] = proc
        threading.Thread(target=pump, args=(proc,), daemon=True).start()

    grants: list[dict[str, Any]] = []
    failures: list[str] = []

    def show(event: dict[str, Any]) -> None:
        detail = {k: v for k, v in event.items() if k not in ("event", "worker", "t", "server_time")}
        print(f"  t={event['t']:5.2f}s  {event['worker']:9}  {event['event']:9}  {detail}")
        if event["event"] == "acquired":
            if grants and event["epoch"] <= grants[-1]["epoch"]:
                failures.append(f"epoch went from {grants[-1]['epoch']} to {event['epoch']}")
            if grants and datetime.fromisoformat(event["server_time"]) < datetime.fromisoformat(
                grants[-1]["expires_at"]
            ):
                last = grants[-1]
                if last["worker"] != event["worker"] and not last.get("released"):
                    failures.append(f"{event['worker']} acquired before {last['worker']}'s grant expired")
            grants.append(event)
        elif event["event"] == "renewed" and grants and grants[-1]["worker"] == event["worker"]:
            grants[-1]["expires_at"] = event["expires_at"]
        elif event["event"] == "released" and grants and grants[-1]["worker"] == event["worker"]:
            grants[-1]["released"] = True

    def wait_for(predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = events.get(timeout=max(0.01, deadline - time.monotonic()))
            show(event)
            if predicate(event):
                return event

    try:
        print("1. Three workers start and contend for the lease:")
        first = wait_for(lambda e: e["event"] == "acquired", 30)
        wait_for(lambda e: e["event"] == "renewed" and e["worker"] == first["worker"], 10)
        victim = first["worker"]
        print(f"\n2. kill -9 {victim} (pid {procs[victim].pid}) while it holds epoch {first['epoch']}:")
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        print(f"  the lease stays held until its expiry ({grants[-1]['expires_at']}), then lapses")
        print("\n3. Another worker takes over once the lease lapses:")
        second = wait_for(lambda e: e["event"] == "acquired" and e["worker"] != victim, 30)
        if second["epoch"] <= first["epoch"]:
            failures.append("takeover epoch is not higher")
        wait_for(lambda e: e["event"] == "renewed" and e["worker"] == second["worker"], 10)
        print("\n4. Stop the survivors (SIGTERM): the holder releases its own epoch:")
        for name, proc in procs.items():
            if name != victim:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=30)
        while not events.empty():
            show(events.get())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()

    state = Lease.objects.inspect(KEY)
    print(f"\nFinal state: {state.status}, epoch {state.epoch}")
    print("Grants: " + ", ".join(f"{g['worker']}@{g['epoch']}" for g in grants))
    if state.status != "free":
        failures.append(f"lease should be free after the holder released it, is {state.status}")
    if failures:
        print("\nINVARIANT BROKEN:\n  " + "\n  ".join(failures))
        return 1
    print(
        "\nInvariants held: one holder at a time, epochs strictly increasing,"
        " the killed holder superseded by a higher epoch."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
