"""The Quint model's checks: ``python -m devkit.quint_model`` (``make model``, ``make model-check``).

Runs the simulator of ``spec/pg_lease.qnt`` (TypeScript backend: no download, works offline) on
every invariant at once, and its scenarios (the ``run …Test`` definitions); then each mutation: the
model started with one ``MUT_*`` switched on (``initWith``) must break the invariant that mutation
names, in random runs or in the mutation's scenario (a run that drives the model to the state that
matters). The combined check is guarded too: every invariant the model declares must be in its
``invariants`` conjunction and broken by a mutation. The mutations run as generated ``quint test``
runs, a few processes for all of them (each simulator process costs seconds to start). Exit status
0 when the model holds and every mutation is caught, 1 otherwise. The simulator is
``.venvs/quint`` (``make model`` installs it there from ``spec/package.json``, version pinned)
unless ``--quint`` names another.
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
    """One mutation: the model's flag, the invariant it must break, and the scenario (a ``run`` of
    the model taking the mutation) that breaks it deterministically, where random runs are slow to."""

    flag: str
    invariant: str
    what: str
    scenario: str | None = None


MUTATIONS = [
    Mutation("MUT_TAKE_LIVE", "singleHolder", "acquire granted over another owner's live lease"),
    Mutation("MUT_GRANT_NO_BUMP", "epochsRise", "a grant without the epoch rising"),
    Mutation("MUT_RENEW_AFTER_EXPIRY", "renewReleaseLive", "a renewal accepted after expiry", "renewAtExpiry"),
    Mutation("MUT_NO_REMEDY", "noAckedGrantLost", "a failover without advance-epochs"),
    Mutation("MUT_SMALL_ADVANCE", "noAckedGrantLost", "advance-epochs by 1, below the lag", "smallAdvance"),
    Mutation("MUT_WAITER_IGNORES_DEADLINE", "waitersAnswered", "a waiter granted past its deadline"),
    Mutation("MUT_NO_SETTLE_ACQUIRE", "interruptsSettled", "an interrupted acquire's grant kept"),
    Mutation("MUT_ABANDON_RELEASE", "interruptsSettled", "an interrupted release dropped"),
    Mutation("MUT_FENCE_IGNORES_LAPSE", "fencedWrites", "a fenced write accepted after lapse", "lapsedWrite"),
    Mutation("MUT_FENCE_IGNORES_EPOCH", "fencedWrites", "a fenced write with a stale epoch accepted", "staleWrite"),
    Mutation("MUT_SETTLE_FREES_ANY", "renewReleaseLive", "settling frees whatever is held"),
    Mutation("MUT_RENEW_AT_EXPIRY", "renewReleaseLive", "a renewal accepted at the expiry instant", "renewAtExpiry"),
    Mutation("MUT_ADVANCE_BY_LAG", "epochsRise", "advance-epochs by the lag, not lag + 1", "advanceByLag"),
    Mutation("MUT_RELEASE_KEEPS_EPOCH", "transitionsBump", "a release that keeps the epoch"),
    Mutation("MUT_FORCE_KEEPS_EPOCH", "transitionsBump", "a force release that keeps the epoch"),
    Mutation("MUT_RENEW_STALE_EPOCH", "renewReleaseLive", "a renewal with a stale epoch accepted", "staleRenewal"),
    Mutation("MUT_WAITER_NEVER_TIMES_OUT", "waitersAnswered", "a waiter that never times out", "waiterTimesOut"),
]


def declared_invariants(source: str) -> list[str]:
    """The invariants the model declares: each ``val NAME: bool`` after its invariants heading,
    but the conjunction ``invariants`` itself."""
    section = source.split("// ---- invariants", 1)[1].split("// ---- scenarios", 1)[0]
    return [name for name in re.findall(r"^  val (\w+): bool =", section, re.M) if name != "invariants"]


def combined_invariants(source: str) -> set[str]:
    """The names inside the model's ``val invariants: bool = and { … }``."""
    found = re.search(r"val invariants: bool = and \{(.*?)\}", source, re.S)
    if found is None:
        raise ValueError("the model has no `val invariants: bool = and { ... }`")
    return set(re.findall(r"\w+", found.group(1)))


