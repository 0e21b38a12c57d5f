"""The package's SQL files and migrations, as the command reads and writes them.

The migrations are read without importing them (``ast``): each ``NNNN_name.py`` of
``pg_lease_django/migrations``, its dependency and the ``RunSQLFile`` operations it runs (forward
file, reverse file, pinned SHA-256). Replaying their forward files in order gives what the migrations
build; the files a migration runs must still be the ones it pinned.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from devkit.sqlchange.objects import Schema
from devkit.sqlchange.plan import Plan

APP = "pg_lease_django"
#: A migration's name as the command makes it: lower case, digits, underscores.
NAME = re.compile(r"[a-z][a-z0-9_]{0,59}")
_MIGRATION_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.py")


class RepositoryError(ValueError):
    """The migrations are not what the command can build on (a changed file, a branch in the chain)."""


@dataclass(frozen=True)
class Migration:
    """One migration of the app: its name, what it depends on, and the SQL files it runs."""

    name: str
    dependencies: tuple[str, ...]  # names of the app's migrations it depends on
    sql_files: tuple[tuple[str, str, str], ...]  # (forward, reverse, sha256), paths relative to sql/


@dataclass(frozen=True)
class Package:
    """The lease app's directory (a checkout's ``pg_lease_django``, or a copy of it)."""

    root: Path

    @property
    def sql(self) -> Path:
        return self.root / "sql"

    @property
    def schema_file(self) -> Path:
        return self.sql / "schema.sql"

    @property
    def migrations(self) -> Path:
        return self.root / "migrations"

    def chain(self) -> list[Migration]:
        """The app's migrations in order; each must depend on the one before."""
        found = []
        for path in sorted(self.migrations.glob("[0-9][0-9][0-9][0-9]_*.py")):
            if _MIGRATION_FILE.fullmatch(path.name):
                found.append(_read_migration(path))
        for before, after in itertools.pairwise(found):
            if after.dependencies != (before.name,):
                raise RepositoryError(
                    f"{after.name} depends on {', '.join(after.dependencies) or 'nothing'}, not on {before.name}: "
                    "devkit.sqlchange builds on one chain of migrations, each depending on the one before"
                )
        if not found:
            raise RepositoryError(f"no migrations in {self.migrations}")
        return found

    def built_by(self, chain: list[Migration]) -> Schema:
        """What the migrations of ``chain`` build: their forward files replayed, each checked
        against the digest its migration pinned."""
        sources = []
        for migration in chain:
            for forward, _, sha256 in migration.sql_files:
                path = self.sql / forward
                if hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
                    raise RepositoryError(
                        f"{path} is not the file {migration.name} was written with (its SHA-256 differs): "
                        "a migration's SQL never changes; restore it, and put the change in schema.sql"
                    )
                sources.append((f"{path.relative_to(self.root.parent)}", path.read_text(encoding="utf-8")))
        return Schema.of(sources, one_offs=True)

    def stated(self) -> Schema:
        """The objects ``schema.sql`` states."""
        return Schema.of(
            [(f"{self.schema_file.relative_to(self.root.parent)}", self.schema_file.read_text(encoding="utf-8"))],
            one_offs=False,
        )

    def write(self, name: str, chain: list[Migration], plan: Plan, command: str) -> list[Path]:
        """The next migration's delta, reverse and Django migration; the paths written."""
        number = int(chain[-1].name[:4]) + 1
        stem = f"{number:04d}_{name}"
        forward = self.sql / "migrations" / f"{stem}.sql"
        reverse = self.sql / "migrations" / f"{stem}_reverse.sql"
        module = self.migrations / f"{stem}.py"
        for path in (forward, reverse, module):
            if path.exists():
                raise RepositoryError(f"{path} exists already")
        changes = "\n".join(f"-- * {change}" for change in plan.changes)
        forward.write_text(
            f"-- Migration {number:04d}: {name.replace('_', ' ')}.\n--\n"
            f"-- Written by `{command}` from sql/schema.sql, the source:\n"
            "-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).\n"
            f"{changes}\n\n" + "\n\n".join(plan.forward) + "\n",
            encoding="utf-8",
        )
        reverse.write_text(
            f"-- Reverse of migration {number:04d}: each object as {chain[-1].name} left it,\n"
            f"-- what {stem} made dropped.\n\n" + "\n\n".join(plan.reverse) + "\n",
            encoding="utf-8",
        )
        module.write_text(
            _django_migration(stem, chain[-1].name, plan, _sha256(forward), _sha256(reverse)), encoding="utf-8"
        )
        return [forward, reverse, module]


def _django_migration(stem: str, previous: str, plan: Plan, sha256: str, reverse_sha256: str) -> str:
    title = stem[5:].replace("_", " ").capitalize()
    summary = " ".join(
        f"{verb.capitalize()}: {', '.join(change.key for change in plan.changes if change.verb == verb)}."
        for verb in ("new", "changed", "dropped")
        if any(change.verb == verb for change in plan.changes)
    )
    body = textwrap.fill(
        f"{summary} Written from ``sql/schema.sql`` by devkit.sqlchange.", width=100, break_long_words=False
    )
    return f'''"""{title}: ``sql/migrations/{stem}.sql``.

{body}
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("{APP}", "{previous}")]

    operations = [
        RunSQLFile(
            "migrations/{stem}.sql",
            "migrations/{stem}_reverse.sql",
            sha256="{sha256}",
            reverse_sha256="{reverse_sha256}",
        )
    ]
'''


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_migration(path: Path) -> Migration:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    dependencies: tuple[str, ...] = ()
    sql_files: list[tuple[str, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "dependencies" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            dependencies = tuple(name for app, name in value if app == APP)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "RunSQLFile":
            forward, reverse = (ast.literal_eval(arg) for arg in node.args[:2])
            sha256 = next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "sha256")
            sql_files.append((forward, reverse, sha256))
    return Migration(path.stem, dependencies, tuple(sql_files))
