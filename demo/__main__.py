"""`make demo`: three worker processes, one lease, a fenced counter, and the failures leases are for.

Act 1: three workers compete; one holds the lease and increments the counter (read, work, fenced
write). Act 2: the holder is frozen (SIGSTOP) mid-work, past its TTL; another takes over with a
higher epoch; the frozen one wakes and its write is rejected by the database. Act 3: the holder is
killed (kill -9); its lease lapses and is taken over. Act 4: an operator force-releases the lease
with `manage.py leases release --force`; the holder is fenced out and the lease moves on. Act 5:
two workers come back on ``hold()``; the operator asks the holder to hand off (`manage.py leases
handoff`); it finishes its unit of work and steps down, and the other takes over at once.

Prints a timeline as it goes, writes two SVG charts (the workers' view, and the lease's history
as the database recorded it, `pg_lease_django.timeline`), and exits non-zero if any invariant it
shows was broken: epochs strictly increase, no grant before the previous holder's expiry (unless
it was released), every accepted write counted exactly once, every stale write rejected, and the
recorded history has every grant the workers saw, ending the way they saw it end.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from demo.chart import Lane, Timeline, render
from demo.worker import KEY, TTL

WORKERS = ["worker-a", "worker-b", "worker-c"]
OUTPUT = Path(__file__).resolve().parent.parent / "demo-output"

Event = dict[str, Any]


class Conductor:
    """Runs the workers, shows their events, keeps the history the invariants are checked on."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.events: queue.Queue[Event] = queue.Queue()
        self.history: list[Event] = []
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.timeline = Timeline({name: Lane(name) for name in WORKERS})
        self.open_hold: dict[str, tuple[float, int]] = {}
        self.last_grant: Event = {}

    def now(self) -> float:
        return time.monotonic() - self.started

    def start(self, name: str, *, hold: bool = False) -> None:
        args = [sys.executable, "-m", "demo.worker", name, *(["--hold"] if hold else [])]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.procs[name] = proc
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            event["t"] = event.pop("mono") - self.started  # CLOCK_MONOTONIC is shared by all processes
            self.events.put(event)

    def say(self, text: str) -> None:
        print(f"\n{text}", flush=True)

    def record(self, event: Event) -> None:
        self.history.append(event)
        name, kind, t = event["worker"], event["event"], event["t"]
        lane = self.timeline.lanes[name]
        if kind == "acquired":
            self.open_hold[name] = (t, event["epoch"])
            self.last_grant = event
        elif kind in ("rejected", "lost", "released", "handed_off", "stopped") and name in self.open_hold:
            self.close_hold(name, t)
        if kind == "write":
            lane.writes.append((t, event["epoch"]))
        elif kind == "rejected":
            lane.rejected.append((t, event["epoch"], event["cause"]))
        if kind in ("renewed",):
            return  # kept in the history, too chatty to print
        detail = {k: v for k, v in event.items() if k in ("epoch", "value", "cause", "pid")}
        print(f"  t={t:5.2f}s  {name:9}  {kind:9}  {detail}", flush=True)

    def close_hold(self, name: str, t: float) -> None:
        start, epoch = self.open_hold.pop(name)
        self.timeline.lanes[name].holds.append((start, t, epoch, t))

    def mark_server_side_ends(self) -> None:
        """Where each grant really ended: its last expiry, or the next grant, whichever came first."""
        grants = [e for e in self.history if e["event"] == "acquired"]
        if not grants:
            return
        first = grants[0]  # maps server time onto the demo's clock (same machine, tiny offset)
        offset = first["t"] - datetime.fromisoformat(first["server_time"]).timestamp()
        ends: dict[int, float] = {}
        for grant, following in zip(grants, [*grants[1:], None], strict=True):
            expiries = [grant["expires_at"]] + [
                e["expires_at"] for e in self.history if e["event"] == "renewed" and e["epoch"] == grant["epoch"]
            ]
            end = datetime.fromisoformat(max(expiries)).timestamp() + offset
            ends[grant["epoch"]] = min(end, following["t"]) if following else end
        for lane in self.timeline.lanes.values():
            lane.holds = [(s, e, epoch, min(e, ends.get(epoch, e))) for s, e, epoch, _ in lane.holds]

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float = 20.0) -> Event:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the demo did not reach its next step in time")
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            self.record(event)
            if predicate(event):
                return event

    def signal(self, name: str, signum: signal.Signals) -> None:
        self.procs[name].send_signal(signum)

    def drain(self) -> None:
        while not self.events.empty():
            self.record(self.events.get())

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        time.sleep(0.1)  # let the pump threads hand over the last lines
        self.drain()
        for name in list(self.open_hold):
            self.close_hold(name, self.now())


