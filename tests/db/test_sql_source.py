"""The lease app's SQL has one source, ``pg_lease_django/sql/``, and every way to install it agrees.

Each test builds throwaway databases on the test server, in real processes (``manage.py migrate``,
``psql``), and compares what PostgreSQL's catalog holds for the lease app (``tests/catalog.py``):
function definitions, privileges, tables, columns, constraints, indexes, triggers, comments.

- A database migrated by the development chain (0001_initial .. 0010_one_statement, frozen as a
  pg_dump in ``tests/fixtures``) carries on under the baseline: ``migrate`` applies nothing, and its
  catalog is the one a fresh ``migrate`` builds.
- ``schema.sql`` applied by hand with psql, as docs/sql.md says, builds that catalog too; a function
  edited in one place only is caught.
- The app migrated to zero and back rebuilds it; ``sqlmigrate`` prints the SQL.
"""

from __future__ import annotations

import ast
import io
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import SeparateDatabaseAndState
from django.db.migrations.operations.fields import FieldOperation
from django.db.migrations.operations.models import ModelOperation

from pg_lease_django.sql import files
from tests.catalog import differences
from tests.helpers import catalog, manage, migrator, psql, sql
from tests.parsing import parse

REPO = Path(__file__).resolve().parents[2]
MIGRATIONS = REPO / "pg_lease_django" / "migrations"
CHAIN_0010 = Path(__file__).resolve().parents[1] / "fixtures" / "pg_lease_django_0010.sql"

pytestmark = pytest.mark.django_db


def test_a_database_of_the_development_chain_carries_on(new_database: Callable[..., str]) -> None:
    """At 0010, ``migrate`` applies only what came after the baseline, the catalog is a fresh
    database's, and epochs go on growing."""
    fresh, upgraded = new_database(migrated=True), new_database()
    psql(upgraded, CHAIN_0010.read_text())
    sql(upgraded, "SELECT * FROM public.pg_lease_acquire('kept', 'w', '1 minute')")
    sql(upgraded, "SELECT * FROM public.pg_lease_release('kept', 'w', 1)")

    output = manage(upgraded, "migrate", "pg_lease_django", "--noinput")

    assert "0001_baseline" not in output
    later = [name for name in _migration_names() if name != "0001_baseline"]
    assert all(f"Applying pg_lease_django.{name}... OK" in output for name in later), output
    assert differences(catalog(fresh), catalog(upgraded)) == []
    assert ("0001_baseline",) in sql(upgraded, "SELECT name FROM django_migrations WHERE app = 'pg_lease_django'")
    [(granted, epoch)] = sql(upgraded, "SELECT granted, epoch FROM public.pg_lease_acquire('kept', 'w', '1 minute')")
    assert (granted, epoch) == (True, 3)  # 1 granted, 2 released: above both


def test_schema_sql_applied_with_psql_builds_what_the_migrations_build(new_database: Callable[..., str]) -> None:
    """docs/sql.md's by-hand install: ``sed 's/@extschema@/"public"/g' schema.sql | psql``."""
    migrated, by_hand = new_database(migrated=True), new_database()
    rendered = subprocess.run(
        ["sed", 's/@extschema@/"public"/g', str(files.SCHEMA_FILE)], capture_output=True, text=True, check=True
    ).stdout
    psql(by_hand, rendered)

    assert differences(catalog(migrated), catalog(by_hand)) == []
    [(granted, epoch)] = sql(by_hand, "SELECT granted, epoch FROM public.pg_lease_acquire('k', 'w', '1 minute')")
    assert (granted, epoch) == (True, 1)


def test_a_function_changed_in_one_place_only_is_caught(new_database: Callable[..., str]) -> None:
    """A function edited in one source and not the other: the comparison names it, and only it."""
    migrated, edited = new_database(migrated=True), new_database()
    schema = files.render(files.SCHEMA_FILE.read_text(), '"public"')
    rule = "WHEN p_expires_at > p_now THEN 'held'"
    assert schema.count(rule) == 1
    psql(edited, schema.replace(rule, "WHEN p_expires_at >= p_now THEN 'held'"))

    found = differences(catalog(migrated), catalog(edited))

    assert len(found) == 1, found
    assert found[0].startswith("/functions/pg_lease_status(")
    assert "/definition:" in found[0]


