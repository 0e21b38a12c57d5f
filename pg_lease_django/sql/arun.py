"""The async executor: a `Statement` on a psycopg async connection of the package's own.

A `Session` is such a connection (the async blocking wait opens one per wait: a thread cannot be
interrupted, a statement on an async connection is cancelled with its task) with the notice handler
the sync executor keeps on Django's connections (``sql.confirmation``): a lease statement whose
commit the synchronous standby did not confirm raises `UnconfirmedCommitError` here as there. Its
statements are rendered for the lease app's schema and decoded by their own decoders (``sql.rows``).
Errors are psycopg's, except where the statement's map (``sql.errors``) names the package's error
for the server's answer: the caller maps the rest as Django's cursor would (the wait maps them with
a Django connection object of its own, never the caller's, which another thread may be using).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql as pgsql

from . import Statement, errors, queries, remember_schema, statements
from .confirmation import UnconfirmedCommitNotices

T = TypeVar("T")


class Session:
    """A psycopg async connection of the package's own, with its notice handler and the lease schema."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str | None) -> None:
        self.conn = conn
        self.schema = schema
        self.notices = UnconfirmedCommitNotices(conn)
        self._rendered: dict[str, str] = {}

    @classmethod
    async def connect(
        cls, params: dict[str, Any], alias: str, *, schema: str | None, role: str | None, listen: bool
    ) -> Session:
        """Open one with ``params`` (psycopg's connect() arguments) to ``alias``'s database; ``schema``:
        the lease schema, None to look it up on this connection (`sql.remember_schema`); ``role``: ``SET
        ROLE`` it (Django's ``assume_role``); ``listen``: ``LISTEN`` for releases."""
        session = cls(await psycopg.AsyncConnection.connect(**params), schema)
        try:
            if role:
                await session.run(statements.SET_ROLE, role=pgsql.Identifier(role))
            if schema is None:  # as the role sees it, after SET ROLE
                found = await (await session.conn.execute(queries()["schema_lookup"])).fetchall()
                session.schema = remember_schema(alias, [row[0] for row in found])
            if listen:
                await session.run(statements.LISTEN)
        except BaseException:
            await session.close()
            raise
        return session

    @property
    def closed(self) -> bool:
        return self.conn.closed

    async def close(self) -> None:
        await self.conn.close()

    async def one(self, statement: Statement[T], params: Sequence[Any] = ()) -> T:
        """Send ``statement``; its one row, decoded (a lease statement's commit confirmed)."""
        try:
            with self.notices.confirmed():
                row = await (await self.conn.execute(self._render(statement), params)).fetchone()
        except psycopg.Error as exc:
            errors.raise_mapped(exc, statement.errors, params)
            raise
        assert row is not None, statement.name
        return statement.decode(row, params)

    async def run(self, statement: Statement[Any], params: Sequence[Any] = (), **parts: pgsql.Composable) -> None:
        """Send ``statement``, which answers nothing worth reading."""
        text = statement.compose(self.schema, **parts).as_string(None) if parts else self._render(statement)
        try:
            await self.conn.execute(text, params)
        except psycopg.Error as exc:
            errors.raise_mapped(exc, statement.errors, params)
            raise

    def _render(self, statement: Statement[Any]) -> str:
        found = self._rendered.get(statement.name)
        if found is None:
            found = self._rendered[statement.name] = statement.compose(self.schema).as_string(None)
        return found
