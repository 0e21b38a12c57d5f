"""One home for statements: every statement the package sends is in ``sql/queries.sql``, named once.

Read from the code (``ast``) and the SQL file: each named statement has one `Statement` value and each
value a statement; no module but the two executors (migrations aside) calls ``.execute(``, and none
spells a statement in a string, inside ``sql/`` or outside it; a statement's parameters are named
(``%(name)s``), and its identifiers composed (``{name}``), never quoted by hand inside a string
literal. The statements' behaviour is the rest of the suite's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from psycopg import sql as pgsql

import pg_lease_django
from pg_lease_django import sql
from pg_lease_django.exceptions import EpochMovedOnError, NotOwnerError
from pg_lease_django.sql import Statement, statements
from tests.parsing import parse

PACKAGE = Path(pg_lease_django.__file__).parent

#: The start of an SQL statement, as the package would spell one in a string (upper case).
STATEMENT_START = re.compile(
    r"^\s*\(?\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|DROP|ALTER|GRANT|REVOKE|SET|RESET|LISTEN|UNLISTEN|"
    r"NOTIFY|TRUNCATE|BEGIN|COMMIT|ROLLBACK|DO|PREPARE|COPY|LOCK|VACUUM|ANALYZE|COMMENT)\s+\S"
)

#: Strings outside sql/ that read like a statement and are not one the package sends, each with why.
NOT_SENT = {
    ("checks/database.py", "CREATE ROLE "): "a check's hint, for people",
    ("checks/database.py", "WITH GRANT OPTION"): "a check's message, for people",
    ("querysets.py", "(SELECT clock_timestamp())"): "a Func template: the ORM composes it into its own query",
    ("wait/sync_driver.py", "LISTEN for the wait (if ``listen``)"): "a docstring",
    ("wait/sync_driver.py", "UNLISTEN after a blocking acquire failed"): "a log message",
}


#: The executors: the only modules that send a statement.
EXECUTORS = ("sql/run.py", "sql/arun.py")
#: Calls of ``execute`` elsewhere that send no statement of ours, each with why.
NOT_A_STATEMENT = {
    ("sql/files.py", "schema_editor.execute(sql, params=None)"): "a migration's SQL file, pinned by its digest",
}
#: Fragments composed into Django's own statements, whose parameters Django's compiler joins to its
#: own by position: they alone keep ``%s``.
POSITIONAL = {"fence_expression", "fence_presented"}
#: The executors' own keywords, which no statement may name a parameter (`sql.run.one`, `on_psycopg`).
EXECUTOR_KEYWORDS = {"connection", "statement", "marker", "parts", "schema", "conn"}


def _modules(*, executors: bool) -> list[tuple[str, ast.Module]]:
    """Every module of the package but the migrations (and, unless ``executors``, the two executors)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith("migrations/") and (executors or name not in EXECUTORS):
            found.append((name, parse(path.read_text(), name)))
    return found


def _strings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of each string of ``tree``: an f-string as one text, ``{}`` where it formats."""
    found = []
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append(
                (node.lineno, "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values))
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstrings:
            found.append((node.lineno, node.value))
    return found


def _statement_like(text: str) -> bool:
    match = STATEMENT_START.match(text)
    return match is not None and match.group(1).isupper()


#: The files of named statements (procrastinate's format), each read by `sql.named`.
SOURCES = ("queries.sql", "fence_triggers.sql")
VALUES = [value for value in vars(statements).values() if isinstance(value, Statement)]
NAMED = sorted((source, name) for source in SOURCES for name in sql.named(source))


def test_every_named_statement_has_one_value_and_every_value_a_statement() -> None:
    found = [(value.source, value.name) for value in VALUES]
    assert len(found) == len(set(found)), "two values name one statement"
    assert set(found) == set(NAMED), (
        f"in the files only: {sorted(set(NAMED) - set(found))}; "
        f"in statements.py only: {sorted(set(found) - set(NAMED))}"
    )
    assert {path.name for path in (PACKAGE / "sql").glob("*.sql")} - {"schema.sql"} == set(SOURCES)


@pytest.mark.parametrize(("source", "name"), NAMED)
def test_each_statement_composes_with_its_declared_parts_only(source: str, name: str) -> None:
    """A ``{part}`` a statement does not declare (a typo, a part added in one place) fails here, not
    at the first call; ``{schema}`` and ``{schema_name}`` are every statement's."""
    [statement] = [v for v in VALUES if (v.source, v.name) == (source, name)]
    used = set(re.findall(r"(?<!\{)\{([a-z_]+)\}(?!\})", statement.text)) - {"schema", "schema_name"}
    assert used == set(statement.parts), f"{name}: composes {sorted(used)}, declares {sorted(statement.parts)}"
    parts = {part: pgsql.Identifier(part) for part in statement.parts}
    text = statement.compose('tenant "a"', **parts).as_string(None)
    assert "{" not in text.replace("{{", "").replace("}}", "") or "'{" in text, text


