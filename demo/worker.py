"""One demo worker: wait for the lease, hold it with heartbeats, report every event as JSON."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import django

KEY = "demo:nightly-report"
TTL = 2.0


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "worker": NAME, **fields}, default=str), flush=True)


class Stop(Exception):
    pass


def on_sigterm(signum: int, frame: Any) -> None:
    raise Stop


NAME = sys.argv[1] if len(sys.argv) > 1 else f"worker-{os.getpid()}"


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    django.setup()
    from pg_lease_django import Lease, LeaseLostError, LeaseTimeoutError

    signal.signal(signal.SIGTERM, on_sigterm)
    grant = None
    try:
        emit("started", pid=os.getpid())
        while True:
            try:
                grant = Lease.objects.acquire(KEY, NAME, ttl=TTL, blocking=True, timeout=5)
            except LeaseTimeoutError:
                continue
            emit("acquired", epoch=grant.epoch, server_time=grant.server_time, expires_at=grant.expires_at)
            try:
                while True:
                    time.sleep(TTL / 4)  # the "work" between heartbeats
                    expires_at = Lease.objects.renew(KEY, NAME, grant.epoch, ttl=TTL)
                    emit("renewed", epoch=grant.epoch, expires_at=expires_at)
            except LeaseLostError as exc:
                emit("lost", epoch=grant.epoch, cause=exc.code)
                grant = None
    except Stop:
        if grant is not None:
            try:
                Lease.objects.release(KEY, NAME, grant.epoch)
                emit("released", epoch=grant.epoch)
            except LeaseLostError as exc:
                emit("lost", epoch=grant.epoch, cause=exc.code)
        emit("stopped")


if __name__ == "__main__":
    main()
