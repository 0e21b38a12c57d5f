"""Docstrings a newcomer reads at a glance: sentences, with one aside in parentheses at most.

Each docstring of the package (modules, classes, functions) is read with `ast.get_docstring`. Its
backticked spans are dropped first, since code such as ``acquire(key)`` is not an aside. An aside is
then a ``(`` that follows no word character and no ``]``, so a call such as ``acquire()`` or
``list[int](...)`` does not count. No database: these tests read the code.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pg_lease_django
from tests.parsing import parse

PACKAGE = Path(pg_lease_django.__file__).parent

#: The most asides a docstring may hold.
MOST_ASIDES = 1

#: Backticked spans: code, whatever parentheses it holds. Double backticks first, then single ones.
BACKTICKED = re.compile(r"``.*?``|`[^`]*`", re.DOTALL)

#: An opening parenthesis that starts an aside: not after a word character (a call) or ``]``.
ASIDE = re.compile(r"(?<![\w\]])\(")

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def asides(docstring: str) -> int:
    """How many asides the docstring opens, its backticked spans left out."""
    return len(ASIDE.findall(BACKTICKED.sub("", docstring)))


def docstrings(path: Path) -> Iterator[tuple[int, str, str]]:
    """Each docstring of the file at ``path``: the line of its owner, the owner's name, the text."""
    tree = parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node)
            if text is not None:
                line, name = (1, "<module>") if isinstance(node, ast.Module) else (node.lineno, node.name)
                yield line, name, text


def offenders(root: Path) -> list[str]:
    """``path:line name`` of each docstring under ``root`` with more asides than `MOST_ASIDES`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent).as_posix()
        for line, name, text in docstrings(path):
            if asides(text) > MOST_ASIDES:
                found.append(f"{relative}:{line} {name} ({asides(text)} asides)")
    return found


def test_the_count_skips_calls_and_code_and_counts_asides() -> None:
    assert asides("Calls `acquire()` then release() and list[int](x).") == 0
    assert asides("Takes the key (a string).") == 1
    assert asides("Takes the key (a string) and the owner (ours).") == 2
    assert asides("Code ``f((a), (b))`` is not prose; (this) is.") == 1


def test_the_scan_finds_an_offender(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "mod.py").write_text('"""One (a).\n"""\n\n\ndef f():\n    """Two (a) and (b)."""\n')
    assert offenders(root) == ["pkg/mod.py:5 f (2 asides)"]


def test_every_docstring_holds_one_aside_at_most() -> None:
    found = offenders(PACKAGE)
    assert not found, (
        f"{len(found)} docstrings hold more than {MOST_ASIDES} aside in parentheses; say it in short"
        " sentences instead:\n" + "\n".join(found)
    )
