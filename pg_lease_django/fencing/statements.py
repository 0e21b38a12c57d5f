"""How a fenced write presents its fence to PostgreSQL, and how a refusal comes back.

- `PresentFence` / `FencePresented`: the fence inside the write's own statement (a value, a filter);
- `in_one_transaction`: for writes Django spreads over several statements, a first one presents it;
- `refusals_raised`: the database's refusal turned into `NotOwnerError`, `LapsedError`, ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DatabaseError, connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Expression
from django.db.models.sql.compiler import SQLCompiler

from pg_lease_django import sql
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.sql import errors, run, statements

from .resolution import FenceToken


class PresentFence(Expression):
    """``pg_lease_check_fence(key, owner, epoch)``: presents the fence, raises if it does not hold,
    and evaluates to its epoch. Only in a save's statement, which writes one row: a bare call runs
    once, and costs less than a sub-select's InitPlan (``fence_expression`` in ``queries.sql``)."""

    output_field = models.BigIntegerField()
    #: Its SQL (``queries.sql``).
    statement: sql.Statement[None] = statements.FENCE_EXPRESSION

    def __init__(self, token: FenceToken) -> None:
        super().__init__()
        self.token = token

    def resolve_expression(self, *args: Any, **kwargs: Any) -> PresentFence:
        """Itself, where Django's would copy it: it holds no expression to resolve and serves one
        statement, and the copy cost a save more than the rest of the fence's Python."""
        return self

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> tuple[str, tuple[Any, ...]]:
        return run.render(connection, self.statement), (self.token.key, self.token.owner, self.token.epoch)


class FencePresented(PresentFence):
    """WHERE-clause form of `PresentFence` (``... IS NOT NULL``): a one-time filter evaluated before any row is read."""

    conditional = True
    output_field = models.BooleanField()  # type: ignore[assignment]
    statement = statements.FENCE_PRESENTED


def _present(connection: BaseDatabaseWrapper, token: FenceToken | None) -> None:
    """Present ``token`` (or, for None, opt out) in the current transaction: one statement."""
    if token is None:
        run.run(connection, statements.ALLOW_UNFENCED)
    else:
        run.run(connection, statements.PRESENT_FENCE, key=token.key, owner=token.owner, epoch=token.epoch)


@contextmanager
def refusals_raised(action: str) -> Iterator[None]:
    """Turn the database's refusal of a fenced write into `NotOwnerError`, `LapsedError`, ...

    Inside ``atomic()`` a refused statement leaves the transaction to be rolled back, like any
    failed write (wrap the write in its own ``atomic()`` to carry on after a refusal).
    """
    try:
        yield
    except DatabaseError as error:
        refusal = errors.fence_refusal(error, action)
        if refusal is None:
            raise
        metrics.fenced_write_refused(refusal.key, refusal.code)
        raise refusal from error


@contextmanager
def in_one_transaction(using: str, token: FenceToken | None, *, present_first: bool) -> Iterator[None]:
    """A transaction for a write Django may spread over several statements.

    With ``present_first``, its first statement presents ``token`` or opts out, so every later
    statement is covered. An opt-out ends with the block, at the cost of one more statement: the rest
    of an enclosing transaction is fenced again. A presented fence stays for the transaction, as it
    holds the lease row locked.
    """
    connection = connections[using]
    with transaction.atomic(using=using, savepoint=False):
        if present_first:
            _present(connection, token)
        yield
        if present_first and token is None:
            # Always, not only inside an enclosing atomic(): with autocommit off, this block's
            # end commits nothing either, and the transaction goes on.
            run.run(connection, statements.END_UNFENCED)
