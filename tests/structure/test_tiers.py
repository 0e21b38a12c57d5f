"""The tiers and CI's legs select what tests/tiers.py says: a test that talks to the server runs in
the pooled leg and on every major of the matrix, unless its module is named out of the leg with a
reason, or it is of a tier that runs once (CI's make test-all on PostgreSQL 15 and the embedded 18).

The suite is collected in a process of its own (``--collect-only``, no server needed), so the check
sees every test whatever this run selected.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression

from tests import tiers

REPO = Path(__file__).resolve().parents[2]


def _make_variable(name: str) -> str:
    """A variable's value as the Makefile assigns it (``NAME ?= ...`` or ``NAME := ...``)."""
    found = re.search(rf"^{name} [?:]= (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile assigns no {name}"
    return found.group(1).strip()


def _selects(expression: str, markers: set[str]) -> bool:
    def matches(name: str, /, **kwargs: str | int | bool | None) -> bool:
        return name in markers

    return Expression.compile(expression).evaluate(matches)


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every test of the suite: its module, its markers and whether it talks to the server."""
    dump = tmp_path_factory.mktemp("tiers") / "collected.jsonl"
    env = {**os.environ, "PG_LEASE_TIERS_DUMP": str(dump)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in dump.read_text(encoding="utf-8").splitlines()]
    assert len(rows) > 1000, len(rows)
    return rows


LEG_EXPRESSIONS = {"pooler": "POOLER_MARKERS", "server_version": "SERVER_VERSION_MARKERS"}


@pytest.mark.parametrize("leg", sorted(tiers.LEGS))
def test_a_test_that_talks_to_the_server_runs_in_the_leg_unless_named_out_or_of_a_tier_run_once(
    collected: list[dict[str, Any]], leg: str
) -> None:
    expression = _make_variable(LEG_EXPRESSIONS[leg])
    modules, named_out = tiers.LEGS[leg]
    fallen_out = [
        row["id"]
        for row in collected
        if row["server"]
        and not _selects(expression, markers := set(row["markers"]))
        and row["module"] not in named_out
        and not (markers & set(tiers.ONCE) and not _selects(expression, markers | {leg}))
    ]
    assert fallen_out == [], (
        f"{len(fallen_out)} tests talk to the server but fall out of CI's {leg} leg (-m {expression!r}):"
        f" name each module in tests/tiers.py, in the leg or out of it with the reason: {fallen_out[:20]}"
    )
    selected = [row for row in collected if _selects(expression, set(row["markers"]))]
    assert selected, f"-m {expression!r} selects nothing: pytest would exit 5"
    # A module named out runs there only the tests that carry the leg's marker themselves.
    assert {row["module"] for row in selected} - set(named_out) == modules - {  # each module named in runs some test
        row["module"] for row in collected if row["module"] in modules and all(
            not _selects(expression, set(other["markers"])) for other in collected if other["module"] == row["module"]
        )
    }  # fmt: skip


def test_each_module_named_exists_and_is_named_once_per_leg() -> None:
    existing = {path.stem for path in (REPO / "tests").glob("*/test_*.py")}
    for leg, (modules, named_out) in tiers.LEGS.items():
        assert modules <= existing, (leg, sorted(modules - existing))
        assert set(named_out) <= existing, (leg, sorted(set(named_out) - existing))
        assert modules.isdisjoint(named_out), (leg, sorted(modules & set(named_out)))


def test_make_test_leaves_out_the_tiers_it_names_and_ci_runs_every_leg() -> None:
    assert _make_variable("MARKERS") == f"not ({' or '.join(tiers.LEFT_OUT)})"
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("make test\n", "make test-all", "make test-pooler"):
        assert command in ci, command
    assert "make test-server-version" in (REPO / ".ci" / "matrix").read_text()


def test_a_module_named_out_of_the_matrix_keeps_its_tests_that_see_the_major(collected: list[dict[str, Any]]) -> None:
    """test_deployment_whole is named out of the matrix for its cost; its tests whose behaviour moves
    between majors carry the marker themselves and run on every major, the others once."""
    expression = _make_variable(LEG_EXPRESSIONS["server_version"])
    rows = [row for row in collected if row["module"] == "test_deployment_whole"]
    on_every_major = {row["id"].split("::")[-1] for row in rows if _selects(expression, set(row["markers"]))}
    assert on_every_major == {
        "test_the_multi_tenant_deployment_of_the_docs_works_from_every_seat_and_refuses_every_attack",
        "test_check_is_silent_from_every_correctly_set_up_seat",
        "test_the_checks_see_the_mistakes_each_with_its_remedy",
    }
    assert len(rows) > len(on_every_major)


#: The folders (tests/README.md) a test of each costly tier may sit in.
FOLDERS_OF_TIER = {
    "acceptance": {"acceptance"},
    "chaos": {"chaos"},
    "soak": {"chaos", "cluster"},
    "cluster": {"cluster"},
    "browser": {"cluster"},
}


def test_a_folder_holds_the_tests_of_its_cost(collected: list[dict[str, Any]]) -> None:
    """A costly tier's tests sit in its folder, and the cheap folders' tests never talk to the server."""
    misplaced = []
    for row in collected:
        folder, markers = row["id"].split("/")[1], set(row["markers"])
        misplaced += [
            (row["id"], tier) for tier, folders in FOLDERS_OF_TIER.items() if tier in markers and folder not in folders
        ]
        if folder in ("structure", "unit") and (row["server"] or markers & set(tiers.ONCE)):
            misplaced.append((row["id"], "talks to the server"))
    assert misplaced == [], f"{len(misplaced)} tests in a folder that is not of their cost: {misplaced[:20]}"
