"""The SQL files of this directory, and the migration operation that runs them.

``schema.sql`` is the current schema, each object written once; ``migrations/`` holds what each
migration after the baseline runs, restating whole objects. A file names its schema
``@extschema@`` (as PostgreSQL's extension scripts do), rendered as the quoted schema the
migration runs in; nothing else varies.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from django.db import migrations, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import ProjectState

from . import run, statements

DIRECTORY = Path(__file__).resolve().parent
#: The current schema: every table, function, trigger and privilege of the lease app.
SCHEMA_FILE = DIRECTORY / "schema.sql"
#: Where a file says "the schema the lease app is installed in".
PLACEHOLDER = "@extschema@"


def read(name: str) -> str:
    """The text of ``name``, a path relative to this directory."""
    return (DIRECTORY / name).read_text(encoding="utf-8")


def digest(name: str) -> str:
    """The SHA-256 of ``name``'s bytes: what a migration pins the file it runs to."""
    return hashlib.sha256((DIRECTORY / name).read_bytes()).hexdigest()


def render(text: str, quoted_schema: str) -> str:
    """``text`` with its placeholder replaced by ``quoted_schema`` (already quoted, e.g. ``"public"``)."""
    return text.replace(PLACEHOLDER, quoted_schema)


def current_schema(connection: BaseDatabaseWrapper) -> str:
    """The quoted schema ``connection`` creates objects in (the first of its search_path that exists)."""
    name = run.one(connection, statements.CURRENT_SCHEMA)
    if name is None:
        raise ValueError(f"database {connection.alias!r} has no current schema: its search_path names none that exists")
    return str(connection.ops.quote_name(name))


class RunSQLFile(migrations.RunSQL):
    """Run a file of this directory forwards and another backwards, rendered for the current schema.

    ``sha256`` pins the forward file and ``reverse_sha256`` the reverse one. A migration runs what it
    was written with, either way, or refuses to run. If it refuses, the file changed after the
    migration was released: restore it, and put the change in a new migration. ``sql`` and
    ``reverse_sql`` hold the files' text with the schema still a placeholder; ``sqlmigrate`` prints it
    rendered.
    """

    def __init__(self, forward: str, reverse: str, *, sha256: str, reverse_sha256: str, **kwargs: Any) -> None:
        self.forward = forward
        self.reverse = reverse
        self.sha256 = sha256
        self.reverse_sha256 = reverse_sha256
        super().__init__(sql=read(forward), reverse_sql=read(reverse), **kwargs)

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            [self.forward, self.reverse],
            {
                "sha256": self.sha256,
                "reverse_sha256": self.reverse_sha256,
                **({"hints": self.hints} if self.hints else {}),
            },
        )

    def describe(self) -> str:
        return f"Run SQL file {self.forward}"

    def database_forwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        if router.allow_migrate(schema_editor.connection.alias, app_label, **self.hints):
            self._run_file(schema_editor, self.forward, self.sha256)

    def database_backwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor, from_state: ProjectState, to_state: ProjectState
    ) -> None:
        if router.allow_migrate(schema_editor.connection.alias, app_label, **self.hints):
            self._run_file(schema_editor, self.reverse, self.reverse_sha256)

    @staticmethod
    def _run_file(schema_editor: BaseDatabaseSchemaEditor, name: str, sha256: str) -> None:
        found = digest(name)
        if found != sha256:
            raise ValueError(
                f"{DIRECTORY / name} is not the file this migration was written with "
                f"(SHA-256 {found}, expected {sha256}): a migration's SQL never changes; "
                "restore the file and write the change as a new migration (docs/architecture.md)"
            )
        # One execute, no parameters: the file's % signs (RAISE formats) stay literal, and the
        # dollar-quoted bodies are never split by Django's statement splitter.
        sql = render(read(name), current_schema(schema_editor.connection))
        schema_editor.execute(sql, params=None)
