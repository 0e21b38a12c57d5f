"""Who may work with leases: the roles ``PG_LEASE_WORKER_ROLES`` and ``PG_LEASE_OPERATOR_ROLES`` declare.

Every lease function that locks, reveals or changes a lease is revoked from ``PUBLIC``
(``sql/schema.sql``), and ``pg_lease_privileges()`` lists, in SQL and once, what a worker and an
operator are granted. ``migrate`` grants it to the declared roles (a ``post_migrate`` receiver,
so grants survive migrating back and forth and every future migration that adds a function), as
does ``manage.py leases grant``; check ``pg_lease_django.W008`` says what a database lacks, and
which grants go beyond the declaration (`undeclared`): those are left alone, revoke them by hand.

``PG_LEASE_KEY_SCOPES`` (role -> key prefixes) is copied into ``pg_lease_django_key_scope`` the
same way; every lease function refuses a key outside the calling role's prefixes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, router, transaction

from . import conf, sql


@dataclass(frozen=True)
class Grant:
    """One privilege a declared role needs: ``GRANT privilege ON kind object TO role``."""

    role: str
    kind: str  # FUNCTION or TABLE
    object: str  # schema-qualified, as pg_lease_privileges() names it
    privilege: str

    def statement(self, quote: Any) -> str:
        return f"GRANT {self.privilege} ON {self.kind} {self.object} TO {quote(self.role)}"


def declared() -> dict[str, str]:
    """The declared roles, each with its kind (a role named in both settings is an operator)."""
    roles = {role: "worker" for role in conf.worker_roles()}
    roles.update({role: "operator" for role in conf.operator_roles()})
    return roles


def installed(using: str) -> bool:
    """Whether database ``using`` has ``pg_lease_privileges()`` (the lease app migrated to 0003 or later)."""
    connection = connections[using]
    try:
        function = f"{sql.schema(connection)}.pg_lease_privileges()"
    except ImproperlyConfigured:
        return False  # no lease table: not migrated (or migrated to zero)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_catalog.to_regprocedure(%s) IS NOT NULL", [function])
        row = cursor.fetchone()
    return bool(row and row[0])


def missing(using: str = DEFAULT_DB_ALIAS) -> tuple[list[str], list[Grant]]:
    """The declared roles database ``using``'s cluster lacks, and the grants its catalog lacks.

    One round trip. Raises ImproperlyConfigured when a setting is invalid or the lease app is not
    migrated there.
    """
    roles = declared()
    if not roles:
        return [], []
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(
            sql.render(
                connection,
                "SELECT d.name, r.rolname IS NOT NULL, p.kind, p.object, p.privilege, "
                "r.rolname IS NOT NULL AND CASE p.kind "
                "WHEN 'FUNCTION' THEN pg_catalog.has_function_privilege(r.oid, p.object, p.privilege) "
                "ELSE pg_catalog.has_table_privilege(r.oid, p.object, p.privilege) END "
                "FROM ROWS FROM (pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::text[])) AS d (name, kind) "
                "LEFT JOIN pg_catalog.pg_roles r ON r.rolname = d.name "
                "JOIN {schema}.pg_lease_privileges() p "
                "ON p.role = 'worker' OR (p.role = 'operator' AND d.kind = 'operator') "
                "ORDER BY d.name, p.kind, p.object",
            ),
            [list(roles), list(roles.values())],
        )
        rows = cursor.fetchall()
    absent = sorted({name for name, exists, *_ in rows if not exists})
    lacking = [
        Grant(name, kind, obj, privilege) for name, exists, kind, obj, privilege, held in rows if exists and not held
    ]
    return absent, lacking


#: Every privilege a role can hold on the package's functions and tables.
_PRIVILEGES = (
    "('FUNCTION', 'EXECUTE'), ('TABLE', 'SELECT'), ('TABLE', 'INSERT'), ('TABLE', 'UPDATE'), ('TABLE', 'DELETE'), "
    "('TABLE', 'TRUNCATE'), ('TABLE', 'REFERENCES'), ('TABLE', 'TRIGGER')"
)
_HELD = (
    "WITH owner AS (SELECT c.relowner AS oid FROM pg_catalog.pg_class c "
    "WHERE c.oid = '{schema}.\"pg_lease_django_lease\"'::pg_catalog.regclass), "
    "objects AS ("
    "SELECT 'FUNCTION' AS kind, p.oid, p.oid::pg_catalog.regprocedure::text AS object FROM pg_catalog.pg_proc p "
    "WHERE p.pronamespace = '{schema}'::pg_catalog.regnamespace AND p.proname LIKE 'pg\\_lease\\_%%' "
    "AND p.prorettype <> 'pg_catalog.trigger'::pg_catalog.regtype "
    "UNION ALL SELECT 'TABLE', c.oid, c.oid::pg_catalog.regclass::text FROM pg_catalog.pg_class c "
    "WHERE c.relnamespace = '{schema}'::pg_catalog.regnamespace AND c.relname LIKE 'pg\\_lease\\_django\\_%%' "
    "AND c.relkind IN ('r', 'p')), "
    "wanted AS (SELECT w.role AS tier, w.privilege, CASE w.kind WHEN 'FUNCTION' "
    "THEN w.object::pg_catalog.regprocedure::oid ELSE w.object::pg_catalog.regclass::oid END AS oid "
    "FROM {schema}.pg_lease_privileges() w), "
    # A role is checked by its OID: by name, a role dropped after this statement's snapshot is
    # looked up in the current catalog and fails the whole read ("role does not exist").
    "grantees AS (SELECT r.rolname::text AS name, r.oid FROM pg_catalog.pg_roles r, owner "
    "WHERE NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_catalog.pg_has_role(r.oid, owner.oid, 'USAGE') "
    "UNION ALL SELECT 'PUBLIC', NULL), "
    f"privileges (kind, privilege) AS (VALUES {_PRIVILEGES}) "
    "SELECT g.name, o.kind, o.object, v.privilege, pg_catalog.array_agg(w.tier) FILTER (WHERE w.tier IS NOT NULL) "
    "FROM grantees g CROSS JOIN objects o JOIN privileges v ON v.kind = o.kind "
    "LEFT JOIN wanted w ON w.oid = o.oid AND w.privilege = v.privilege "
    "WHERE CASE WHEN g.oid IS NULL AND o.kind = 'FUNCTION' "
    "THEN pg_catalog.has_function_privilege('public', o.oid, v.privilege) "
    "WHEN g.oid IS NULL THEN pg_catalog.has_table_privilege('public', o.oid, v.privilege) "
    "WHEN o.kind = 'FUNCTION' THEN pg_catalog.has_function_privilege(g.oid, o.oid, v.privilege) "
    "ELSE pg_catalog.has_table_privilege(g.oid, o.oid, v.privilege) END "
    "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
)


def undeclared(using: str = DEFAULT_DB_ALIAS) -> list[Grant]:
    """Privileges on the package's functions and tables that the declaration does not give.

    Every role is looked at (through its memberships too), and PUBLIC, except superusers, the
    owner of the lease table and its members, and PostgreSQL's predefined ``pg_*`` roles: any
    privilege beyond what ``pg_lease_privileges()`` lists for PUBLIC and for the role's declared
    kind (an operator's function held by a worker, a table granted by ``GRANT ... ON ALL TABLES``,
    a role granted an operator's membership) is reported. One round trip.
    """
    roles = declared()
    # An operator may also have been granted the runbook's functions by hand (docs/security.md).
    allowed = {"worker": {"public", "worker"}, "operator": {"public", "worker", "operator", "runbook"}}
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.render(connection, _HELD))
        rows = cursor.fetchall()
    through_public = {(kind, obj, privilege) for name, kind, obj, privilege, _ in rows if name == "PUBLIC"}
    return [
        Grant(name, kind, obj, privilege)
        for name, kind, obj, privilege, tiers in rows
        if not set(tiers or ()) & allowed.get(roles.get(name, ""), {"public"})
        and (name == "PUBLIC" or (kind, obj, privilege) not in through_public)  # reported once, as PUBLIC's
    ]


def grant(using: str = DEFAULT_DB_ALIAS) -> list[Grant]:
    """Grant the declared roles what they lack in database ``using``; return what was granted.

    Idempotent: a role that holds its privileges is granted nothing.

    Raises:
        ImproperlyConfigured: a declared role does not exist (create it first), or the connection's
            role may not grant the privileges (run it as the lease functions' owner, as ``migrate``).
    """
    absent, lacking = missing(using)
    sync_key_scopes(using)
    if absent:
        raise ImproperlyConfigured(
            f"declared lease roles {', '.join(absent)} do not exist in database {using!r}'s cluster: "
            "CREATE ROLE them (docs/security.md), or remove them from PG_LEASE_WORKER_ROLES / PG_LEASE_OPERATOR_ROLES"
        )
    connection = connections[using]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for needed in lacking:
            cursor.execute(needed.statement(connection.ops.quote_name))
    if lacking and missing(using)[1]:
        raise ImproperlyConfigured(
            f"the role database {using!r} connects as may not grant the lease privileges (PostgreSQL only "
            "warned): run `manage.py leases grant` or `migrate` as the lease functions' owner"
        )
    return lacking


SCOPE_TABLE = "pg_lease_django_key_scope"


def stored_key_scopes(using: str = DEFAULT_DB_ALIAS) -> dict[str, tuple[str, ...]] | None:
    """The key scopes database ``using`` enforces, as ``PG_LEASE_KEY_SCOPES`` spells them; None before 0004."""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_catalog.to_regclass(%s) IS NOT NULL", [f"{sql.schema(connection)}.{SCOPE_TABLE}"])
        row = cursor.fetchone()
        if not (row and row[0]):
            return None
        cursor.execute(
            sql.render(connection, f"SELECT role, prefix FROM {{schema}}.{SCOPE_TABLE} ORDER BY role, prefix")
        )
        scopes: dict[str, list[str]] = {}
        for role, prefix in cursor.fetchall():
            scopes.setdefault(role, []).append(prefix)
    return {role: tuple(prefixes) for role, prefixes in scopes.items()}


def sync_key_scopes(using: str = DEFAULT_DB_ALIAS) -> bool:
    """Make database ``using`` enforce ``PG_LEASE_KEY_SCOPES``; return whether anything changed.

    Nothing to do before migration 0004 (when the setting is empty); with a non-empty setting there,
    ImproperlyConfigured (the database could not enforce it).
    """
    wanted = conf.key_scopes()
    stored = stored_key_scopes(using)
    if stored is None:
        if wanted:
            raise ImproperlyConfigured(
                f"database {using!r} cannot enforce PG_LEASE_KEY_SCOPES: run `manage.py migrate pg_lease_django "
                f"--database {using}`"
            )
        return False
    if stored == wanted:
        return False
    connection = connections[using]
    pairs = [(role, prefix) for role, prefixes in wanted.items() for prefix in prefixes]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        cursor.execute(sql.render(connection, f"DELETE FROM {{schema}}.{SCOPE_TABLE}"))
        if pairs:
            cursor.execute(
                sql.render(
                    connection,
                    f"INSERT INTO {{schema}}.{SCOPE_TABLE} (role, prefix) "
                    "SELECT * FROM ROWS FROM (pg_catalog.unnest(%s::name[]), pg_catalog.unnest(%s::text[]))",
                ),
                [[r for r, _ in pairs], [p for _, p in pairs]],
            )
    return True


def absent_roles(names: list[str], using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Which of ``names`` are no role of database ``using``'s cluster (a typo, a rename, a drop)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT n FROM pg_catalog.unnest(%s::text[]) n "
            "WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = n) ORDER BY n",
            [names],
        )
        return [row[0] for row in cursor.fetchall()]


def grant_after_migrate(using: str = DEFAULT_DB_ALIAS, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: grant the declared roles in each database the lease app is migrated in.

    A migration that recreates a function (migrating back and forth, an upgrade) leaves it revoked
    from PUBLIC and granted to nobody; this puts the declared grants back. A problem is reported,
    not raised: the migration itself succeeded, and check W008 keeps saying what is missing.
    """
    from .models import Lease

    if not router.allow_migrate_model(using, Lease) or not installed(using):
        return
    stdout = kwargs.get("stdout") or sys.stdout
    try:
        granted = grant(using)
    except ImproperlyConfigured as exc:
        stdout.write(f"  pg_lease_django: {exc}\n")
        return
    if granted and verbosity >= 1:
        roles = sorted({g.role for g in granted})
        stdout.write(f"  pg_lease_django: granted {len(granted)} lease privileges to {', '.join(roles)} in {using!r}\n")
