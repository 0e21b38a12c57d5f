"""``python -m stress --short`` | ``--long --minutes N``: run the stress harness and check every history.

``python -m stress failover ...``: the same against a primary and a standby whose primary is
SIGKILLed and the standby promoted, again and again (:mod:`stress.failover`).
``python -m stress patroni ...``: against a Patroni cluster (etcd, HAProxy) whose leader keeps
failing (:mod:`stress.patroni`).

The database server is ``--url`` or ``DATABASE_URL`` (else the embedded server, ``devkit.dbserver``);
each run creates its own database there and drops it afterwards. Exit status 1 on any violation,
after printing the seed and the offending slice of history.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from .harness import Config, Result, elapsed, run, short_configs


def _print(result: Result, *, verbose: bool) -> None:
    status = "ok" if result.report.ok else "FAILED"
    counts = result.report.counts
    print(
        f"seed {result.config.seed}: {status}, {counts.get('total', 0)} operations, "
        f"{len(result.audit)} lease changes, {len(result.writes)} fenced writes accepted, "
        f"{result.terminated} backends terminated",
        flush=True,
    )
    if verbose or not result.report.ok:
        print(result.describe(), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print; return the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["failover"]:
        from .failover import main as failover_main

        return failover_main(argv[1:])
    if argv[:1] == ["patroni"]:
        from .patroni import main as patroni_main

        return patroni_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m stress", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--short", action="store_true", help="fixed seeds, about a minute (CI)")
    mode.add_argument("--long", action="store_true", help="random seeds until --minutes have passed")
    parser.add_argument("--minutes", type=float, default=30.0, help="length of a --long run (default 30)")
    parser.add_argument("--seconds-per-run", type=float, default=60.0, help="length of each --long run (default 60)")
    parser.add_argument("--seed", type=int, default=None, help="--long: first seed (default: from the clock)")
    parser.add_argument("--url", default=None, help="PostgreSQL server URL (default: DATABASE_URL)")
    parser.add_argument("--keep-database", action="store_true", help="leave each run's database in place")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every report in full")
    args = parser.parse_args(argv)

    if args.url is None:
        from devkit.dbserver import database_url

        args.url = database_url()
    start = time.monotonic()
    totals: Counter[str] = Counter()
    failed: list[int] = []
    if args.short:
        configs = short_configs(args.url)
    else:
        first = args.seed if args.seed is not None else int(time.time()) % 1_000_000
        configs = []
    seed = first if args.long else 0
    index = 0
    while True:
        if args.short:
            if index == len(configs):
                break
            config = configs[index]
        else:
            if time.monotonic() - start > args.minutes * 60:
                break
            # Alternate the shapes of the short mode: many keys, one hot key with tiny TTLs, chaos.
            shape = index % 3
            config = Config(
                args.url,
                seed=seed + index,
                workers=(6, 4, 6)[shape],
                keys=(3, 1, 2)[shape],
                seconds=args.seconds_per_run,
                ttl_max=(0.5, 0.15, 0.5)[shape],
                long_pause=(0.1, 0.2, 0.1)[shape],
                terminate_every=(None, None, 0.5)[shape],
            )
        config.keep_database = args.keep_database
        result = run(config)
        totals.update(result.report.counts)
        totals["lease_changes"] += len(result.audit)
        totals["fenced_writes_accepted"] += len(result.writes)
        totals["backends_terminated"] += result.terminated
        totals["runs"] += 1
        _print(result, verbose=args.verbose)
        if not result.report.ok:
            failed.append(config.seed)
        index += 1
    print(f"{totals['runs']} runs in {elapsed(start)}; violations in seeds: {failed or 'none'}")
    print("totals: " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items())), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
