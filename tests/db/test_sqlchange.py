"""``python -m devkit.sqlchange NAME`` (issue 47): a SQL change is one command.

- The splitter is PostgreSQL's own parser (pglast): strings, dollar quotes, quoted identifiers,
  comments and ``BEGIN ATOMIC`` bodies end no statement, and a syntax error names its line.
- On the repository's files, the migrations replayed state what ``schema.sql`` states: nothing to do.
- On a copy of the package in tmp_path (the real files are never touched), an edit of
  ``schema.sql`` becomes the next migration, proved with the real machinery on throwaway databases:
  migrated by the real migrations plus the written one (its digest checked by ``RunSQLFile``), the
  catalog is the one ``schema.sql`` applied by hand builds; migrated back, it is the previous one.
- What a tool must not write (a table's columns, a function's return type or parameter names, a
  trigger's definition) is refused with what to write by hand, and nothing is written.
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.sqlchange import text
from devkit.sqlchange.__main__ import main
from devkit.sqlchange.objects import Schema, SchemaError
from devkit.sqlchange.plan import plan
from devkit.sqlchange.repository import Package
from pg_lease_django.sql import files
from tests.catalog import differences
from tests.helpers import REPO, catalog, manage, psql

#: The repository's last migration, and the number the command gives the next one.
LAST = sorted(path.stem for path in (REPO / "pg_lease_django" / "migrations").glob("[0-9][0-9][0-9][0-9]_*.py"))[-1]
NEXT = f"{int(LAST[:4]) + 1:04d}"


# -- the splitter -------------------------------------------------------------------------------


def test_semicolons_inside_strings_quotes_comments_and_bodies_end_no_statement() -> None:
    script = """
        SELECT 'it''s; one';  SELECT E'a \\' b; c';
        SELECT 1 AS "x;y" /* a /* nested; */ comment; */ ;
        -- a line comment; not a statement
        CREATE FUNCTION f() RETURNS text LANGUAGE plpgsql AS $body$
        BEGIN RETURN $$;$$ || $1; END $body$;
        SELECT a$b$c, $1;
        CREATE FUNCTION g() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT CASE WHEN true THEN 2 END; END;
        SELECT 'last' """
    statements = text.split(script)

    assert [s.text.split()[0] for s in statements] == [
        "SELECT",
        "SELECT",
        "SELECT",
        "CREATE",
        "SELECT",
        "CREATE",
        "SELECT",
    ]
    assert statements[1].text == "SELECT E'a \\' b; c'"
    assert statements[2].text == 'SELECT 1 AS "x;y"'  # the comment after it is not its text
    assert statements[3].text.endswith("END $body$")
    assert statements[5].text.endswith("END; END")
    assert statements[6].text == "SELECT 'last'"


def test_a_statement_keeps_the_comment_lines_right_above_it() -> None:
    script = "-- first\nSELECT 1;  -- trailing, not the next one's\n\n-- banner\n\n"
    script += "-- what g does\n-- in two lines\nSELECT 2;"
    first, second = text.split(script)

    assert (first.comment, first.line) == ("-- first\n", 2)
    assert (second.comment, second.line) == ("-- what g does\n-- in two lines\n", 8)
    assert second.sql() == "-- what g does\n-- in two lines\nSELECT 2;"


@pytest.mark.parametrize(
    ("script", "what"),
    [
        ("SELECT 1;\nSELECT 'open;", "line 2: unterminated quoted string"),
        ("SELECT $x$ open;", "line 1: unterminated dollar-quoted string"),
        ('SELECT "open;', "line 1: unterminated quoted identifier"),
        ("SELECT 1; /* /* */", "line 1: unterminated /* comment"),
        ("SELECT 1;\nCREATE FOO bar;", 'line 2: syntax error at or near "FOO"'),
    ],
)
def test_an_unterminated_quote_or_comment_is_named_with_its_line(script: str, what: str) -> None:
    with pytest.raises(text.SqlSyntaxError, match=re.escape(what)):
        text.split(script)


def test_only_comments_and_layout_lie_between_the_statements_of_the_schema_and_migrations() -> None:
    sql = REPO / "pg_lease_django" / "sql"
    for path in [sql / "schema.sql", *sorted((sql / "migrations").glob("*.sql"))]:
        source = path.read_text()
        statements = text.split(source)
        ends = [0, *(statement.offset + len(statement.text) for statement in statements)]
        starts = [statement.offset for statement in statements] + [len(source)]
        for statement in statements:
            assert source[statement.offset :].startswith(statement.text), (path, statement.line)
        for end, start in zip(ends, starts, strict=True):
            between = [token.text for token in text.tokens(source[end:start]) if token.kind != "comment"]
            assert between in ([], [";"]), (path, source[end:start])


def test_the_normal_form_ignores_layout_comments_and_case_but_not_bodies_or_strings() -> None:
    [a] = text.split('CREATE  TABLE @extschema@."t" (\n  "key" text -- the key\n)')
    [b] = text.split("create table @extschema@.t (key TEXT)")
    [c] = text.split("CREATE FUNCTION f() RETURNS int AS $x$ SELECT  1 $x$")
    [d] = text.split("CREATE FUNCTION f() RETURNS int AS $$ SELECT 1 $$")

    assert text.normal_form(a.tokens) == text.normal_form(b.tokens)
    assert text.normal_form(c.tokens) != text.normal_form(d.tokens)  # a body is stored as written


def test_the_model_knows_signatures_privileges_and_firing() -> None:
    schema = Schema.of(
        [
            (
                "s.sql",
                """
                CREATE TABLE @extschema@."pg_lease_django_t" (k text);
                CREATE FUNCTION @extschema@.f(p_at timestamptz, p_n int DEFAULT 1, OUT o text) RETURNS text
                  LANGUAGE sql AS $$ SELECT 'x' $$;
                REVOKE EXECUTE ON FUNCTION @extschema@.f(timestamp with time zone, integer) FROM PUBLIC;
                GRANT ALL ON FUNCTION @extschema@.f(timestamptz, int4) TO app WITH GRANT OPTION;
                CREATE TRIGGER tr AFTER INSERT ON @extschema@."pg_lease_django_t"
                  FOR EACH ROW EXECUTE FUNCTION @extschema@.f();
                ALTER TABLE @extschema@."pg_lease_django_t" ENABLE ALWAYS TRIGGER tr;
                ALTER TABLE @extschema@."pg_lease_django_t" ADD COLUMN n int, ENABLE ROW LEVEL SECURITY;
                """,
            )
        ],
        one_offs=False,
    )
    function = schema.objects["function f(timestamp with time zone, integer)"]
    table = schema.objects["table pg_lease_django_t"].table

    assert function.privileges == {
        ("EXECUTE", "public"): "revoked",
        ("EXECUTE", "app"): "granted with grant option",
    }
    assert function.signature is not None and function.signature.names == ("p_at", "p_n")
    assert function.signature.defaults == (False, True) and function.signature.outputs == ("o text",)
    assert function.drop == "DROP FUNCTION @extschema@.f(timestamptz, int)"
    assert schema.objects["trigger tr on pg_lease_django_t"].firing == "ENABLE ALWAYS"
    assert table is not None and table.columns == ["k text", "n int"] and table.row_security == (True, False)
    with pytest.raises(SchemaError, match=r"s\.sql, line 1 .*names function g\(\), which does not exist"):
        Schema.of([("s.sql", "DROP FUNCTION g();")], one_offs=False)


def test_a_signature_names_types_as_postgresql_does() -> None:
    """One type spelled two ways is one key; ``"char"`` (one byte) is not ``char`` (``character``); a
    type of several words is not a parameter's name and a type (the hand-written grammar's mistake)."""
    schema = Schema.of(
        [
            (
                "s.sql",
                """
                CREATE FUNCTION @extschema@.f(a pg_catalog.int4, b "char", c char(2) DEFAULT 'x', d text = f(1, 2),
                  interval day to second, integer ARRAY)
                RETURNS TABLE (n int8) LANGUAGE sql AS $$ SELECT 1::bigint $$;
                REVOKE EXECUTE ON FUNCTION @extschema@.f(integer, "char", character, text, interval, int[]) FROM PUBLIC;
                """,
            )
        ],
        one_offs=False,
    )
    [function] = schema.objects.values()

    assert function.key == 'function f(integer, "char", character, text, interval, integer[])'
    assert function.drop == (
        'DROP FUNCTION @extschema@.f(pg_catalog.int4, "char", char(2), text, interval day to second, integer ARRAY)'
    )
    assert function.signature is not None and function.signature.defaults == (False, False, True, True, False, False)
    assert function.signature.outputs == ("n bigint",) and function.privileges == {("EXECUTE", "public"): "revoked"}


# -- the command on the repository --------------------------------------------------------------


def test_the_migrations_replayed_state_what_schema_sql_states() -> None:
    """On the repository as it is, the command finds nothing to do (and writes nothing)."""
    package = Package(REPO / "pg_lease_django")
    result = plan(package.built_by(package.chain()), package.stated())
    assert (result.changes, result.refusals) == ([], []), (
        "sql/schema.sql states what no migration makes: `make sql-change NAME=...` writes the migration "
        '(docs/architecture.md, "Changing the SQL")'
    )

    output = io.StringIO()
    assert main(["anything", "--package", str(package.root)], stdout=output) == 0
    assert output.getvalue() == f"Nothing to do: sql/schema.sql states what migrations 0001-{LAST[:4]} build.\n"


# -- the command on a copy ----------------------------------------------------------------------


@pytest.fixture
def package(tmp_path: Path) -> Package:
    """A copy of the package, in tmp_path/pg_lease_django: the command and the migrations run on it."""
    root = tmp_path / "pg_lease_django"
    shutil.copytree(REPO / "pg_lease_django", root, ignore=shutil.ignore_patterns("__pycache__"))
    return Package(root)


def edit(package: Package, *replacements: tuple[str, str]) -> str:
    """``schema.sql`` of ``package`` with each (old, new) replaced (old found exactly once); its text."""
    schema = package.schema_file.read_text()
    for old, new in replacements:
        assert schema.count(old) == 1, old
        schema = schema.replace(old, new)
    package.schema_file.write_text(schema)
    return schema


def run(package: Package, *args: str) -> tuple[int, str]:
    output = io.StringIO()
    status = main([*args, "--package", str(package.root)], stdout=output)
    return status, output.getvalue()


def written(package: Package) -> set[str]:
    return {path.name for path in [*package.sql.rglob("*.sql"), *package.migrations.glob("*.py")]}


# The docs' example (docs/architecture.md, "Changing the SQL"): renewals refuse a TTL over one hour.
HEARTBEAT_TTL_LIMIT = (
    "  END IF;\n  LOOP  -- again only if the row turned valid",
    "  END IF;\n"
    "  IF p_ttl > interval '1 hour' THEN\n"
    "    RAISE EXCEPTION 'invalid_input: a renewal may not exceed one hour' USING ERRCODE = '22023';\n"
    "  END IF;\n  LOOP  -- again only if the row turned valid",
)


def test_a_second_run_finds_nothing_to_do(package: Package) -> None:
    edit(package, HEARTBEAT_TTL_LIMIT)
    before = written(package)

    status, output = run(package, "heartbeat_ttl_limit")

    assert status == 0, output
    assert written(package) - before == {
        f"{NEXT}_heartbeat_ttl_limit.sql",
        f"{NEXT}_heartbeat_ttl_limit_reverse.sql",
        f"{NEXT}_heartbeat_ttl_limit.py",
    }
    assert "changed function pg_lease_heartbeat(text, text, bigint, interval) (definition)" in output
    assert run(package, "again") == (0, f"Nothing to do: sql/schema.sql states what migrations 0001-{NEXT} build.\n")
    assert written(package) - before == {name for name in written(package) if name.startswith(NEXT)}


def test_comments_between_statements_change_nothing_but_a_comment_in_a_body_does(package: Package) -> None:
    edit(
        package,
        ("-- Changing this file: docs/architecture.md", "-- Changing this file (read it first): docs/architecture.md"),
    )
    assert run(package, "nothing")[0] == 0
    assert written(package) == written(Package(REPO / "pg_lease_django"))

    edit(package, ("    -- A registration is in flight:", "    -- A registration is in flight (not committed):"))
    status, output = run(package, "comment_in_a_body")

    assert status == 0 and "changed function pg_lease_wake_waiters(text) (definition)" in output


def test_a_migrations_file_changed_since_it_was_written_is_named(package: Package) -> None:
    forward = package.sql / "migrations" / f"{LAST}.sql"
    forward.write_text(forward.read_text() + "\n")

    status, output = run(package, "anything")

    assert status == 1
    assert f"{forward} is not the file {LAST} was written with" in output


def test_the_written_files_pass_the_linters(package: Package) -> None:
    pytest.importorskip("ruff")
    edit(package, HEARTBEAT_TTL_LIMIT)
    assert run(package, "heartbeat_ttl_limit")[0] == 0
    module = package.migrations / f"{NEXT}_heartbeat_ttl_limit.py"
    config = ["--config", str(REPO / "pyproject.toml")]
    for check in (["check", *config, str(module)], ["format", "--check", *config, str(module)]):
        done = subprocess.run([sys.executable, "-m", "ruff", *check], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_command_line(package: Package) -> None:
    edit(package, HEARTBEAT_TTL_LIMIT)
    command = [sys.executable, "-m", "devkit.sqlchange", "--package", str(package.root)]

    bad = subprocess.run([*command, "Bad-Name"], cwd=REPO, capture_output=True, text=True, timeout=60)
    dry = subprocess.run([*command, "--dry-run", "ttl"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert not (package.migrations / f"{NEXT}_ttl.py").exists()
    done = subprocess.run([*command, "ttl"], cwd=REPO, capture_output=True, text=True, timeout=60)

    assert bad.returncode == 2 and "lower case letters" in bad.stderr
    assert dry.returncode == 0 and "-- the delta\n" in dry.stdout and "-- the reverse\n" in dry.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    made = [package.sql / "migrations" / f"{NEXT}_ttl.sql", package.sql / "migrations" / f"{NEXT}_ttl_reverse.sql"]
    assert "Wrote:\n" + "".join(f"  {path}\n" for path in [*made, package.migrations / f"{NEXT}_ttl.py"]) in done.stdout


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            ("CHECK (max_tenures_per_key > 0)\n", "CHECK (max_tenures_per_key > 0),\n  max_waiters integer NULL\n"),
            [
                "table pg_lease_django_role_limit: its columns, constraints or options changed "
                "(+ max_waiters integer null)",
                'ALTER TABLE @extschema@."pg_lease_django_role_limit" ADD COLUMN',
                "SeparateDatabaseAndState",
            ],
            id="a new table column",
        ),
        pytest.param(
            (
                "CREATE FUNCTION @extschema@.pg_lease_waiter_lock(p_key text)\nRETURNS bigint",
                "CREATE FUNCTION @extschema@.pg_lease_waiter_lock(p_key text)\nRETURNS numeric",
            ),
            [
                "function pg_lease_waiter_lock(text): its return type changed (bigint -> numeric)",
                "DROP FUNCTION @extschema@.pg_lease_waiter_lock(text);",
                "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_waiter_lock(text) FROM PUBLIC;",
            ],
            id="a function's return type",
        ),
        pytest.param(
            ("pg_lease_waiter_lock(p_key text)\n", "pg_lease_waiter_lock(p_name text)\n"),
            ["function pg_lease_waiter_lock(text): a parameter was renamed (p_key -> p_name)"],
            id="a parameter's name",
        ),
        pytest.param(
            (
                "FOR EACH ROW WHEN (OLD.expires_at <= clock_timestamp())",
                "FOR EACH ROW WHEN (OLD.expires_at < clock_timestamp())",
            ),
            [
                "trigger pg_lease_judge_renewal on pg_lease_django_lease: its definition changed",
                'DROP TRIGGER pg_lease_judge_renewal ON @extschema@."pg_lease_django_lease"',
                'ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_judge_renewal',
            ],
            id="a trigger's definition",
        ),
    ],
)
def test_a_change_a_tool_must_not_write_is_refused_with_what_to_write(
    package: Package, change: tuple[str, str], expected: list[str]
) -> None:
    edit(package, change, HEARTBEAT_TTL_LIMIT)  # and a change the tool could write: nothing is written
    before = written(package)

    status, output = run(package, "refused")

    assert status == 1
    assert "Nothing written." in output
    for part in expected:
        assert part in output
    assert written(package) == before


# -- proved on databases ------------------------------------------------------------------------

NOTE_TABLE = """

