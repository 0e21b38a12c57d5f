"""What a migration does to turn the schema the migrations build into the one ``schema.sql`` states.

``plan(old, new)`` compares two ``Schema`` objects object by object and writes both directions:
the delta makes each new object as ``schema.sql`` writes it (with its privileges), restates each
changed one whole (``CREATE OR REPLACE FUNCTION``, which keeps the function's privileges, restated
beside it anyway), and drops each object that is gone; the reverse restores every previous version
and drops what the delta made. Creations run in the order of their schema, drops in the opposite
order (a trigger before its function, though a table's DROP would take its triggers along).

What a tool cannot write safely is refused, each with what to write by hand: a table's columns,
constraints, options or rows; a dropped table (its rows); a function whose return type, parameter
names or defaults changed (DROP + CREATE, and its privileges and dependents restated); a trigger's
definition (DROP + CREATE, in an order only the author knows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from devkit.sqlchange.objects import GRANTABLE, GRANTED, REVOKED, Schema, SqlObject
from devkit.sqlchange.text import normal_form

_CREATE_FUNCTION = re.compile(r"^CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\b", re.IGNORECASE)


@dataclass(frozen=True)
class Change:
    """One object the delta makes (``new``), restates (``changed``: which aspects) or drops."""

    verb: str
    key: str
    aspects: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.verb} {self.key}" + (f" ({', '.join(self.aspects)})" if self.aspects else "")


@dataclass
class Plan:
    """The delta's and the reverse's SQL, one object's statements (with their comments) per item; what
    was refused, and notes for the author."""

    changes: list[Change] = field(default_factory=list)
    forward: list[str] = field(default_factory=list)
    reverse: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan(old: Schema, new: Schema) -> Plan:
    """The migration from ``old`` (what the migrations build) to ``new`` (``schema.sql``)."""
    result = Plan()
    changed: dict[str, tuple[str, ...]] = {}
    for key, obj in new.objects.items():
        if key not in old.objects:
            result.changes.append(Change("new", key))
            result.notes.extend(_notes_on_new(obj))
            continue
        aspects = _differences(old.objects[key], obj)
        if aspects:
            refusal = _refusal(old.objects[key], obj, aspects)
            if refusal:
                result.refusals.append(refusal)
            else:
                changed[key] = aspects
                result.changes.append(Change("changed", key, aspects))
    for key, obj in old.objects.items():
        if key not in new.objects:
            if obj.kind == "table":
                result.refusals.append(_dropped_table(obj))
            result.changes.append(Change("dropped", key))
    result.forward = _direction(old, new, changed)
    result.reverse = _direction(new, old, changed)
    return result


def _direction(start: Schema, end: Schema, changed: dict[str, tuple[str, ...]]) -> list[str]:
    """The SQL that turns ``start`` into ``end``: creations and restatements in ``end``'s order,
    then drops in the opposite of ``start``'s order."""
    sql: list[str] = []
    done: set[str] = set()
    for key, obj in end.objects.items():
        if key in done:
            continue
        if key not in start.objects:
            sql.append(_together(_create(obj)))
        elif key in changed:
            sql.append(_together(_update(start.objects[key], obj, changed[key], end, done)))
    # Dropped one by one, the last made first: a trigger before its function, a policy before its
    # table. Only a comment on an object dropped here is left to go with it.
    gone = {key for key in start.objects if key not in end.objects}
    for key in reversed(start.objects):
        obj = start.objects[key]
        if key in gone and not (obj.kind == "comment" and gone.intersection(start.owners(key))):
            sql.append(obj.drop + ";")
    return sql


def _together(statements: list[str]) -> str:
    """One object's statements as one paragraph (a statement with a comment of its own starts another)."""
    return "".join(("\n\n" if sql.startswith("--") else "\n") + sql for sql in statements).lstrip("\n")