def coverage_problems(source: str, mutations: Sequence[Mutation]) -> list[str]:
    """What leaves the combined check unguarded: an invariant missing from ``invariants`` (the
    random runs would not check it), an invariant no mutation breaks, a mutation of an unknown
    invariant, a flag or a scenario the model does not define."""
    declared = declared_invariants(source)
    combined = combined_invariants(source)
    broken = {mutation.invariant for mutation in mutations}
    problems = [f"invariant {name} is not in the combined `invariants`" for name in declared if name not in combined]
    problems += [f"`invariants` names {name}, not a declared invariant" for name in sorted(combined - set(declared))]
    problems += [f"invariant {name} is broken by no mutation" for name in declared if name not in broken]
    for m in mutations:
        if m.invariant not in declared:
            problems.append(f"mutation {m.flag} names {m.invariant}, not an invariant of the model")
        if f'def {m.flag}: bool = mutation == "{m.flag}"' not in source:
            problems.append(f"mutation {m.flag} is not defined in the model")
        if m.scenario is not None and f"run {m.scenario}(m: str): bool" not in source:
            problems.append(f"mutation {m.flag}: the model has no scenario `run {m.scenario}(m: str)`")
    return problems


def without_in_combined(source: str, name: str) -> str:
    """``source`` with ``name`` dropped from the ``invariants`` conjunction (the coverage check's own test)."""
    found = re.search(r"val invariants: bool = and \{(.*?)\}", source, re.S)
    assert found is not None
    names = ", ".join(n for n in re.findall(r"\w+", found.group(1)) if n != name)
    return source[: found.start(1)] + f" {names} " + source[found.end(1) :]


def coverage_unproven(source: str, mutations: Sequence[Mutation]) -> list[str]:
    """The invariants whose removal from the conjunction `coverage_problems` would not report: the
    check proves it can fail, on the model itself."""
    return [
        name
        for name in declared_invariants(source)
        if not coverage_problems(without_in_combined(source, name), mutations)
    ]


def random_test(mutation: Mutation) -> str:
    return f"{mutation.flag}_randomTest"


def scenario_test(mutation: Mutation) -> str:
    return f"{mutation.flag}_scenarioTest"


def harness(source: str, mutations: Sequence[Mutation], steps: int) -> str:
    """The model with a test run per mutation: random runs of ``steps`` steps from ``initWith``
    the mutation, the invariant it breaks checked after every step; and its scenario, if any."""
    runs = []
    for m in mutations:
        checked = f"{steps}.reps(_ => step.expect({m.invariant}))"
        runs.append(f'  run {random_test(m)} = initWith("{m.flag}").then({checked})')
        if m.scenario is not None:
            runs.append(f'  run {scenario_test(m)} = {m.scenario}("{m.flag}")')
    end = source.rindex("}")
    return source[:end] + "\n".join(runs) + "\n" + source[end:]


@dataclass(frozen=True)
class Outcome:
    """A test run's result: whether it failed on an ``expect`` (an invariant broken), after how
    many runs, or its error otherwise."""

    broken: bool
    runs: int
    error: str


