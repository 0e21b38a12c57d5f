"""The async executor: a `Statement` on a psycopg async connection of the package's own.

A `Session` is such a connection. The async blocking wait opens one per wait, because a thread
cannot be interrupted while a statement on an async connection is cancelled with its task. It has
the notice handler that the sync executor keeps on Django's connections (``sql.confirmation``): a
lease statement whose commit the synchronous standby did not confirm raises
`UnconfirmedCommitError` here as there. Its statements are rendered for the lease app's schema and
decoded by their own decoders in ``sql.rows``.

Errors are psycopg's, except where the statement's maps in ``sql.errors`` name the package's error
for the server's answer. `Session._execute` alone reads them. The caller maps the rest as Django's
cursor would. The wait does so with a Django connection object of its own, never the caller's,
which another thread may be using.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql as pgsql

from pg_lease_django.exceptions import MissingRowError

from . import Positional, Statement, errors, positional, statements
from .confirmation import UnconfirmedCommitNotices
from .run import Parts, remember_schema

T = TypeVar("T")


class Session:
    """A psycopg async connection of the package's own, with its notice handler and the lease schema."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str | None) -> None:
        self.conn = conn
        self.schema = schema
        self.notices = UnconfirmedCommitNotices(conn)
        self._rendered: dict[str, Positional] = {}

    @classmethod
    async def connect(
        cls, params: dict[str, Any], alias: str, *, schema: str | None, role: str | None, listen: bool
    ) -> Session:
        """Open a session to ``alias``'s database with ``params``, psycopg's connect() arguments.

        ``schema`` is the lease schema, or None to look it up on this connection through
        `sql.run.remember_schema`. ``role`` is a role to ``SET ROLE`` to, Django's ``assume_role``.
        ``listen`` says whether to ``LISTEN`` for releases.
        """
        session = cls(await psycopg.AsyncConnection.connect(**params), schema)
        try:
            if role:
                await session.run(statements.SET_ROLE, parts={"role": pgsql.Identifier(role)})
            if schema is None:  # as the role sees it, after SET ROLE
                session.schema = remember_schema(alias, await session.rows(statements.SCHEMA_LOOKUP))
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

    async def one(self, statement: Statement[T], **params: Any) -> T:
        """Send ``statement`` with ``params``; its one row, decoded (a lease statement's commit confirmed).

        Raises:
            MissingRowError: it answered no row, as `sql.run.one`.
        """
        row = await self._execute(statement, params, None, _fetch_one)
        if row is None:
            raise MissingRowError(f"the statement {statement.name!r} answered no row, where it always answers one")
        return statement.decode(row, **params)

    async def rows(self, statement: Statement[T], **params: Any) -> list[T]:
        """Send ``statement`` with ``params``; every row, decoded."""
        return [statement.decode(row, **params) for row in await self._execute(statement, params, None, _fetch_all)]

    async def run(self, statement: Statement[object], *, parts: Parts = None, **params: Any) -> None:
        """Send ``statement`` with ``params``, which answers nothing worth reading."""
        await self._execute(statement, params, parts, None)

    async def _execute(
        self,
        statement: Statement[object],
        params: dict[str, Any],
        parts: Parts,
        fetch: Callable[[psycopg.AsyncCursor[Any]], Awaitable[Any]] | None,
    ) -> Any:
        """Send ``statement`` and ``fetch`` what it answered.

        This is the one place this executor turns the database's answer into the package's error: a
        SQLSTATE through the statement's error map, a verdict through its verdict map.
        """
        sent = positional(statement.compose(self.schema, **parts).as_string(None)) if parts else self._render(statement)
        arguments = sent.arguments(statement.name, params)
        try:
            if not statement.confirms:
                cursor = await self.conn.execute(sent.text, arguments)
                found = None if fetch is None else await fetch(cursor)
            else:
                with self.notices.confirmed():
                    cursor = await self.conn.execute(sent.text, arguments)
                    found = None if fetch is None else await fetch(cursor)
        except psycopg.Error as exc:
            errors.raise_mapped(exc, statement.errors, params)
            raise
        if statement.verdicts and found is not None:
            for row in found if fetch is _fetch_all else (found,):
                errors.raise_verdict(row, statement.verdicts, params)
        return found

    def _render(self, statement: Statement[object]) -> Positional:
        found = self._rendered.get(statement.name)
        if found is None:
            found = self._rendered[statement.name] = positional(statement.compose(self.schema).as_string(None))
        return found


async def _fetch_one(cursor: psycopg.AsyncCursor[Any]) -> Any:
    return await cursor.fetchone()


async def _fetch_all(cursor: psycopg.AsyncCursor[Any]) -> Any:
    return await cursor.fetchall()