def _differences(old: SqlObject, new: SqlObject) -> tuple[str, ...]:
    aspects: list[str] = []
    if old.table is not None and new.table is not None:
        before, after = old.table, new.table
        if (before.head, before.columns, sorted(before.constraints), before.options) != (
            after.head,
            after.columns,
            sorted(after.constraints),
            after.options,
        ):
            aspects.append("columns")
        if [normal_form(row.tokens) for row in before.rows] != [normal_form(row.tokens) for row in after.rows]:
            aspects.append("rows")
        if before.row_security != after.row_security:
            aspects.append("row security")
    elif old.shape != new.shape:
        aspects.append("definition")
    if old.privileges != new.privileges:
        aspects.append("privileges")
    if old.firing != new.firing:
        aspects.append("firing")
    return tuple(aspects)


def _create(obj: SqlObject) -> list[str]:
    """``obj`` made anew, as its statement writes it, with its privileges, rows, row security, firing."""
    sql = [obj.statement.sql()]
    sql.extend(_privileges(None, obj))
    if obj.table is not None:
        sql.extend(row.sql() for row in obj.table.rows)
        sql.extend(_row_security(None, obj))
    if obj.kind == "trigger" and obj.firing != "ENABLE":
        sql.append(obj.firing_sql.format(firing=obj.firing) + ";")
    return sql


def _update(old: SqlObject, new: SqlObject, aspects: tuple[str, ...], end: Schema, done: set[str]) -> list[str]:
    """The statements that turn ``old`` into ``new`` (one of the aspects ``_differences`` found)."""
    sql: list[str] = []
    if "definition" in aspects:
        if new.kind == "function":
            sql.append(
                new.statement.comment + _CREATE_FUNCTION.sub("CREATE OR REPLACE FUNCTION", new.statement.text) + ";"
            )
        elif new.kind == "comment":
            sql.append(new.statement.sql())
        else:  # an index or a policy: dropped and made again, and the comments on it with it
            sql.extend([old.drop + ";", new.statement.sql()])
            for key, obj in end.objects.items():
                if obj.owner == new.key:
                    sql.append(obj.statement.sql())
                    done.add(key)
    if "privileges" in aspects or ("definition" in aspects and new.kind == "function"):
        sql.extend(_privileges(old, new))
    if "row security" in aspects:
        sql.extend(_row_security(old, new))
    if "firing" in aspects:
        sql.append(new.firing_sql.format(firing=new.firing) + ";")
    return sql


def _privileges(old: SqlObject | None, new: SqlObject) -> list[str]:
    """GRANT / REVOKE statements that give ``new``'s privileges to an object that has ``old``'s (a
    new object's when None): every privilege ``new`` names (restated when unchanged), then every one
    only ``old`` names, back to PostgreSQL's default."""
    wanted = new.privileges
    had = old.privileges if old is not None else {}
    keys = list(wanted) + [key for key in had if key not in wanted]
    return [
        _privilege_sql(new, key, new.privilege(key), old.privilege(key) if old else new.default_privilege(key))
        for key in keys
    ]


def _privilege_sql(obj: SqlObject, key: tuple[str, str], value: str, before: str) -> str:
    privilege, grantee = key
    who = "PUBLIC" if grantee == "public" else grantee
    if value == REVOKED:
        return f"REVOKE {privilege} ON {obj.grant_target} FROM {who};"
    if value == GRANTED and before == GRANTABLE:
        return f"REVOKE GRANT OPTION FOR {privilege} ON {obj.grant_target} FROM {who};"
    option = " WITH GRANT OPTION" if value == GRANTABLE else ""
    assert value in (GRANTED, GRANTABLE)
    return f"GRANT {privilege} ON {obj.grant_target} TO {who}{option};"


def _row_security(old: SqlObject | None, new: SqlObject) -> list[str]:
    assert new.table is not None
    before = old.table.row_security if old is not None and old.table is not None else (False, False)
    (enabled, forced), name = new.table.row_security, new.grant_target
    sql = []
    if enabled != before[0]:
        sql.append(f"ALTER TABLE {name} {'ENABLE' if enabled else 'DISABLE'} ROW LEVEL SECURITY;")
    if forced != before[1]:
        sql.append(f"ALTER TABLE {name} {'FORCE' if forced else 'NO FORCE'} ROW LEVEL SECURITY;")
    return sql


