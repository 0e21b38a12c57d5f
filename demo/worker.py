"""One demo worker: wait for the lease, then read -> work -> fenced write, renewing between units.

``python -m demo.worker NAME --hold`` does the same work inside ``hold()`` (renewed in the
background) and steps down when a hand-off is requested: the shape of a deploy-friendly leader.
Every step is printed as a JSON line for the conductor (``python -m demo``) to collect.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import django

KEY = "demo:nightly-report"
TTL = 1.5  # seconds; renewed after every unit of work
WORK = 0.3  # seconds per unit of work, between reading the counter and writing it back
NAME = sys.argv[1] if len(sys.argv) > 1 else f"worker-{os.getpid()}"
HOLD = "--hold" in sys.argv[2:]


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "worker": NAME, "mono": time.monotonic(), **fields}, default=str), flush=True)


#: Set by SIGTERM; checked between statements, never raised into one (a query cut in half would
#: leave the connection unusable for the release).
stopping = threading.Event()


def on_sigterm(signum: int, frame: Any) -> None:
    stopping.set()


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    django.setup()
    from demo.models import JobCounter
    from pg_lease_django import Grant, Lease, LeaseLostError, LeaseTimeoutError

    signal.signal(signal.SIGTERM, on_sigterm)
    grant: Grant | None = None
    emit("started", pid=os.getpid())
    while not stopping.is_set():
        if grant is None:
            try:  # short waits, so a stop request is noticed within half a second
                grant = Lease.objects.acquire(KEY, NAME, ttl=TTL, blocking=True, timeout=0.5)
            except LeaseTimeoutError:
                continue
            emit("acquired", epoch=grant.epoch, server_time=grant.server_time, expires_at=grant.expires_at)
        counter = JobCounter.objects.get(name="demo")
        emit("read", epoch=grant.epoch, value=counter.value)
        time.sleep(WORK)  # the work; a SIGSTOP here models a GC pause or a frozen VM
        counter.value += 1
        try:
            counter.save(fence=grant)  # lands only while this grant is the live lease
        except LeaseLostError as exc:
            emit("rejected", epoch=grant.epoch, value=counter.value, cause=exc.code)
            grant = None
            continue
        emit("write", epoch=grant.epoch, value=counter.value)
        try:
            expires_at = Lease.objects.renew(KEY, NAME, grant.epoch, ttl=TTL)
            emit("renewed", epoch=grant.epoch, expires_at=expires_at)
        except LeaseLostError as exc:
            emit("lost", epoch=grant.epoch, cause=exc.code)
            grant = None
    if grant is not None:
        try:
            Lease.objects.release(KEY, NAME, grant.epoch)
            emit("released", epoch=grant.epoch)
        except LeaseLostError as exc:
            emit("lost", epoch=grant.epoch, cause=exc.code)
    emit("stopped")


def main_hold() -> None:
    """Hold the lease with ``hold()``; between units of work, step down if a hand-off was requested."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    django.setup()
    from demo.models import JobCounter
    from pg_lease_django import LeaseTimeoutError, hold

    signal.signal(signal.SIGTERM, on_sigterm)
    emit("started", pid=os.getpid())
    while not stopping.is_set():
        try:
            # Renewed four times a TTL: a hand-off request is seen within a quarter of it.
            with hold(KEY, ttl=TTL, owner=NAME, blocking=True, timeout=0.5, renew_every=TTL / 4) as lease:
                server_time = lease.expires_at - lease.ttl  # the grant's own clock reading
                emit("acquired", epoch=lease.epoch, server_time=server_time, expires_at=lease.expires_at)
                while not stopping.is_set() and not lease.wait_stop(timeout=0):
                    counter = JobCounter.objects.get(name="demo")
                    emit("read", epoch=lease.epoch, value=counter.value)
                    time.sleep(WORK)
                    counter.value += 1
                    counter.save()  # fenced by the hold: lands only while it is the live lease
                    emit("write", epoch=lease.epoch, value=counter.value)
                    emit("renewed", epoch=lease.epoch, expires_at=lease.expires_at)  # by hold()'s heartbeat
                handed_off = lease.handoff_requested and not lease.lost
            # Leaving the hold released the lease; a waiting worker takes it over at once.
            emit("handed_off" if handed_off else "released", epoch=lease.epoch)
            if handed_off:
                break  # a deploy replaces this process: it does not compete again
        except LeaseTimeoutError:
            continue
    emit("stopped")


if __name__ == "__main__":
    if HOLD:
        main_hold()
    else:
        main()
