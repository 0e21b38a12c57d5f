"""The repository's layers, read from the code (``ast``; no database, nothing imported).

From the bottom: ``pg_lease_django`` (the package users install); ``devkit`` (the servers, clusters,
test app and settings everything below runs on); the tools ``stress``, ``benchmarks`` and ``demo``;
``tests`` on top, which may import any of them (it tests the stress tool's checker and harness and
the demo's chart). A layer imports only layers below it, names included that a layer hands to
Python as a string (``DJANGO_SETTINGS_MODULE``, ``python -m ...``, ``INSTALLED_APPS``).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.parsing import parse

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("stress", "benchmarks", "demo")
#: Each layer and the top-level names it must not import.
FORBIDDEN = {
    "pg_lease_django": {"devkit", "tests", *TOOLS},
    "devkit": {"tests", *TOOLS},
    **{tool: {"tests"} for tool in TOOLS},
}
#: A module path spelled as a string: "tests.settings", "devkit.testapp".
MODULE_PATH = re.compile(r"[a-z_]+(\.[a-z_]+)+")


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each module ``path`` imports or names as a module path in a string."""
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            yield node.lineno, node.value


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    above = FORBIDDEN[layer]
    offences = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted((REPO / layer).rglob("*.py"))
        for line, name in imported(path)
        if name.split(".")[0] in above
    ]
    assert not offences, f"{layer} imports from a layer above it ({', '.join(sorted(above))}):\n" + "\n".join(offences)


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader above finds the three spellings (it would pass vacuously if it found none)."""
    module = tmp_path / "m.py"
    module.write_text(
        'import tests.helpers\nfrom tests import dbserver\nSETTINGS = "tests.settings"\nfrom . import x\n'
    )
    assert [name for _, name in imported(module)] == ["tests.helpers", "tests", "tests.settings"]


def test_the_wheel_ships_the_package_only() -> None:
    """The development kit, the tools and the tests stay in the repository: setuptools is told to
    find ``pg_lease_django`` and its subpackages, nothing else (.ci/wheel-smoke builds and checks it)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["pg_lease_django*"]
