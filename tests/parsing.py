"""``ast.parse`` for the tests that read the code, safe from a CPython 3.11 bug.

CPython before 3.11.8 and 3.12.1 can raise a spurious ``SystemError: AST constructor recursion
depth mismatch`` (python/cpython#106905): the depth counter of the AST constructor is shared, and
another thread of the process parsing at the same moment (a lazy import rewritten by pytest, say)
moves it. The parse itself was fine; it is done again.
"""

from __future__ import annotations

import ast

#: Parses of one source before the SystemError is taken for a real one.
ATTEMPTS = 3


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, again after the spurious SystemError of cpython#106905."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return ast.parse(source, filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS:
                raise
    raise AssertionError("unreachable")  # pragma: no cover