def run_tests(quint: Path, model: Path, names: Sequence[str], samples: int, seed: str | None) -> dict[str, Outcome]:
    """``quint test`` of the runs ``names`` (a randomized one tried up to ``samples`` times)."""
    command = [
        str(quint), "test", str(model), "--main", "pg_lease", "--backend", "typescript",
        "--max-samples", str(samples), "--match", "^(" + "|".join(names) + ")$",
    ]  # fmt: skip
    if seed is not None:
        command += ["--seed", seed]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    outcomes = {}
    for name in names:
        passed = re.search(rf"ok {name} passed (\d+) test", output)
        failed = re.search(rf"\d+\) {name} failed after (\d+) test", output)
        if passed:
            outcomes[name] = Outcome(False, int(passed.group(1)), "")
        elif failed:
            detail = output.split(f") {name}:", 1)[-1][:1500]
            broken = "Expect condition does not hold true" in detail.split("Use --seed", 1)[0]
            outcomes[name] = Outcome(broken, int(failed.group(1)), "" if broken else detail)
        else:
            raise RuntimeError(f"quint test did not report {name} (exit status {done.returncode}):\n{output[-3000:]}")
    return outcomes


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
    parser.add_argument("--mutation-samples", type=int, default=5_000, help="random runs per mutation, at most")
    parser.add_argument(
        "--random-too",
        action="store_true",
        help="random runs also for the mutations a scenario catches (make model; CI runs their scenario only)",
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--seed", help="the simulator's seed (hex), to reproduce a run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulator processes at once")
    parser.add_argument("--quint", type=Path, default=QUINT, help="the quint executable")
    args = parser.parse_args(argv)
    if not args.quint.exists():
        print(f"no simulator at {args.quint}: run `make model` (installs it from spec/package.json)")
        return 1

    source = MODEL.read_text()
    problems = coverage_problems(source, MUTATIONS)
    problems += [f"dropping {name} from `invariants` goes unreported" for name in coverage_unproven(source, MUTATIONS)]
    for problem in problems:
        print(f"combined check: {problem}")
    print(
        f"{len(declared_invariants(source))} invariants, each in the combined check and broken by a mutation: "
        + ("NO" if problems else "yes")
    )
    if problems:
        return 1

    randomly = [m for m in MUTATIONS if args.random_too or m.scenario is None]
    names = [random_test(m) for m in randomly] + [scenario_test(m) for m in MUTATIONS if m.scenario]
    jobs = max(1, args.jobs)
    groups = [names[i::jobs] for i in range(jobs)]
    own = re.findall(r"^  run (\w+Test) =", source, re.M)  # the scenarios, run on the model as specified
    groups[0] = [*own, *groups[0]]
    with tempfile.TemporaryDirectory(prefix="pg_lease_model_") as folder:
        model = Path(folder) / "pg_lease.qnt"
        model.write_text(harness(source, MUTATIONS, args.steps))
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=jobs + 1) as pool:
            plain = pool.submit(simulate, args.quint, MODEL, "invariants", args.samples, args.steps, args.seed)
            tested = [
                pool.submit(run_tests, args.quint, model, group, args.mutation_samples, args.seed) for group in groups
            ]
            violated, output = plain.result()
            outcomes = {name: outcome for future in tested for name, outcome in future.result().items()}
        took = time.monotonic() - started

    failed = violated
    verdict = "VIOLATED" if violated else "no violation"
    print(f"model: {args.samples} runs of {args.steps} steps, every invariant: {verdict}")
    if violated:
        print(output)
    wrong = [name for name in own if outcomes[name].broken or outcomes[name].error]
    for name in wrong:
        print(f"model: scenario {name} FAILED\n{outcomes[name].error}")
    print(f"model: its {len(own)} scenarios: " + ("FAILED" if wrong else "pass"))
    failed |= bool(wrong)
    for m in MUTATIONS:
        random = outcomes.get(random_test(m))
        scenario = outcomes.get(scenario_test(m))
        caught = any(outcome is not None and outcome.broken for outcome in (random, scenario))
        found = (
            [] if random is None else [f"random runs: {'caught' if random.broken else 'not caught'} in {random.runs}"]
        )
        if scenario is not None:
            found.append(f"scenario {m.scenario}: " + ("caught" if scenario.broken else "NOT CAUGHT"))
        report = "; ".join(found)
        print(f"mutation {m.flag} ({m.what}): {m.invariant} {'caught' if caught else 'NOT CAUGHT'} ({report})")
        errors = [outcome.error for outcome in (random, scenario) if outcome is not None and outcome.error]
        for error in errors:  # a run that stopped on something else than a broken invariant
            print(error)
        failed |= not caught or (scenario is not None and not scenario.broken) or bool(errors)
    print(f"({took:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
