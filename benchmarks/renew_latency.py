"""Renew latency under load, the measurement behind the recommended minimum TTL (docs/semantics.md).

N processes each hold their own lease and renew it back to back through Lease.objects.renew;
prints p50/p99/max per renewal. DATABASE_URL, else the embedded server.
Usage: python benchmarks/renew_latency.py [processes] [seconds]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")
    import django

    django.setup()


def renewer(index: int, seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    setup_django()
    from pg_lease_django import Lease

    key, owner = f"bench:renew:{index}", f"bench-{index}-{os.getpid()}"
    grant = Lease.objects.acquire(key, owner, ttl=30)
    assert grant is not None
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        Lease.objects.renew(key, owner, grant.epoch, ttl=30)
        samples.append(time.perf_counter() - started)
    Lease.objects.release(key, owner, grant.epoch)
    out.put(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], epilog="DATABASE_URL, else the embedded server."
    )
    parser.add_argument("processes", nargs="?", type=int, default=4, help="processes renewing (4)")
    parser.add_argument("seconds", nargs="?", type=float, default=5.0, help="how long each renews (5.0)")
    args = parser.parse_args()
    processes, seconds = args.processes, args.seconds
    setup_django()  # starts the embedded server if needed; children inherit DATABASE_URL
    from django.core.management import call_command

    call_command("migrate", "pg_lease_django", verbosity=0)
    spawn = multiprocessing.get_context("spawn")  # fresh processes: no inherited database sockets
    out: multiprocessing.Queue = spawn.Queue()  # type: ignore[type-arg]
    workers = [spawn.Process(target=renewer, args=(i, seconds, out)) for i in range(processes)]
    for worker in workers:
        worker.start()
    samples = sorted(s for _ in workers for s in out.get())
    for worker in workers:
        worker.join()
    ms = [s * 1000 for s in samples]
    p99 = ms[int(len(ms) * 0.99)]
    print(f"{processes} processes renewing for {seconds}s: {len(ms)} renewals, {len(ms) / seconds:.0f}/s")
    print(f"renew latency ms: p50 {statistics.median(ms):.2f}  p99 {p99:.2f}  max {ms[-1]:.2f}")


if __name__ == "__main__":
    main()