def is_(kind: str, worker: str | None = None, not_worker: str | None = None) -> Callable[[Event], bool]:
    return lambda e: (
        e["event"] == kind and e["worker"] in ([worker] if worker else WORKERS) and e["worker"] != not_worker
    )


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py leases ARGS`` in a process of its own, as an operator types it."""
    return subprocess.run(
        [sys.executable, "-m", "django", "leases", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "demo.settings"},
    )


def check_recorded(history: list[Event], recorded: list[tuple[int, str, str]]) -> list[str]:
    """The database's history of this run (epoch, owner, outcome) against what the workers saw."""
    grants = [(e["epoch"], e["worker"]) for e in history if e["event"] == "acquired"]
    if [(epoch, owner) for epoch, owner, _ in recorded] != grants:
        return [f"the recorded tenures {recorded} are not the grants the workers saw {grants}"]
    failures = []
    handed = {e["epoch"] for e in history if e["event"] == "handed_off"}
    for epoch, owner, outcome in recorded:
        if (epoch in handed) != (outcome == "handed_off"):
            failures.append(f"epoch {epoch} ({owner}) was recorded as {outcome}")
    if not {"lapsed", "force_released", "handed_off"} <= {outcome for _, _, outcome in recorded}:
        failures.append(f"the recorded history lacks a lapse, a force release or a hand-off: {recorded}")
    return failures