-- Notes operators leave on a key (a table of its own, with a row, row-level security, a policy,
-- an index, a trigger firing ALWAYS and a comment).
CREATE TABLE @extschema@."pg_lease_django_note" (
  key text CONSTRAINT pg_lease_django_note_pkey PRIMARY KEY,
  note text NOT NULL
);
REVOKE ALL ON @extschema@."pg_lease_django_note" FROM PUBLIC;
INSERT INTO @extschema@."pg_lease_django_note" (key, note) VALUES ('', 'every key');
COMMENT ON TABLE @extschema@."pg_lease_django_note" IS 'Notes operators leave on a key.';
ALTER TABLE @extschema@."pg_lease_django_note" ENABLE ROW LEVEL SECURITY;
CREATE POLICY pg_lease_read ON @extschema@."pg_lease_django_note" FOR SELECT USING (true);
CREATE INDEX "pg_lease_note_text" ON @extschema@."pg_lease_django_note" (note);

CREATE FUNCTION @extschema@.pg_lease_note_changed()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_note_changed() FROM PUBLIC;

CREATE TRIGGER pg_lease_note_changed AFTER INSERT ON @extschema@."pg_lease_django_note"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_note_changed();
ALTER TABLE @extschema@."pg_lease_django_note" ENABLE ALWAYS TRIGGER pg_lease_note_changed;
COMMENT ON FUNCTION @extschema@.pg_lease_status(text, timestamptz, timestamptz) IS 'The one rule.';
"""

SCENARIOS: dict[str, tuple[list[tuple[str, str]], str, list[str], list[str]]] = {
    # name: (edits of schema.sql, what is appended to it, in the delta, in the reverse)
    "a function's body": (
        [HEARTBEAT_TTL_LIMIT],
        "",
        [
            "CREATE OR REPLACE FUNCTION @extschema@.pg_lease_heartbeat(p_key text,",
            "a renewal may not exceed one hour",
            "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) FROM PUBLIC;",
        ],
        ["CREATE OR REPLACE FUNCTION @extschema@.pg_lease_heartbeat(p_key text,"],
    ),
    "a new function with its REVOKE": (
        [
            (
                "CREATE FUNCTION @extschema@.pg_lease_check_epoch(",
                "-- The longest TTL, for tools that ask.\n"
                "CREATE FUNCTION @extschema@.pg_lease_max_ttl()\nRETURNS interval LANGUAGE sql IMMUTABLE\n"
                "SET search_path = pg_catalog, pg_temp\nAS $$ SELECT interval '365 days' $$;\n\n"
                "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_max_ttl() FROM PUBLIC;\n\n"
                "CREATE FUNCTION @extschema@.pg_lease_check_epoch(",
            ),
            (
                "    ('operator', 'TABLE', '@extschema@.\"pg_lease_django_lease\"', 'SELECT'),\n",
                "    ('operator', 'TABLE', '@extschema@.\"pg_lease_django_lease\"', 'SELECT'),\n"
                "    ('operator', 'FUNCTION', '@extschema@.pg_lease_max_ttl()', 'EXECUTE'),\n",
            ),
        ],
        "",
        [
            "-- The longest TTL, for tools that ask.\nCREATE FUNCTION @extschema@.pg_lease_max_ttl()",
            "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_max_ttl() FROM PUBLIC;",
            "CREATE OR REPLACE FUNCTION @extschema@.pg_lease_privileges()",
        ],
        [
            "DROP FUNCTION @extschema@.pg_lease_max_ttl();",
            "CREATE OR REPLACE FUNCTION @extschema@.pg_lease_privileges()",
        ],
    ),
    "a dropped function": (
        [
            (
                "CREATE FUNCTION @extschema@.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint)\n"
                "RETURNS text LANGUAGE sql VOLATILE SECURITY DEFINER\nSET search_path = pg_catalog, pg_temp\n"
                "AS $$ SELECT @extschema@.pg_lease_fence(p_key, p_owner, p_epoch) $$;\n\n"
                "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint) FROM PUBLIC;\n",
                "",
            ),
            ("    ('worker', 'FUNCTION', '@extschema@.pg_lease_fence_outcome(text, text, bigint)', 'EXECUTE'),\n", ""),
        ],
        "",
        ["DROP FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint);"],
        [
            "FUNCTION @extschema@.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint)",
            "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint) FROM PUBLIC;",
        ],
    ),
    "a function's new signature, a REVOKE gone": (
        [
            (
                "CREATE FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint)",
                "CREATE FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint, p_kind text DEFAULT 'epoch')",
            ),
            ("'@extschema@.pg_lease_check_epoch(bigint)'", "'@extschema@.pg_lease_check_epoch(bigint, text)'"),
            ("REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_waiter_lock(text) FROM PUBLIC;\n", ""),
        ],
        "",
        [
            "CREATE FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint, p_kind text DEFAULT 'epoch')",
            "DROP FUNCTION @extschema@.pg_lease_check_epoch(bigint);",
            "GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_waiter_lock(text) TO PUBLIC;",
        ],
        [
            "CREATE FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint)",
            "DROP FUNCTION @extschema@.pg_lease_check_epoch(bigint, text);",
            "REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_waiter_lock(text) FROM PUBLIC;",
        ],
    ),
    "objects of every other kind": (
        [
            ('role_limit" FOR SELECT USING (true);', 'role_limit" FOR SELECT USING (role = current_user);'),
            ('pg_lease_django_tenure" ("key", "epoch");', 'pg_lease_django_tenure" ("key", "epoch" DESC);'),
            ('ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE ALWAYS TRIGGER pg_lease_rescope;\n', ""),
        ],
        NOTE_TABLE,
        [
            'CREATE TABLE @extschema@."pg_lease_django_note"',
            'REVOKE ALL ON @extschema@."pg_lease_django_note" FROM PUBLIC;',
            'ALTER TABLE @extschema@."pg_lease_django_note" ENABLE ROW LEVEL SECURITY;',
            'ALTER TABLE @extschema@."pg_lease_django_note" ENABLE ALWAYS TRIGGER pg_lease_note_changed;',
            'DROP POLICY pg_lease_read ON @extschema@."pg_lease_django_role_limit";',
            'DROP INDEX @extschema@."pg_lease_tenure_key_epoch";',
            'ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE TRIGGER pg_lease_rescope;',
        ],
        [
            'DROP TRIGGER pg_lease_note_changed ON @extschema@."pg_lease_django_note";\n\n'
            "DROP FUNCTION @extschema@.pg_lease_note_changed();",
            'DROP TABLE @extschema@."pg_lease_django_note";',
            "COMMENT ON FUNCTION @extschema@.pg_lease_status(text, timestamptz, timestamptz) IS NULL;",
            'ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE ALWAYS TRIGGER pg_lease_rescope;',
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_written_migration_builds_what_schema_sql_states_and_its_reverse_restores_the_last(
    package: Package, new_database: Callable[..., str], scenario: str
) -> None:
    edits, appended, in_delta, in_reverse = SCENARIOS[scenario]
    schema = edit(package, *edits) + appended
    package.schema_file.write_text(schema)
    status, output = run(package, "the_change")
    assert status == 0, output
    delta = (package.sql / "migrations" / f"{NEXT}_the_change.sql").read_text()
    reverse = (package.sql / "migrations" / f"{NEXT}_the_change_reverse.sql").read_text()
    for part in in_delta:
        assert part in delta
    for part in in_reverse:
        assert part in reverse
    [(forward_file, reverse_file, pinned)] = package.chain()[-1].sql_files
    assert pinned == hashlib.sha256((package.sql / forward_file).read_bytes()).hexdigest()
    module = (package.migrations / f"{NEXT}_the_change.py").read_text()
    assert f'reverse_sha256="{hashlib.sha256((package.sql / reverse_file).read_bytes()).hexdigest()}"' in module

    migrated, by_hand = new_database(migrated=True), new_database()  # migrated: 0001 .. LAST, from empty
    root = package.root.parent  # the copy comes first on the migrating process's path
    last = catalog(migrated)
    applied = manage(migrated, "migrate", "pg_lease_django", "--noinput", cwd=root)
    psql(by_hand, files.render(schema, '"public"'))

    assert f"Applying pg_lease_django.{NEXT}_the_change... OK" in applied
    assert differences(catalog(migrated), catalog(by_hand)) == []
    assert differences(last, catalog(by_hand)) != []  # the edit changed the catalog
    manage(migrated, "migrate", "pg_lease_django", LAST, "--noinput", cwd=root)
    assert differences(last, catalog(migrated)) == []
