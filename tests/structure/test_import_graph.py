"""The package's import graph, read from the source: acyclic, and nothing low imports something high.

Every module of pg_lease_django is parsed with `ast`; an import anywhere in it counts, the lazy ones
inside functions included, and so does ``import_module("pg_lease_django....")``. Excepted: imports
under ``if TYPE_CHECKING:`` (types only, never run) and model-registry lookups
(``apps.get_model``), which import nothing. Importing ``a.b.c`` also runs ``a/__init__`` and
``a/b/__init__``; those edges are not counted (``holds/__init__`` is kept empty for that reason,
see `test_holds_package_module_imports_nothing`). The layers are docs/architecture.md's; a new module gets a place
in `LAYERS` (and a line there). No database: these tests read the code, and the last ones import it in a child process.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import pg_lease_django
from tests.parsing import parse

PACKAGE = Path(pg_lease_django.__file__).parent
ROOT = "pg_lease_django"

#: Cycles known when this test was written, to be removed by the issue named: none.
KNOWN_CYCLES: list[set[str]] = []

#: The rooms, lowest first: a module imports only modules of its own layer or of the layers below
#: (within a layer, the graph being acyclic is the rule). Names are relative to pg_lease_django;
#: an entry covers its submodules (``holds`` is every module of ``holds/``); ``__init__`` is the
#: package's root module, which re-exports the public API and so sits on top.
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"conf", "exceptions", "management.exit_codes", "status", "owners", "signals", "plans"}),
    (
        "input rules, statements, SQL files, the process's metrics",
        {"validation", "sql", "migrations", "sigterm", "metrics"},
    ),
    ("one call", {"operations", "display"}),
    ("the blocking wait", {"wait"}),
    ("the package's own connections", {"holds.lease_connection", "holds.lease_pool", "holds.lease_calls"}),
    ("the manager and the model", {"manager_calls", "managers", "querysets", "models"}),
    ("holding for a job", {"holds"}),
    ("fencing", {"fencing"}),
    ("leader election", {"election"}),
    (
        "operators",
        {
            "admin",
            "provisioning",
            "timeline",
            "management",
            "views",
            "metrics.database_view",
            "seats",
            "patroni",
        },
    ),
    ("set-up and users' tests", {"apps", "checks", "testing", "pytest_plugin", "__init__"}),
]

#: holds/, lowest first: each imports only those before it.
HOLDS_ORDER = [
    "context",
    "lease",
    "lease_connection",
    "lease_pool",
    "lease_calls",
    "scheduler",
    "heartbeat",
    "session",
    "holding",
    "jobs",
]

#: wait/, lowest first: the plan, the settling of interrupted calls, the plan's two drivers.
WAIT_ORDER = ["plan", "settling", "sync_driver", "async_driver"]

#: fencing/, lowest first; the package's ``__init__`` re-exports the public face and not the admin.
FENCING_ORDER = ["resolution", "schema", "statements", "lease_key", "queryset", "model", "__init__", "admin"]

#: election/, lowest first: the plan (no I/O), what its drivers share, the drivers (neither imports the
#: other: `test_the_election_drivers_stand_apart`); the package's ``__init__`` re-exports them.
ELECTION_ORDER = ["plan", "candidate", "threaded", "aio", "__init__"]

#: metrics/, lowest first: the package itself holds the key-label rules every other module reads;
#: the database's view (``database_view``), a layer above the rest, is last.
METRICS_ORDER = ["__init__", "tracing", "instruments", "hooks", "push", "database_view"]

#: management/supervision/ (``leases run``), lowest first; its ``__init__`` imports none of them (a docstring only).
SUPERVISION_ORDER = ["__init__", "child_process", "status_line", "supervisor", "campaign"]

#: admin/, lowest first; the package's ``__init__`` registers the two admins and re-exports them.
ADMIN_ORDER = ["cells", "usage", "writes", "lease", "tenure", "__init__"]

#: What a module of the foundation may import: nothing above it (sql/, status, exceptions, validation).
FOUNDATION = {
    "conf",
    "exceptions",
    "status",
    "validation",
    "sql",
    "sql.files",
    "sql.run",
    "sql.statements",
    "sql.rows",
    "sql.errors",
    "sql.confirmation",
}

#: The package's tools for users' own tests (the test runner, the pytest plugin): they may know of test runs.
TEST_TOOLS = {"testing", "pytest_plugin"}


def _name(path: Path) -> str:
    """``path``'s module name relative to pg_lease_django (``holds.lease``; ``__init__`` for the root)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _absolute(name: str) -> str:
    return ROOT if name == "__init__" else f"{ROOT}.{name}"