def check_invariants(history: list[Event], initial: int, final: int) -> list[str]:
    """The promises the demo shows, checked on the full history."""
    failures = []
    grants = sorted((e for e in history if e["event"] == "acquired"), key=lambda e: e["server_time"])
    epochs = [g["epoch"] for g in grants]
    if epochs != sorted(set(epochs)):
        failures.append(f"epochs did not strictly increase: {epochs}")
    # No grant before the previous grant's last known expiry, unless that holder released or was
    # force-released (then the lease was free).
    freed_epochs = {e["epoch"] for e in history if e["event"] in ("released", "handed_off")} | {
        e["epoch"] for e in history if e["event"] in ("lost", "rejected") and e.get("cause") == "not_owner"
    }
    for previous, grant in itertools.pairwise(grants):
        expiry = max(
            [previous["expires_at"]]
            + [e["expires_at"] for e in history if e["event"] == "renewed" and e["epoch"] == previous["epoch"]]
        )
        if grant["server_time"] < expiry and previous["epoch"] not in freed_epochs:
            failures.append(f"epoch {grant['epoch']} granted before epoch {previous['epoch']} expired")
    writes = [e for e in history if e["event"] == "write"]
    if final - initial != len(writes):
        failures.append(f"counter moved by {final - initial}, but {len(writes)} writes were accepted")
    write_epochs = [w["epoch"] for w in writes]
    if write_epochs != sorted(write_epochs):
        failures.append(f"accepted writes went back in epoch: {write_epochs}")
    return failures


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    import django

    django.setup()  # starts the embedded PostgreSQL unless DATABASE_URL is set
    from django.core.management import call_command

    from demo.models import JobCounter
    from pg_lease_django import Lease
    from pg_lease_django.fencing import unfenced_writes
    from pg_lease_django.timeline import draw_timeline, read_history

    call_command("migrate", verbosity=0)
    with unfenced_writes():  # set-up by the demo itself, not by a lease holder
        JobCounter.objects.get_or_create(name="demo")
    initial = JobCounter.objects.get(name="demo").value
    print(f"Database: {os.environ['DATABASE_URL']}")
    print(f"Lease {KEY!r}, TTL {TTL}s, epoch so far {Lease.objects.inspect(KEY).epoch}; counter starts at {initial}")

    c = Conductor()
    try:
        c.say("Act 1. Three workers compete for the lease; the holder increments the counter under it:")
        for name in WORKERS:
            c.start(name)
        first = c.wait_for(is_("acquired"))
        h1 = first["worker"]
        c.wait_for(is_("write", h1))
        c.wait_for(is_("write", h1))

        c.say(f"Act 2. {h1} is frozen (SIGSTOP) in the middle of its work, for longer than its TTL:")
        c.wait_for(is_("read", h1))
        c.signal(h1, signal.SIGSTOP)
        paused_at = c.now()
        second = c.wait_for(is_("acquired", not_worker=h1))
        h2 = second["worker"]
        c.wait_for(is_("write", h2))
        c.wait_for(is_("write", h2))
        c.signal(h1, signal.SIGCONT)
        c.timeline.lanes[h1].paused.append((paused_at, c.now()))
        print(f"  {h1} wakes up after {c.now() - paused_at:.1f}s, still believing it holds epoch {first['epoch']}")
        stale = c.wait_for(is_("rejected", h1))

        c.say(f"Act 3. {h2} is killed (kill -9) while holding the lease; it lapses after its TTL:")
        c.wait_for(is_("write", h2))
        c.signal(h2, signal.SIGKILL)
        c.procs[h2].wait()
        c.timeline.lanes[h2].killed = c.now()
        c.close_hold(h2, c.now())
        third = c.wait_for(is_("acquired", not_worker=h2))
        h3 = third["worker"]
        c.wait_for(is_("write", h3))

        c.say("Act 4. An operator breaks the lease: manage.py leases release --force")
        command_started = c.now()
        done = manage("release", KEY, "--force")
        c.timeline.marks.append((command_started, c.now(), "leases release --force"))
        print("  $ manage.py leases release", KEY, "--force")
        for line in (done.stdout + done.stderr).strip().splitlines():
            print(f"  | {line}")
        c.wait_for(lambda e: e["event"] in ("rejected", "lost") and e["worker"] == h3)
        fourth = c.last_grant
        if fourth["epoch"] <= third["epoch"]:  # nobody has taken over yet
            fourth = c.wait_for(is_("acquired"))
        c.wait_for(is_("write", fourth["worker"]))

        c.say("Every worker is stopped with SIGTERM; the holder releases its own epoch:")
        c.stop_all()

        c.say("Act 5. A deploy: two workers come back on hold(); the operator asks the holder to hand off:")
        for name in WORKERS[:2]:
            c.start(name, hold=True)
        leader = c.wait_for(is_("acquired"))
        c.wait_for(is_("write", leader["worker"]))
        handoff_started = c.now()
        handoff = manage("handoff", KEY)
        c.timeline.marks.append((handoff_started, c.now(), "leases handoff"))
        print("  $ manage.py leases handoff", KEY)
        for line in (handoff.stdout + handoff.stderr).strip().splitlines():
            print(f"  | {line}")
        c.wait_for(is_("handed_off", leader["worker"]))
        # The successor's grant can be read before the leader's report of stepping down (two
        # processes, one queue): take it from what was read already if it came first.
        took_over = is_("acquired", not_worker=leader["worker"])
        taken = [e for e in c.history if took_over(e) and e["epoch"] > leader["epoch"]]
        successor = taken[0] if taken else c.wait_for(took_over)
        c.wait_for(is_("write", successor["worker"]))

        c.say("Finally the last worker is stopped with SIGTERM; it releases its own epoch:")
        c.stop_all()
    finally:
        for proc in c.procs.values():
            if proc.poll() is None:
                proc.kill()

    final = JobCounter.objects.get(name="demo").value
    state = Lease.objects.inspect(KEY)
    c.timeline.end = c.now()
    c.mark_server_side_ends()
    OUTPUT.mkdir(exist_ok=True)
    chart = OUTPUT / "timeline.svg"
    chart.write_text(render(c.timeline, f"pg_lease_django demo — lease {KEY!r}, TTL {TTL}s"))
    # The same run as the database recorded it (PG_LEASE_HISTORY in demo/settings.py): this run's grants.
    grants_seen = sum(1 for e in c.history if e["event"] == "acquired")
    recorded = read_history(KEY, limit=grants_seen)
    history_chart = OUTPUT / "history.svg"
    history_chart.write_text(draw_timeline(recorded))
    c.say(f"The lease's history, as the database recorded it: manage.py leases history {KEY} --limit {grants_seen}")
    shown = io.StringIO()
    call_command("leases", "history", KEY, "--limit", str(grants_seen), stdout=shown, no_color=True)
    for line in shown.getvalue().strip().splitlines():
        print(f"  | {line}")

    failures = check_invariants(c.history, initial, final)
    failures += check_recorded(c.history, [(t.epoch, t.owner, t.outcome) for t in recorded.tenures])
    if state.status != "free":
        failures.append(f"the last holder was stopped with SIGTERM but the lease is {state.status}, not free")
    if done.returncode != 0:
        failures.append(f"the operator's force release failed: {done.stderr.strip()}")
    if handoff.returncode != 0:
        failures.append(f"the operator's hand-off request failed: {handoff.stderr.strip()}")
    if stale["cause"] not in ("not_owner", "lapsed", "epoch_mismatch"):
        failures.append(f"the frozen worker's write was not rejected as a lost lease: {stale}")
    writes = sum(1 for e in c.history if e["event"] == "write")
    rejected = sum(1 for e in c.history if e["event"] == "rejected")
    grants = [f"{e['worker']}@{e['epoch']}" for e in c.history if e["event"] == "acquired"]
    print(f"\nGrants in order: {', '.join(grants)}")
    print(f"Counter: {initial} -> {final}; {writes} fenced writes accepted, {rejected} rejected.")
    print(f"Lease now: {state.status}, epoch {state.epoch}.")
    print(f"Timeline chart: {chart}")
    print(f"History chart:  {history_chart}")
    if failures:
        print("\nINVARIANT BROKEN:\n  " + "\n  ".join(failures))
        return 1
    print(
        "\nInvariants held: epochs strictly increased, no grant before the previous one expired or was freed,"
        "\nevery accepted write counted once, and the frozen worker's stale write was rejected by the database."
    )
    return 0


if __name__ == "__main__":
    started = datetime.now()
    code = main()
    print(f"(finished in {(datetime.now() - started).total_seconds():.1f}s)")
    sys.exit(code)