def test_the_app_migrated_to_zero_and_back_rebuilds_the_same_catalog(new_database: Callable[..., str]) -> None:
    name = new_database(migrated=True)
    before = catalog(name)
    assert before["functions"] and before["tables"]

    last_epoch = 0
    with migrator(name) as migrate:  # every step in one process
        for earlier in reversed(_migration_names()[:-1]):  # each delta unapplied and applied again
            [(epoch,)] = sql(name, "SELECT epoch FROM public.pg_lease_acquire('kept', 'w', '1 minute')")
            assert epoch > last_epoch
            migrate(earlier, "")  # down to it and up again
            assert differences(before, catalog(name)) == [], earlier
            [(last_epoch,)] = sql(name, "SELECT epoch FROM public.pg_lease_inspect('kept')")
            assert last_epoch == epoch  # the lease table was kept, and its epochs with it
            sql(name, "SELECT * FROM public.pg_lease_release('kept', 'w', %s)", [epoch])
        migrate("zero")
        assert catalog(name) == {"functions": {}, "tables": {}}  # nothing of the lease app is left behind
        migrate("")

    assert differences(before, catalog(name)) == []


def _migration_names() -> list[str]:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    return sorted(name for app, name in loader.disk_migrations if app == "pg_lease_django")


def test_sqlmigrate_prints_the_sql_of_every_migration() -> None:
    names = _migration_names()
    assert names, "no migrations found"
    schema = files.current_schema(connection)
    for name in names:
        forwards, backwards = io.StringIO(), io.StringIO()
        call_command("sqlmigrate", "pg_lease_django", name, stdout=forwards)
        call_command("sqlmigrate", "pg_lease_django", name, backwards=True, stdout=backwards)
        assert files.PLACEHOLDER not in forwards.getvalue() + backwards.getvalue()
        assert f"{schema}." in forwards.getvalue(), name
        assert f"{schema}." in backwards.getvalue(), name
    baseline = io.StringIO()
    call_command("sqlmigrate", "pg_lease_django", "0001_baseline", stdout=baseline)
    assert f"CREATE FUNCTION {schema}.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)" in baseline.getvalue()
    assert f'CREATE TABLE {schema}."pg_lease_django_lease"' in baseline.getvalue()


def _run_sql_files() -> list[tuple[str, files.RunSQLFile]]:
    """Every RunSQLFile operation of the lease app's migrations, with its migration's name."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    found: list[tuple[str, files.RunSQLFile]] = []
    for (app, name), migration in sorted(loader.disk_migrations.items()):
        if app != "pg_lease_django":
            continue
        for operation in migration.operations:
            inner = operation.database_operations if isinstance(operation, SeparateDatabaseAndState) else [operation]
            found.extend((name, op) for op in inner if isinstance(op, files.RunSQLFile))
    return found


def test_each_migration_runs_the_file_it_was_written_with() -> None:
    """A migration's SQL never changes: a change goes in schema.sql and a new migration
    (``make sql-change``; docs/architecture.md, "Changing the SQL")."""
    operations = _run_sql_files()
    assert operations
    for name, operation in operations:
        assert files.digest(operation.forward) == operation.sha256, (
            f"{name} runs {operation.forward}, which changed since the migration was written"
        )
        assert files.digest(operation.reverse) == operation.reverse_sha256, (
            f"{name} runs {operation.reverse} backwards, which changed since the migration was written"
        )
        assert operation.sql == files.read(operation.forward), name  # the SQL, not a file's name


@pytest.mark.parametrize("direction", ["forwards", "backwards"])
def test_a_migration_refuses_a_file_that_changed(direction: str) -> None:
    """Either way: the reverse file is pinned as the forward one is."""
    reverse = "migrations/0001_baseline_reverse.sql"
    pins = {"sha256": files.digest("schema.sql"), "reverse_sha256": files.digest(reverse)}
    pins["sha256" if direction == "forwards" else "reverse_sha256"] = "0" * 64
    operation = files.RunSQLFile("schema.sql", reverse, **pins)
    editor = connection.schema_editor(collect_sql=True)
    with editor, pytest.raises(ValueError, match="never changes"):
        getattr(operation, f"database_{direction}")("pg_lease_django", editor, None, None)
    assert editor.collected_sql == []


def test_no_migration_reads_another_migrations_text() -> None:
    """Migrations import only Django and the RunSQLFile operation; their SQL is in files, and only
    state operations (the models) are written in Python."""
    for path in sorted(MIGRATIONS.glob("[0-9]*.py")):
        tree = parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import"
                assert node.module in {"django.db", "pg_lease_django.sql.files"} or (node.module or "").startswith(
                    "django.db."
                ), f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert all(alias.name.startswith("django.db") for alias in node.names), path.name
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"import_module", "__import__", "open"}, path.name
    loader = MigrationLoader(None, ignore_no_migrations=True)
    for (app, name), migration in loader.disk_migrations.items():
        if app != "pg_lease_django":
            continue
        for operation in migration.operations:
            if isinstance(operation, SeparateDatabaseAndState):
                assert all(isinstance(op, files.RunSQLFile) for op in operation.database_operations), name
                assert all(isinstance(op, ModelOperation | FieldOperation) for op in operation.state_operations), name
            else:
                assert isinstance(operation, files.RunSQLFile), f"{name}: {operation!r}"