def _relative(absolute: str) -> str | None:
    """The package module ``absolute`` names (relative), or None when it is not one of ours."""
    if absolute == ROOT:
        return "__init__"
    if absolute.startswith(f"{ROOT}."):
        name = absolute.removeprefix(f"{ROOT}.")
        return name if name in _modules() else None
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those only type checkers run (``if TYPE_CHECKING:`` bodies)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for other in node.orelse:
                yield other
                yield from _nodes(other)
            continue
        yield node
        yield from _nodes(node)


def _imported(name: str) -> set[str]:
    """The absolute module names module ``name`` imports (``from m import x``: ``m.x`` when a module)."""
    path = _modules()[name]
    package = _absolute(name) if path.name == "__init__.py" else _absolute(name).rpartition(".")[0]
    found: set[str] = set()
    for node in _nodes(parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if _relative(f"{module}.{alias.name}") else module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


@cache
def _graph() -> dict[str, frozenset[str]]:
    """Module → the package modules it imports (relative names), itself left out."""
    graph = {}
    for name in _modules():
        targets = {_relative(module) for module in _imported(name)}
        graph[name] = frozenset(target for target in targets if target is not None and target != name)
    return graph


def _cycles(graph: dict[str, frozenset[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _layer(name: str) -> int | None:
    """The index in `LAYERS` of module ``name``: its own entry, or its nearest package's."""
    parts = name.split(".")
    for size in range(len(parts), 0, -1):
        prefix = ".".join(parts[:size])
        for number, (_, members) in enumerate(LAYERS):
            if prefix in members:
                return number
    return None


def test_the_graph_is_read_from_the_source() -> None:
    """The reader sees what it must: lazy imports, relative ones, and not TYPE_CHECKING's."""
    graph = _graph()
    assert "fencing.resolution" in graph["fencing.statements"]  # from .resolution import ...
    assert "models" in graph["holds.session"]  # lazy, inside HoldSession.start
    assert "fencing" in graph["checks.project"]  # lazy, inside the checks
    assert "migrations.0001_baseline" in graph["checks.database"]  # import_module("...")
    assert "holds.lease" not in graph["holds.context"]  # only under TYPE_CHECKING there


def test_the_import_graph_is_acyclic() -> None:
    cycles = [cycle for cycle in _cycles(_graph()) if cycle not in KNOWN_CYCLES]
    assert not cycles, f"import cycles (lazy imports count): {cycles}"


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in _modules() if _layer(name) is None)
    assert not unplaced, f"place these modules in LAYERS (and in docs/architecture.md's map): {unplaced}"
    stale = sorted(name for _, names in LAYERS for name in names if name not in _modules())
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"


def test_nothing_low_imports_something_high() -> None:
    upward = []
    for name, targets in sorted(_graph().items()):
        layer = _layer(name)
        for target in sorted(targets):
            target_layer = _layer(target)
            if layer is not None and target_layer is not None and target_layer > layer:
                upward.append(f"{name} ({LAYERS[layer][0]}) imports {target} ({LAYERS[target_layer][0]})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    ("package", "order"),
    [
        ("holds", HOLDS_ORDER),
        ("wait", WAIT_ORDER),
        ("fencing", FENCING_ORDER),
        ("election", ELECTION_ORDER),
        ("metrics", METRICS_ORDER),
        ("management.supervision", SUPERVISION_ORDER),
        ("admin", ADMIN_ORDER),
    ],
)
def test_a_subpackage_imports_one_way(package: str, order: list[str]) -> None:
    """holds/: context → lease → lease_pool → scheduler → heartbeat → session → holding → jobs;
    wait/: plan → settling → sync_driver → async_driver; fencing/: resolution → schema → statements →
    lease_key → queryset → model → the package → its admin; election/: plan → candidate → threaded, aio → the package;
    metrics/: the package (the label rules) → tracing → instruments → hooks → push → database_view;
    management/supervision/: child_process → status_line → supervisor → campaign;
    admin/: cells → usage → writes → lease → tenure → the package."""
    members = {name for name in _modules() if name == package or name.startswith(f"{package}.")}
    position = {(package if short == "__init__" else f"{package}.{short}"): n for n, short in enumerate(order)}
    if package in ("holds", "wait"):
        position[package] = -1  # its __init__ imports nothing: below everything it holds
    assert members == set(position), f"list every module of {package}/ in its order"
    backward = [
        f"{name} imports {target}"
        for name in sorted(members)
        for target in sorted(_graph()[name] & members)
        if position[target] >= position[name]
    ]
    assert not backward, backward


@pytest.mark.parametrize("package", ["holds", "wait"])
def test_a_package_module_that_imports_nothing(package: str) -> None:
    """``holds/__init__`` and ``wait/__init__`` import nothing, so that importing ``holds.context``
    or ``wait.plan`` loads no more of the package."""
    assert _graph()[package] == frozenset()


def test_the_election_drivers_stand_apart() -> None:
    """``aelect()``'s driver inherits nothing of ``elect()``'s thread, nor the other way round."""
    assert "election.threaded" not in _graph()["election.aio"]
    assert "election.aio" not in _graph()["election.threaded"]


def test_the_election_plan_does_no_io() -> None:
    """The plan imports nothing that blocks, awaits or reaches the database, not even the settings,
    which it takes as arguments: only the plan protocol."""
    assert _graph()["election.plan"] <= {"plans"}
    outside = {module.partition(".")[0] for module in _imported("election.plan")} - {ROOT}
    assert outside <= {"__future__", "collections", "dataclasses", "enum", "time", "typing"}, outside


def _steps_a_generator_by_hand(path: Path) -> bool:
    """Whether the module catches StopIteration, the end of a generator it sends to or throws into."""
    tree = parse(path.read_text(), str(path))
    return any(isinstance(node, ast.Name) and node.id == "StopIteration" for node in ast.walk(tree))


def test_every_plan_is_run_by_drive_or_adrive() -> None:
    """One plan protocol: only ``plans`` steps a plan by hand, in `drive` and `adrive`; every other
    module hands its plans to them."""
    assert _steps_a_generator_by_hand(_modules()["plans"])  # the scan finds what it looks for
    by_hand = sorted(name for name, path in _modules().items() if name != "plans" and _steps_a_generator_by_hand(path))
    assert not by_hand, f"run these modules' plans with plans.drive or plans.adrive: {by_hand}"


def test_fencing_reads_only_the_context_of_holds() -> None:
    """Resolving a fence needs the holds of this thread, never the machinery that holds leases."""
    reads = {target for name in _graph() if name.startswith("fencing") for target in _graph()[name]}
    assert {target for target in reads if target.startswith("holds")} == {"holds.context"}
    assert _graph()["fencing.resolution"] <= {"exceptions", "validation", "holds.context"}


@pytest.mark.parametrize("name", sorted(FOUNDATION))
def test_the_foundation_imports_nothing_above_it(name: str) -> None:
    """sql/, status, exceptions and validation (and the settings they read) import only each other."""
    assert _graph()[name] <= FOUNDATION - {name}, sorted(_graph()[name] - FOUNDATION)


def test_no_module_imports_the_tests() -> None:
    importing = {
        name: sorted(module for module in _imported(name) if module == "tests" or module.startswith("tests."))
        for name in _modules()
    }
    assert not {name: modules for name, modules in importing.items() if modules}


#: Ways production code could tell a test run: Django's test mail outbox, pytest's variables and modules.
_TEST_RUN_TELLS = {"outbox", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "pytest", "_pytest", "unittest"}


def test_no_module_detects_a_test_run() -> None:
    """Only the tools for users' tests (`TEST_TOOLS`) may know of test runs; the rest behaves the same
    in a test as in production (the test runner and the pytest plugin close lease connections)."""
    detecting = {}
    for name, path in _modules().items():
        if name in TEST_TOOLS:
            continue
        tree = parse(path.read_text(encoding="utf-8"))
        tells = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _TEST_RUN_TELLS:
                tells.add(f"attribute {node.attr}")
            elif isinstance(node, ast.Constant) and node.value in _TEST_RUN_TELLS:
                tells.add(f"string {node.value!r}")
        tells.update(f"import {module}" for module in _imported(name) if module.partition(".")[0] in _TEST_RUN_TELLS)
        if tells:
            detecting[name] = sorted(tells)
    assert not detecting, detecting


#: The most lines a module of the package may have (issue 47): one that grows past it is split by concern.
MAX_LINES = 450

#: Modules known to be longer, each to be split by the issue named: none.
KNOWN_LONG: set[str] = set()


def test_every_module_is_at_most_450_lines() -> None:
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    long = {name: lines for name, lines in sorted(lengths.items()) if lines > MAX_LINES and name not in KNOWN_LONG}
    assert not long, f"split these modules by concern (at most {MAX_LINES} lines): {long}"
    fixed = sorted(name for name in KNOWN_LONG if lengths.get(name, 0) <= MAX_LINES)
    assert not fixed, f"no longer over {MAX_LINES} lines: remove them from KNOWN_LONG: {fixed}"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

#: Folders whose modules the page covers by naming the folder: Django's migrations, one per change of
#: the SQL, which ``make sql-change`` writes (a new one would otherwise need a line before its test passes).
COVERED_BY_FOLDER = {"migrations"}

#: A line of a section's list, and the file it starts with: ``- `lease.py`: HeldLease, ...``.
_MODULE_LINE = re.compile(r"^- (`[\w/.]+`)")


def _module_sections(page: str | None = None) -> list[str]:
    """What each ``###`` section of ``page``'s "The modules" names (docs/architecture.md by default): its
    heading, which may name the section's folder, then the file that starts each line of its list."""
    if page is None:
        page = ARCHITECTURE.read_text(encoding="utf-8")
    section = page.split("\n## The modules\n", 1)[1].split("\n## ", 1)[0]
    named = []
    for part in section.split("\n### ")[1:]:
        heading, *lines = part.splitlines()
        starts = [match.group(1) for line in lines if (match := _MODULE_LINE.match(line))]
        named.append(" ".join([heading, *starts]))
    return named


def _named_in(section: str) -> tuple[set[str], set[str], list[str]]:
    """The modules ``section`` names (relative, dotted), the folders it names, and the ``.py`` files it
    names that are not in the package. A file is named by its path in the last folder named
    (``holds/``: ``context.py``; ``management/``: ``commands/leases.py``), or by its path in the
    package (``sql/files.py``); with no folder named, it is a module of the package's root."""
    modules: set[str] = set()
    folders: set[str] = set()
    stale: list[str] = []
    folder = ""
    for token in re.findall(r"`([\w/.]+)`", section):
        if token.endswith("/"):
            folder = token
            folders.add(token.rstrip("/").replace("/", "."))
            continue
        if not token.endswith(".py"):
            continue
        found = next((c for c in (folder + token, token) if (PACKAGE / c).is_file()), None)
        if found is None:
            stale.append(token)
        else:
            modules.add(_name(PACKAGE / found))
    return modules, folders, stale


def test_every_module_has_a_line_in_the_architecture_map() -> None:
    """docs/architecture.md gives every module of the package a line of its own (a package's
    ``__init__`` aside), and names no file that is not in it: the page cannot fall behind the tree."""
    named: set[str] = set()
    folders: set[str] = set()
    stale: list[str] = []
    for section in _module_sections():
        modules, section_folders, section_stale = _named_in(section)
        named |= modules
        folders |= section_folders
        stale += section_stale
    assert not stale, f"docs/architecture.md's lines of modules name files that are not in pg_lease_django/: {stale}"
    unnamed = sorted(
        name
        for name, path in _modules().items()
        if path.name != "__init__.py"
        and name not in named
        and not (name.partition(".")[0] in COVERED_BY_FOLDER and name.partition(".")[0] in folders)
    )
    assert not unnamed, f"give these modules a line in docs/architecture.md (in their folder's section): {unnamed}"


def test_the_architecture_map_reader_reads_folders_and_root_modules() -> None:
    """The reader above would pass vacuously if it found nothing: it reads these forms."""
    modules, folders, stale = _named_in(
        "`holds/`: `context.py`, `lease.py`; `apps.py`, `sql/files.py`, `gone.py`; `management/`: `commands/leases.py`"
    )
    assert modules == {"holds.context", "holds.lease", "apps", "sql.files", "management.commands.leases"}
    assert folders == {"holds", "management"}
    assert stale == ["gone.py"]
    page = (
        "# A page\n\n## The modules\n\nProse naming `display.py`.\n\n"
        "### `wait/`: the wait\n\nProse naming `plans.py`.\n\n"
        "- `plan.py`: the plan, beside `settling.py`,\n  and `sync_driver.py` on the line's second line.\n"
        "- `gone.py`: stale.\n\n"
        "### The root\n\n- `conf.py`: settings.\n\n"
        "## Next\n\n- `views.py`: not a module line.\n"
    )
    assert _module_sections(page) == ["`wait/`: the wait `plan.py` `gone.py`", "The root `conf.py`"]
    sections = _module_sections()
    assert len(sections) > 10
    assert sum(len(_named_in(section)[0]) for section in sections) > 60


#: What ``import pg_lease_django.patroni`` loads of the package: the statement layer and what it
#: stands on. The hook runs during a failover, before clients get in: the lazy package root
#: (``__init__``, PEP 562) keeps the manager, the models, holds, elections and fencing out of it.
PATRONI_LOADS = {
    "pg_lease_django",
    "pg_lease_django.conf",
    "pg_lease_django.exceptions",
    "pg_lease_django.patroni",
    "pg_lease_django.sql",
    "pg_lease_django.sql.confirmation",
    "pg_lease_django.sql.errors",
    "pg_lease_django.sql.rows",
    "pg_lease_django.sql.run",
    "pg_lease_django.sql.statements",
}
#: Modules of Django that mean the ORM was loaded (models, fields, migrations, the admin).
ORM_MODULES = {"django.db.models", "django.db.migrations", "django.contrib.admin", "django.forms"}


def _loaded_by(module: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``import module`` (no settings, no database)."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_patroni_hook_imports_only_the_statement_layer() -> None:
    loaded = _loaded_by("pg_lease_django.patroni")
    assert {name for name in loaded if name.startswith(ROOT)} == PATRONI_LOADS
    assert not loaded & ORM_MODULES, sorted(loaded & ORM_MODULES)


def test_the_statement_layer_imports_no_orm_and_the_root_nothing() -> None:
    """``pg_lease_django.sql`` (the statements as values) needs no ORM and nothing else of the package;
    the package root alone imports nothing of the package."""
    loaded = _loaded_by("pg_lease_django.sql")
    assert {name for name in loaded if name.startswith(ROOT)} == {ROOT, "pg_lease_django.sql"}
    assert not loaded & ORM_MODULES, sorted(loaded & ORM_MODULES)
    assert {name for name in _loaded_by(ROOT) if name.startswith(ROOT)} == {ROOT}


def test_the_package_root_still_exports_every_name_on_first_use() -> None:
    """``from pg_lease_django import Grant`` imports the name's module then (no settings needed here)."""
    code = (
        "import sys; from pg_lease_django import Grant, LeaseError, Seconds; "
        "print(Grant.__module__, LeaseError.__module__, 'pg_lease_django.holds.holding' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["pg_lease_django.sql.rows", "pg_lease_django.exceptions", "False"]
