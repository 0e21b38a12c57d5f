"""The client's instructions per acquire+release pair, counted by callgrind (issue 55).

Process time per call moves by ±10 % between rounds on a loaded machine; the client's instruction
count does not. Each figure runs the Python client under ``valgrind --tool=callgrind`` (the server
outside it) twice, with 100 and 1,100 pairs after the same warm-up, and divides the difference by
1,000: start-up and set-up cancel out. The manager's pair (``Lease.objects.acquire`` and
``release``) is counted for the working tree and for the package at a git ref, beside the
hand-written pair of ``floor.py`` (two UPDATEs through Django's cursor on the same connection).
``--server-side-binding`` runs every figure with ``OPTIONS={"server_side_binding": True}``.
Counts move by about 1 % from run to run (what the server answers, and when). DATABASE_URL, else
the embedded server. Each figure takes a minute or two.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WARM_UP = 50
FEW, MANY = 100, 1100


def child(source: str, variant: str, pairs: int, server_side_binding: bool) -> None:
    """``pairs`` pairs of ``variant`` (``manager`` or ``hand-written``) with the package in ``source``."""
    sys.path.insert(1, str(HERE))
    from common import bench_database, plain_lease_table, setup_django

    sys.path.insert(0, source)
    from floor import FLOOR_ACQUIRE, FLOOR_RELEASE, through_django

    database, _ = bench_database()
    if server_side_binding:
        database["OPTIONS"] = {**database.get("OPTIONS", {}), "server_side_binding": True}
    setup_django(database, ["pg_lease_django"])
    from pg_lease_django import Lease

    assert str(sys.modules["pg_lease_django"].__file__).startswith(source), "not the package asked for"
    key = owner = f"ci:{os.getpid()}"
    plain_lease_table([key])

    def manager() -> None:
        grant = Lease.objects.acquire(key, owner, 30)
        assert grant is not None
        Lease.objects.release(key, owner, grant.epoch)

    def hand_written() -> None:
        epoch = through_django(FLOOR_ACQUIRE, [owner, "30 s", key, owner])[0]
        through_django(FLOOR_RELEASE, [key, owner, epoch])

    pair = manager if variant == "manager" else hand_written
    for _ in range(WARM_UP + pairs):
        pair()


def instructions(source: Path, variant: str, pairs: int, server_side_binding: bool) -> int:
    """The client's instructions for a child of ``pairs`` pairs, whole (start-up included)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [sys.executable, __file__, "--child", str(source), variant, str(pairs)]
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command]
            + (["--server-side-binding"] if server_side_binding else []),
            check=True,
            capture_output=True,
        )
        summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        assert summary is not None, "callgrind wrote no summary"
        return int(summary.group(1))


def per_pair(source: Path, variant: str, server_side_binding: bool) -> int:
    many = instructions(source, variant, MANY, server_side_binding)
    few = instructions(source, variant, FEW, server_side_binding)
    return (many - few) // (MANY - FEW)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], epilog=__doc__)
    parser.add_argument("before", nargs="?", default="HEAD", help="git ref of the package to compare with (HEAD)")
    parser.add_argument("--server-side-binding", action="store_true", help="bind server-side (Django's option)")
    parser.add_argument("--child", nargs=3, metavar=("SOURCE", "VARIANT", "PAIRS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.server_side_binding)
        return
    sys.path.insert(0, str(HERE))
    from client_cost import tree_of
    from common import bench_database, setup_django

    database, where = bench_database()
    setup_django(database, ["pg_lease_django"])
    from django.core.management import call_command

    call_command("migrate", "pg_lease_django", verbosity=0)
    binding = "server-side" if args.server_side_binding else "client-side"
    print(f"database: {where}; {binding} binding; before = {args.before}, after = the working tree")
    with tempfile.TemporaryDirectory() as tmp:
        before = tree_of(args.before, Path(tmp))
        figures = {
            "manager, before": per_pair(before, "manager", args.server_side_binding),
            "manager, after": per_pair(REPO, "manager", args.server_side_binding),
            "hand-written": per_pair(REPO, "hand-written", args.server_side_binding),
        }
    floor = figures["hand-written"]
    print("| client instructions per acquire+release pair | count | ÷ hand-written |")
    print("|---|---:|---:|")
    for name, count in figures.items():
        print(f"| {name} | {count:,} | {count / floor:.3f} |")


if __name__ == "__main__":
    main()
