"""Every ```python block of README.md and docs/*.md runs here, against the real test database.

One test per page. A page's blocks run in order in one shared namespace, so a page can build on
its earlier blocks. Every page starts from a fresh namespace holding exactly what a reader's
``python manage.py shell`` holds (Django 5.2+ imports every installed model there, so the
quickstart's ``Invoice`` is the test app's, ``devkit/testapp/models.py``, checked below to be the
class the docs show); nothing else is preloaded. ``loaddata`` finds the docs' ``invoices.json`` in
the test app's ``fixtures/`` directory, where an app keeps its fixtures.

A block that cannot run (a ``settings.py`` excerpt, a model class that needs an app of its own, a
call signature, an endless loop) is skipped only when the nearest non-blank line before it is a
marker comment, with a reason::

    <!-- docs-test: skip (a settings.py excerpt) -->
    <!-- docs-test: needs django.tasks (Django 6.0+) -->   (skipped where the module is missing)

Blocks with a top-level ``await`` / ``async with`` run in an event loop. Line numbers in
tracebacks are the Markdown file's. The run/skip counts of every page are printed at the end of
the module.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.management.commands.shell import Command as ShellCommand
from django.db import models

from devkit.testapp.models import Invoice
from tests.parsing import parse

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
_MARKER_BODY = re.compile(r"^\s*(?:(?P<skip>skip)|needs\s+(?P<module>[\w.]+))\s+\((?P<reason>[^()]*\S[^()]*)\)\s*$")
_PYTHON = {"python", "py"}
_SIGNALS = [signal.SIGTERM, signal.SIGHUP]


@dataclass(frozen=True)
class Block:
    """One fenced ```python block: where its code starts, its dedented source, and its marker."""

    line: int  # 1-based line of the first line of code
    source: str
    skip: bool = False  # <!-- docs-test: skip (reason) -->
    needs_module: str | None = None  # <!-- docs-test: needs module (reason) -->
    reason: str = ""

    def skipped_because(self) -> str | None:
        """Why this block does not run here, or None when it runs."""
        if self.skip:
            return self.reason
        if self.needs_module is not None and not _importable(self.needs_module):
            return f"needs {self.needs_module}: {self.reason}"
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, with their markers.

    Raises:
        ValueError: a malformed marker, a marker that does not sit right before a python block, or
            an unclosed fence.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: tuple[int, re.Match[str]] | None = None  # the last marker seen and its line
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            if pending is not None:
                raise ValueError(f"{_rel(page)}:{pending[0] + 1}: docs-test marker not followed by a python block")
            body = _MARKER_BODY.match(marker["body"])
            if body is None:
                raise ValueError(
                    f"{_rel(page)}:{i + 1}: malformed marker {line.strip()!r}; write "
                    "'<!-- docs-test: skip (reason) -->' or '<!-- docs-test: needs module (reason) -->'"
                )
            pending = (i, body)
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if line.strip() and pending is not None:
                raise ValueError(f"{_rel(page)}:{pending[0] + 1}: docs-test marker not followed by a python block")
            i += 1
            continue
        indent, delimiter = fence["indent"], fence["fence"]
        language = (fence["info"].split() or [""])[0].lower()
        end = i + 1
        while end < len(lines):
            closing = lines[end].strip()
            if closing.startswith(delimiter[0] * len(delimiter)) and not closing.strip(delimiter[0]):
                break
            end += 1
        else:
            raise ValueError(f"{_rel(page)}:{i + 1}: unclosed code fence")
        if language in _PYTHON:
            body_lines = [
                text[len(indent) :] if text.startswith(indent) else text.lstrip() for text in lines[i + 1 : end]
            ]
            source = "\n".join(body_lines) + "\n"
            if pending is None:
                blocks.append(Block(i + 2, source))
            else:
                match = pending[1]
                blocks.append(Block(i + 2, source, bool(match["skip"]), match["module"], match["reason"].strip()))
        elif pending is not None:
            raise ValueError(f"{_rel(page)}:{pending[0] + 1}: docs-test marker before a {language or 'plain'} block")
        pending = None
        i = end + 1
    if pending is not None:
        raise ValueError(f"{_rel(page)}:{pending[0] + 1}: docs-test marker not followed by a python block")
    return blocks


# ---- the reader's namespace ------------------------------------------------------------------


def shell_namespace(page: Path) -> dict[str, Any]:
    """What ``python manage.py shell`` gives a reader: the installed apps' models, nothing else."""
    return {"__name__": "docs_" + re.sub(r"\W", "_", page.stem.lower()), **ShellCommand().get_namespace()}


# ---- the report ------------------------------------------------------------------------------

_report: dict[str, tuple[int, list[tuple[int, str]]]] = {}


@pytest.fixture(scope="module", autouse=True)
def snippet_report(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print, once the module is done, how many blocks ran and were skipped on each page, and why."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not _report:
        return
    with capture.global_and_fixture_disabled():  # past the output capture of the last test's teardown
        reporter.write_line("")
        reporter.write_sep("-", "doc snippets")
        for page, (ran, skipped) in sorted(_report.items()):
            reporter.write_line(f"{page}: {ran} ran, {len(skipped)} skipped")
            for line, reason in skipped:
                reporter.write_line(f"    skipped {page}:{line}: {reason}")


# ---- the tests -------------------------------------------------------------------------------


def _pages_with_python() -> list[Path]:
    return [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_markers_are_well_formed(page: Path) -> None:
    python_blocks(page)  # raises on a malformed or stray marker, or an unclosed fence


def test_readme_and_docs_have_samples() -> None:
    pages = [_rel(page) for page in _pages_with_python()]
    assert "README.md" in pages
    assert len(pages) >= 5, pages


def test_settings_page_lists_every_setting_with_its_default() -> None:
    """docs/settings.md has a table row for each ``PG_LEASE_*`` that conf.py reads, with its default."""
    conf = (REPO / "pg_lease_django" / "conf.py").read_text(encoding="utf-8")
    read = re.findall(r'getattr\(settings, "(PG_LEASE_\w+)", ([^)]+)\)', conf)
    assert read, "conf.py reads no PG_LEASE_* setting?"
    rows = [
        line
        for line in (REPO / "docs" / "settings.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("|")
    ]
    for name, default in read:
        row = next((line for line in rows if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/settings.md has no table row for {name}"
        assert f"`{default.strip()}`" in row, f"docs/settings.md: {name} should show its default `{default.strip()}`"
    documented = set(re.findall(r"^\| `(PG_LEASE_\w+)` \|", "\n".join(rows), flags=re.MULTILINE))
    assert documented == {name for name, _ in read}, "docs/settings.md documents a setting conf.py does not read"


def test_errors_page_covers_every_exception() -> None:
    from pg_lease_django import exceptions

    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    missing = [name for name in exceptions.__all__ if f"`{name}`" not in page]
    assert not missing, f"docs/errors.md does not mention {missing}"


def _run(code: Any, namespace: dict[str, Any]) -> None:
    if code.co_flags & inspect.CO_COROUTINE:  # top-level await / async with
        asyncio.run(eval(code, namespace))
    else:
        exec(code, namespace)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("page", _pages_with_python(), ids=_rel)
def test_page_samples_run(page: Path) -> None:
    namespace = shell_namespace(page)
    ran, skipped = 0, []
    handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}  # exit_on_signals() samples
    try:
        for block in python_blocks(page):
            reason = block.skipped_because()
            if reason is not None:
                skipped.append((block.line, reason))
                continue
            # Pad so that the compiled code's line numbers are the page's.
            source = "\n" * (block.line - 1) + block.source
            code = compile(source, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
            try:
                _run(code, namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{_rel(page)}:{block.line}: the python block raised {type(exc).__name__}: {exc}"
                ) from exc
            ran += 1
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        _report[_rel(page)] = (ran, skipped)
    assert ran > 0 or skipped, f"{_rel(page)}: no python block ran"


def _model_blocks(name: str) -> list[tuple[str, ast.ClassDef]]:
    """Every ``class <name>(...)`` the docs show, with the page and line it is on."""
    found = []
    for page in PAGES:
        for block in python_blocks(page):
            try:
                tree = parse(block.source)
            except SyntaxError:  # a call signature, or a top-level await
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    found.append((f"{_rel(page)}:{block.line + node.lineno - 1}", node))
    return found


def test_the_docs_invoice_is_the_test_apps_invoice() -> None:
    """The docs define ``Invoice`` in skipped blocks and then use it: the class their samples run
    with (the test app's) must be the one they show, field by field, with the same lease key."""
    shown = _model_blocks("Invoice")
    assert len(shown) >= 2, shown  # the quickstart and the fencing page
    own_fields = {field.name: field for field in Invoice._meta.local_fields if field.model is Invoice}
    for where, node in shown:
        declared = {}
        key_expression = None
        for statement in node.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call):
                (target,) = statement.targets
                assert isinstance(target, ast.Name) and isinstance(statement.value.func, ast.Attribute)
                if target.id == "lease_key_expression":
                    key_expression = ast.unparse(statement.value)
                    continue
                keywords = {kw.arg: ast.literal_eval(kw.value) for kw in statement.value.keywords}
                declared[target.id] = (statement.value.func.attr, keywords)
        assert set(declared) == set(own_fields) - {"id", "lease", "lease_epoch"}, where
        for field_name, (field_class, keywords) in declared.items():
            field = own_fields[field_name]
            assert type(field).__name__ == field_class, (where, field_name)
            assert isinstance(field, getattr(models, field_class)), (where, field_name)
            _name, _path, _args, actual = field.deconstruct()
            assert {k: actual.get(k) for k in keywords} == keywords, (where, field_name)
        assert key_expression == "models.F('account')", where  # the key the database derives
        assert Invoice.lease_key_expression == models.F("account")
    assert Invoice(account="acme").get_lease_key() == "acme"
