"""The Quint model's checks: ``python -m devkit.quint_model`` (``make model``, ``make model-check``).

Runs the simulator of ``spec/pg_lease.qnt`` (TypeScript backend: no download, works offline) on
every invariant at once, then each mutation: the model with one ``MUT_*`` value turned on must
make the simulator report the invariant that mutation breaks. Exit status 0 when the model holds
and every mutation is caught, 1 otherwise. The simulator is ``.venvs/quint`` (``make model``
installs it there from ``spec/package.json``, version pinned) unless ``--quint`` names another.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "spec" / "pg_lease.qnt"
QUINT = REPO / ".venvs" / "quint" / "node_modules" / ".bin" / "quint"


@dataclass(frozen=True)
class Mutation:
    """One mutation: the model's flag turned on, and the invariant the simulator must find broken."""

    flag: str
    invariant: str
    what: str


MUTATIONS = [
    Mutation("MUT_TAKE_LIVE", "singleHolder", "acquire granted over another owner's live lease"),
    Mutation("MUT_GRANT_NO_BUMP", "epochsRise", "a grant without the epoch rising"),
    Mutation("MUT_RENEW_AFTER_EXPIRY", "fencedWrites", "a renewal accepted after expiry"),
    Mutation("MUT_NO_REMEDY", "noAckedGrantLost", "a failover without advance-epochs"),
    Mutation("MUT_SMALL_ADVANCE", "noAckedGrantLost", "advance-epochs by 1, below the replication lag"),
    Mutation("MUT_WAITER_IGNORES_DEADLINE", "waiterDeadline", "a waiter granted past its deadline"),
    Mutation("MUT_NO_SETTLE_ACQUIRE", "interruptsSettled", "an interrupted acquire's grant kept"),
    Mutation("MUT_ABANDON_RELEASE", "interruptsSettled", "an interrupted release dropped"),
]


def mutated(source: str, flag: str) -> str:
    """``source`` with ``pure val <flag> = false`` turned on; ValueError when the flag is not there once."""
    pattern = re.compile(rf"(pure val {flag} = )false\b")
    text, count = pattern.subn(r"\1true", source)
    if count != 1:
        raise ValueError(f"{flag}: expected one `pure val {flag} = false` in the model, found {count}")
    return text


def simulate(quint: Path, model: Path, invariant: str, samples: int, steps: int, seed: str | None) -> tuple[bool, str]:
    """Run the simulator; (violation found, its output)."""
    command = [
        str(quint), "run", str(model), "--backend", "typescript", "--invariant", invariant,
        "--max-samples", str(samples), "--max-steps", str(steps),
    ]  # fmt: skip
    if seed is not None:
        command += ["--seed", seed]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    violated = "[violation]" in output
    if done.returncode != 0 and not violated:
        raise RuntimeError(f"quint failed (exit status {done.returncode}):\n{output[-3000:]}")
    return violated, output


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m devkit.quint_model", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="runs of the unmutated model")
    parser.add_argument("--mutation-samples", type=int, default=5_000, help="at most, per mutation")
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--seed", help="the simulator's seed (hex), to reproduce a run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutations checked at once")
    parser.add_argument("--quint", type=Path, default=QUINT, help="the quint executable")
    args = parser.parse_args(argv)
    if not args.quint.exists():
        print(f"no simulator at {args.quint}: run `make model` (installs it from spec/package.json)")
        return 1

    failed = False
    started = time.monotonic()
    violated, output = simulate(args.quint, MODEL, "invariants", args.samples, args.steps, args.seed)
    took = time.monotonic() - started
    print(f"model: {args.samples} runs of {args.steps} steps, every invariant: ", end="")
    print(f"VIOLATED ({took:.1f} s)\n{output}" if violated else f"no violation ({took:.1f} s)")
    failed |= violated

    source = MODEL.read_text()
    with tempfile.TemporaryDirectory(prefix="pg_lease_model_") as folder:

        def check(mutation: Mutation) -> tuple[Mutation, bool, str, float]:
            model = Path(folder) / f"{mutation.flag}.qnt"
            model.write_text(mutated(source, mutation.flag))
            started = time.monotonic()
            violated, output = simulate(
                args.quint, model, mutation.invariant, args.mutation_samples, args.steps, args.seed
            )
            return mutation, violated, output, time.monotonic() - started

        # Each simulator is one node process: as many at once as --jobs (the machine's cores).
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for mutation, violated, output, took in pool.map(check, MUTATIONS):
                verdict = "caught" if violated else "NOT CAUGHT"
                print(f"mutation {mutation.flag} ({mutation.what}): {mutation.invariant} {verdict} ({took:.1f} s)")
                if not violated:
                    failed = True
                    print(output[-2000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
