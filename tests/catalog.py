"""What the lease app installed in one schema, read back from PostgreSQL's catalog.

Two databases built two ways (the migrations, or ``schema.sql`` applied by hand) must give equal
snapshots: every function as ``pg_get_functiondef`` prints it, every table's columns, constraints,
indexes, triggers, options, row-level security and policies, every comment and every privilege. The
schema's name is replaced by ``@extschema@`` and the role that ran the build by ``OWNER``, so builds in
different schemas, or by different roles, compare equal when they installed the same thing. An ACL's
items are sorted: PostgreSQL keeps them in the order the grants were made (a function whose PUBLIC
EXECUTE was revoked and granted again lists it last), which changes no privilege.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

# Every object of the lease app is named pg_lease_*: its tables pg_lease_django_*, its functions,
# triggers, constraints and indexes pg_lease_* (or Django's names for the tables', below).
_FUNCTIONS = """
SELECT p.proname || '(' || pg_catalog.pg_get_function_identity_arguments(p.oid) || ')',
       pg_catalog.pg_get_functiondef(p.oid),
       coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))::text,
       coalesce(pg_catalog.obj_description(p.oid, 'pg_proc'), '')
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = %(schema)s::regnamespace AND p.proname LIKE 'pg\\_lease\\_%%'
"""

_TABLES = """
SELECT c.oid, c.relname, c.relkind, c.relpersistence, coalesce(c.reloptions::text, ''),
       c.relrowsecurity, c.relforcerowsecurity,
       coalesce(c.relacl, pg_catalog.acldefault('r', c.relowner))::text,
       coalesce(pg_catalog.obj_description(c.oid, 'pg_class'), '')
  FROM pg_catalog.pg_class c
 WHERE c.relnamespace = %(schema)s::regnamespace AND c.relname LIKE 'pg\\_lease\\_django\\_%%'
   AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
"""

_COLUMNS = """
SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull,
       coalesce(pg_catalog.pg_get_expr(d.adbin, d.adrelid), ''), a.attidentity, a.attgenerated,
       coalesce(pg_catalog.col_description(a.attrelid, a.attnum), ''), coalesce(a.attacl::text, '')
  FROM pg_catalog.pg_attribute a LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE a.attrelid = %(table)s AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum  -- the order, not the numbers: a column dropped and added again leaves a gap
"""

_CONSTRAINTS = """
SELECT c.conname, c.contype, pg_catalog.pg_get_constraintdef(c.oid),
       coalesce(pg_catalog.obj_description(c.oid, 'pg_constraint'), '')
  FROM pg_catalog.pg_constraint c WHERE c.conrelid = %(table)s
"""

_INDEXES = """
SELECT i.relname, pg_catalog.pg_get_indexdef(i.oid), coalesce(pg_catalog.obj_description(i.oid, 'pg_class'), '')
  FROM pg_catalog.pg_index x JOIN pg_catalog.pg_class i ON i.oid = x.indexrelid
 WHERE x.indrelid = %(table)s
"""

_TRIGGERS = """
SELECT t.tgname, pg_catalog.pg_get_triggerdef(t.oid), t.tgenabled,
       coalesce(pg_catalog.obj_description(t.oid, 'pg_trigger'), '')
  FROM pg_catalog.pg_trigger t WHERE t.tgrelid = %(table)s AND NOT t.tgisinternal
"""

_POLICIES = """
SELECT p.polname, p.polcmd, p.polpermissive, p.polroles::regrole[]::text[],
       coalesce(pg_catalog.pg_get_expr(p.polqual, p.polrelid), ''),
       coalesce(pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid), '')
  FROM pg_catalog.pg_policy p WHERE p.polrelid = %(table)s
"""

# Rows the schema itself installs (the epoch floor's one row); the lease and tenure rows are data.
_SCHEMA_ROWS = {"pg_lease_django_epoch_floor"}


def snapshot(conn: psycopg.Connection[Any], schema: str = "public") -> dict[str, Any]:
    """Everything the lease app installed in ``schema``, as comparable values."""
    owner = _scalar(conn, "SELECT current_user")
    normalise = _normaliser(schema, owner)
    found: dict[str, Any] = {"functions": {}, "tables": {}}
    with conn.cursor() as cursor:
        for signature, definition, acl, comment in cursor.execute(_FUNCTIONS, {"schema": schema}).fetchall():
            function = normalise({"definition": definition, "privileges": acl, "comment": comment})
            found["functions"][signature] = {**function, "privileges": _acl_items(function["privileges"])}
        for oid, name, kind, persistence, options, rls, forced_rls, acl, comment in cursor.execute(
            _TABLES, {"schema": schema}
        ).fetchall():
            table: dict[str, Any] = {
                "kind": kind,
                "persistence": persistence,
                "options": options,
                "row_security": (rls, forced_rls),
                "policies": sorted(cursor.execute(_POLICIES, {"table": oid}).fetchall()),
                "privileges": acl,
                "comment": comment,
                "columns": cursor.execute(_COLUMNS, {"table": oid}).fetchall(),
                "constraints": sorted(cursor.execute(_CONSTRAINTS, {"table": oid}).fetchall()),
                "indexes": sorted(cursor.execute(_INDEXES, {"table": oid}).fetchall()),
                "triggers": sorted(cursor.execute(_TRIGGERS, {"table": oid}).fetchall()),
            }
            if name in _SCHEMA_ROWS:
                quoted = f"{_quote(schema)}.{_quote(name)}"
                table["rows"] = sorted(cursor.execute(f"SELECT * FROM {quoted}").fetchall())
            table = normalise(table)
            found["tables"][name] = {**table, "privileges": _acl_items(table["privileges"])}
    return found


def differences(left: dict[str, Any], right: dict[str, Any], path: str = "") -> list[str]:
    """Where two snapshots differ, one line each (empty when they are equal)."""
    if isinstance(left, dict) and isinstance(right, dict):
        lines = []
        for name in sorted(set(left) | set(right), key=str):
            where = f"{path}/{name}"
            if name not in left:
                lines.append(f"{where}: only in the second")
            elif name not in right:
                lines.append(f"{where}: only in the first")
            else:
                lines.extend(differences(left[name], right[name], where))
        return lines
    return [] if left == right else [f"{path}:\n  first:  {left!r}\n  second: {right!r}"]


def _acl_items(acl: str) -> list[str]:
    """The items of an ACL (``{a=r/b,"c d"=r/b}``, its roles already normalised), in a fixed order."""
    return sorted(re.findall(r'(?:"(?:[^"\\]|\\.)*"|[^,{}])+', acl))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _scalar(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _normaliser(schema: str, owner: str) -> Any:
    spellings = sorted({_quote(schema), schema}, key=len, reverse=True)
    schema_names = re.compile("|".join(re.escape(name) for name in spellings))
    # An ACL item names the role that holds the privilege and the one that granted it: "role=X/grantor".
    roles = "|".join(re.escape(name) for name in (_quote(owner), owner))
    owner_names = re.compile(rf"(?<=[{{,/])(?:{roles})(?=[=/,}}])")

    def normalise(value: Any) -> Any:
        if isinstance(value, dict):
            return {name: normalise(item) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return [normalise(item) for item in value]
        if isinstance(value, str):
            return owner_names.sub("OWNER", schema_names.sub("@extschema@", value))
        return value

    return normalise
