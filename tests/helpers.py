"""Helpers shared by test modules (fixtures stay in conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections, transaction


@contextmanager
def refused(error: type[BaseException], match: str | None = None, using: str = "default") -> Iterator[Any]:
    """Expect the database to refuse a write with ``error``, inside a savepoint so the test's own
    transaction carries on (a refused statement leaves its transaction to roll back, as in Django)."""
    with pytest.raises(error, match=match) as info, transaction.atomic(using=using):
        yield info


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap ``fn`` to run in another thread on that thread's own Django connections, closed after."""

    def run() -> Any:
        try:
            return fn()
        finally:
            connections.close_all()

    return run