def _refusal(old: SqlObject, new: SqlObject, aspects: tuple[str, ...]) -> str | None:
    """Why a tool may not write this change, and what to write by hand; None when it may."""
    if "columns" in aspects:
        assert old.table is not None and new.table is not None
        added = [column for column in new.table.columns if column not in old.table.columns]
        removed = [column for column in old.table.columns if column not in new.table.columns]
        detail = "; ".join([*(f"+ {c}" for c in added), *(f"- {c}" for c in removed)]) or "constraints or options"
        return (
            f"{new.key}: its columns, constraints or options changed ({detail}). What the rows need is the "
            f"author's to say: write ALTER TABLE {new.grant_target} ADD COLUMN / DROP COLUMN / ADD CONSTRAINT ... "
            "in the delta and the opposite in its reverse; a model's table also needs the model operation as the "
            "state_operations of a SeparateDatabaseAndState around the RunSQLFile "
            "(see 0002_triggers_off_the_common_path.py)."
        )
    if "rows" in aspects:
        return (
            f"{new.key}: the rows schema.sql inserts changed. Write the INSERT / UPDATE / DELETE by hand, "
            "and in the reverse what undoes it."
        )
    if new.kind == "type" and "definition" in aspects:
        return (
            f"{new.key}: its definition changed, which no ALTER a tool may write keeps safe for the functions "
            f"returning it. Write by hand: DROP each function that uses it, {old.drop}, CREATE TYPE as schema.sql "
            "writes it, the functions again with their privileges (0008_hot_path.sql keeps them across the DROP); "
            "in the reverse the same with the previous definition."
        )
    if new.kind == "trigger" and "definition" in aspects:
        return (
            f"{new.key}: its definition changed. Write by hand {old.drop}; then CREATE TRIGGER as schema.sql "
            f"writes it, and {new.firing_sql.format(firing=new.firing)} (a new trigger fires in origin mode only); "
            "in the reverse the same with the previous definition. Mind what the new definition needs made "
            "first and the order triggers fire in (by name)."
        )
    if new.signature is not None and old.signature is not None and "definition" in aspects:
        why = []
        if (old.signature.returns, old.signature.outputs) != (new.signature.returns, new.signature.outputs):
            why.append(f"its return type changed ({old.signature.returns or '-'} -> {new.signature.returns or '-'})")
        if any(a != b for a, b in zip(old.signature.names, new.signature.names, strict=True)):
            why.append(
                f"a parameter was renamed ({', '.join(old.signature.names)} -> {', '.join(new.signature.names)})"
            )
        if any(a and not b for a, b in zip(old.signature.defaults, new.signature.defaults, strict=True)):
            why.append("a parameter lost its default")
        if why:
            grants = " ".join(_privileges(None, new)) or "none: PUBLIC keeps EXECUTE"
            return (
                f"{new.key}: {'; '.join(why)}, which CREATE OR REPLACE cannot do. Write by hand {old.drop}; then "
                f"CREATE FUNCTION as schema.sql writes it; then its privileges, which a DROP forgets ({grants}); "
                "and drop and make again whatever depends on it (triggers that EXECUTE it, SQL functions that "
                "call it). The reverse does the same with the previous version."
            )
    return None


def _dropped_table(obj: SqlObject) -> str:
    return (
        f"{obj.key} is gone from schema.sql. Dropping it deletes its rows, and no reverse brings them back: "
        f"write {obj.drop} by hand, with what becomes of the rows, and in the reverse its CREATE TABLE, privileges "
        "and indexes as the migrations made them (and, for a model's table, the model's state operation)."
    )


def _notes_on_new(obj: SqlObject) -> list[str]:
    if obj.kind == "table":
        return [
            f"{obj.key} is new: if a model uses it, put the RunSQLFile in a SeparateDatabaseAndState whose "
            "state_operations create the model (0001_baseline.py shows one); `make migrations-check` says if "
            "it is missing."
        ]
    if obj.kind == "function" and obj.privilege(("EXECUTE", "public")) == GRANTED:
        return [
            f"{obj.key} is new and PUBLIC may run it: right for a pure helper; a function that locks, reveals or "
            "changes a lease is revoked from PUBLIC beside its definition and gets a row in pg_lease_privileges() "
            '(docs/architecture.md, "Changing the SQL").'
        ]
    return []