def test_no_identifier_is_quoted_by_hand_inside_a_string_literal() -> None:
    """``'{schema}."t"'::regclass`` breaks (or worse) for a schema with a quote in its name: the
    catalogs are asked by ``{schema_name}``, a literal psycopg quotes."""
    for name, text in (item for source in SOURCES for item in sql.named(source).items()):
        literals = re.findall(r"'(?:[^']|'')*'", text)
        inside = [literal for literal in literals if re.search(r"(?<!\{)\{[a-z_]+\}", literal)]
        assert not inside, f"{name}: composed inside a string literal: {inside}"


def test_a_schema_with_a_quote_in_its_name_is_quoted_everywhere() -> None:
    for statement in VALUES:
        parts = {part: pgsql.Identifier(part) for part in statement.parts}
        text = statement.compose("it's", **parts).as_string(None)
        assert "it's" not in text.replace('"it\'s"', "").replace("'it''s'", ""), statement.name


def test_no_module_but_the_executors_calls_execute() -> None:
    calls = [
        f"{name}:{node.lineno}: {ast.unparse(node)[:80]}"
        for name, tree in _modules(executors=False)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"execute", "executemany", "executescript"}
        and (name, ast.unparse(node)) not in NOT_A_STATEMENT
    ]
    assert not calls, "send statements through pg_lease_django.sql.run / sql.arun:\n" + "\n".join(calls)


def test_no_module_spells_a_statement_in_a_string() -> None:
    spelled = [
        f"{name}:{line}: {text[:80]!r}"
        for name, tree in _modules(executors=True)
        for line, text in _strings(tree)
        if _statement_like(text)
        and not any(name == where and text.strip().startswith(start) for where, start in NOT_SENT)
    ]
    assert not spelled, "put the statement in sql/queries.sql:\n" + "\n".join(spelled)


@pytest.mark.parametrize("statement", VALUES, ids=lambda value: value.name)
def test_each_statement_names_its_parameters(statement: Statement[object]) -> None:
    """A call passes a statement's parameters as keywords: none is positional but in the two
    fragments Django composes, and none is named like an executor's own keyword."""
    positional = "%s" in statement.text.replace("%%", "")
    assert positional == (statement.name in POSITIONAL), f"{statement.name}: %s and %(name)s mixed up"
    assert not statement.parameters & EXECUTOR_KEYWORDS, statement.name


def test_every_row_is_typed_and_every_decoder_reads_parameters_by_name() -> None:
    """Each statement's rows are a type of ``sql.rows`` (or None: no row worth reading), never a bare
    tuple; ``sql.rows``' decoders name the parameters they read, none indexes them by position."""
    untyped = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if re.search(r"Statement\[(?:Any|tuple)\b", path.read_text())
    ]
    assert not untyped, "a statement's rows are a type of sql.rows, None, or (any statement) object"
    source = (PACKAGE / "sql" / "rows.py").read_text()
    assert "params[" not in source
    assert re.search(r"def handoff\(row: Row, \*, key: str", source)
    assert statements.SEAT.decode(("me", None), relation="t").login == "me"
    assert statements.LISTEN.decode(()) is None


def test_a_statement_that_answers_a_verdict_carries_its_verdict_map() -> None:
    """A lease function's verdict becomes an error in the executors, from the statement's own map:
    every statement whose first column is ``outcome`` has one naming the package's errors, and the
    decoders only decode, raising nothing."""
    answering = {v.name for v in VALUES if re.match(r"SELECT outcome\b", v.text)}
    assert answering == {"renew", "release", "force_release", "request_handoff"}
    assert answering == {v.name for v in VALUES if v.verdicts}
    lost = statements.RENEW.verdicts["not_owner"](("not_owner", None, False), key="k", owner="me", epoch=3)
    assert isinstance(lost, NotOwnerError)
    assert (lost.owner, lost.epoch, lost.holder) == ("me", 3, None)
    assert str(lost) == "cannot renew 'k' as 'me' at epoch 3: not_owner"
    row = ("epoch_mismatch", "them", 9, None)
    refused = statements.FORCE_RELEASE.verdicts["epoch_mismatch"](row, key="k", epoch=4, operator="ops")
    assert isinstance(refused, EpochMovedOnError)
    assert (refused.owner, refused.epoch, refused.holder, refused.current_epoch) == (None, 4, "them", 9)
    source = (PACKAGE / "sql" / "rows.py").read_text()
    assert "errors" not in re.findall(r"^from \S+ import (.*)$", source, re.MULTILINE)
    assert "raise " not in source


def test_the_executors_send_positional_text_in_the_order_of_the_names() -> None:
    """What reaches the server is the text written with ``%s`` (execute wrappers of other apps add a
    positional parameter of their own); an escaped ``%%`` stays escaped."""
    sent = sql.positional("SELECT %(b)s, %(a)s, '100%%', %(b)s")
    assert (sent.text, sent.names) == ("SELECT %s, %s, '100%%', %s", ("b", "a", "b"))
    assert sent.arguments("s", {"a": 1, "b": 2}) == [2, 1, 2]


def test_the_scans_find_what_they_look_for() -> None:
    """The two scans above would pass vacuously if they found nothing: they find these."""
    tree = ast.parse('cursor.execute(f"SELECT {x} FROM t")\nQ = "DELETE FROM t"\nDOC = "Select a lease"\n')
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "execute"]
    assert found
    assert sorted(text for _, text in _strings(tree) if _statement_like(text)) == ["DELETE FROM t", "SELECT {} FROM t"]
