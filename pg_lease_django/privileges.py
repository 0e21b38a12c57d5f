"""Who may work with leases: the roles ``PG_LEASE_WORKER_ROLES`` and ``PG_LEASE_OPERATOR_ROLES`` declare.

Every lease function that locks, reveals or changes a lease is revoked from ``PUBLIC``
(``sql/schema.sql``), and ``pg_lease_privileges()`` lists, in SQL and once, what a worker and an
operator are granted. ``migrate`` grants it to the declared roles (a ``post_migrate`` receiver,
so grants survive migrating back and forth and every future migration that adds a function), as
does ``manage.py leases grant``; check ``pg_lease_django.W008`` says what a database lacks.
Grants the declaration does not name are left alone: revoke those by hand.
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


def _installed(using: str) -> bool:
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


def grant(using: str = DEFAULT_DB_ALIAS) -> list[Grant]:
    """Grant the declared roles what they lack in database ``using``; return what was granted.

    Idempotent: a role that holds its privileges is granted nothing.

    Raises:
        ImproperlyConfigured: a declared role does not exist (create it first), or the connection's
            role may not grant the privileges (run it as the lease functions' owner, as ``migrate``).
    """
    absent, lacking = missing(using)
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


def grant_after_migrate(using: str = DEFAULT_DB_ALIAS, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: grant the declared roles in each database the lease app is migrated in.

    A migration that recreates a function (migrating back and forth, an upgrade) leaves it revoked
    from PUBLIC and granted to nobody; this puts the declared grants back. A problem is reported,
    not raised: the migration itself succeeded, and check W008 keeps saying what is missing.
    """
    from .models import Lease

    if not declared() or not router.allow_migrate_model(using, Lease) or not _installed(using):
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
