"""How the migrations install SQL functions (a private helper; the migration loader skips ``_`` modules).

Templates name ``{s}``, the quoted schema the migration runs in, and ``{t}``, the quoted lease
table in it: every function pins ``search_path`` to that schema, so a caller's search_path cannot
redirect the table or the helpers.
"""

from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def run_template(template: str, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """Execute ``template`` with ``{s}``/``{t}`` filled in for the current schema."""
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        (schema,) = cursor.fetchone()
    quote = connection.ops.quote_name
    sql = template.format(s=quote(schema), t=f"{quote(schema)}.{quote('pg_lease_django_lease')}")
    schema_editor.execute(sql, params=None)  # no params: the % in RAISE formats is literal


def schema_sql(forward: str, backward: str) -> migrations.RunPython:
    """A migration operation running ``forward`` (and ``backward`` when unapplied) via run_template."""

    def apply(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        run_template(forward, schema_editor)

    def revert(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        run_template(backward, schema_editor)

    return migrations.RunPython(apply, revert)


def replaced_functions(template: str) -> str:
    """The ``CREATE FUNCTION`` statements of an earlier migration's template as ``CREATE OR REPLACE``
    (its triggers, which come last in those templates, left out): how a later migration unapplies."""
    functions = template.split("\nCREATE TRIGGER", 1)[0]
    return functions.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")


def function_definitions(template: str, *names: str) -> str:
    """The ``CREATE FUNCTION {s}.<name>(...)`` statements of ``names`` in an earlier migration's template, in
    order, as ``CREATE OR REPLACE``: how a later migration that redefines only those unapplies."""
    found = []
    for name in names:
        for head in (f"CREATE OR REPLACE FUNCTION {{s}}.{name}(", f"CREATE FUNCTION {{s}}.{name}("):
            start = template.find(head)
            if start >= 0:
                break
        else:
            raise LookupError(f"{name} is not defined in the template")
        end = template.index("END $$;", start) + len("END $$;")
        found.append(template[start:end].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    return "\n\n".join(found) + "\n"
