"""The tests' layout (tests/README.md): each test file in the folder of its kind and cost, the modules
child processes run in tests/children/, shared support at the root of tests/.

Read from the tree and the tests' sources, no server. That a folder's tests carry its tier's markers
is tests/structure/test_tiers.py's check, on the collected suite.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: The folders of test files, cheapest first (tests/README.md says what each holds and costs).
FOLDERS = ("structure", "unit", "db", "chaos", "cluster", "acceptance")

#: The modules child processes run or load (``python -m tests.children.NAME``, their settings, an ASGI app).
CHILDREN = "children"

#: How a test names what a child process runs or loads: ``"-m", "tests.X"``, an app ``"tests.X:factory"``,
#: ``DJANGO_SETTINGS_MODULE`` set to ``"tests.X"``, or a script's path ``REPO / "tests" / ... / "X.py"``.
CHILD_MODULE = re.compile(
    r"""["']-m["'],\s*["'](?P<m>tests\.[\w.]+)["']"""
    r"""|["'](?P<app>tests\.[\w.]+):\w+["']"""
    r"""|DJANGO_SETTINGS_MODULE["']?\s*[:=]\s*["'](?P<settings>tests\.[\w.]+)["']"""
    r"""|["']tests["']((?:\s*/\s*["']\w+["'])+)\s*/\s*["'](?P<script>\w+)\.py["']"""
)

#: The suite's own settings, which every child loads: at the root, where pyproject.toml names them.
ROOT_SETTINGS = "tests.settings"


def _python_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def test_every_test_file_sits_in_a_folder_of_its_kind() -> None:
    outside = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("test_*.py")
        if "__pycache__" not in path.parts and path.parent.relative_to(TESTS).as_posix() not in FOLDERS
    ]
    assert outside == [], f"test files outside tests/{{{','.join(FOLDERS)}}}/ (tests/README.md): {outside}"


def test_each_folder_is_a_package_of_test_modules_only() -> None:
    for name in FOLDERS:
        folder = TESTS / name
        assert (folder / "__init__.py").is_file(), f"tests/{name}/ is no package: its modules import as tests.{name}.*"
        modules = _python_files(folder)
        strays = [
            str(path.relative_to(TESTS))
            for path in modules
            if path.name != "__init__.py" and not path.name.startswith("test_")
        ]
        assert strays == [], f"not test modules, among tests: {strays} (children: tests/{CHILDREN}/; shared: tests/)"
        assert any(path.name.startswith("test_") for path in modules), f"tests/{name}/ holds no test"


def test_children_hold_what_the_tests_run_in_child_processes_and_nothing_else() -> None:
    """Every module a test names as a child's is in tests/children/, and each module there is named so."""
    sources = [path for path in _python_files(TESTS) if path != Path(__file__)]  # its own patterns aside
    named: set[str] = set()
    for path in sources:
        for found in CHILD_MODULE.finditer(path.read_text(encoding="utf-8")):
            if found["script"]:
                folders = re.findall(r"\w+", found.group(4))
                named.add(".".join(["tests", *folders, found["script"]]))
            else:
                named.add(next(group for group in (found["m"], found["app"], found["settings"]) if group))
    children = {_module(path) for path in _python_files(TESTS / CHILDREN) if path.name != "__init__.py"}
    assert not any(name.rsplit(".", 1)[-1].startswith("test_") for name in children), children
    assert named - {ROOT_SETTINGS} - children == set(), "modules child processes run, outside tests/children/"
    assert children - named == set(), "modules in tests/children/ that no test runs in a child process"
    # The scan finds each way of naming a child: a scan that finds nothing would pass the checks above.
    assert ROOT_SETTINGS in named and len(children) >= 10, sorted(named)
