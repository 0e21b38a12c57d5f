"""Who may work with leases: the roles ``PG_LEASE_WORKER_ROLES`` and ``PG_LEASE_OPERATOR_ROLES`` declare.

Every lease function that locks, reveals or changes a lease is revoked from ``PUBLIC`` in
``sql/schema.sql``, and ``pg_lease_privileges()`` lists, in SQL and once, what a worker and an
operator are granted. ``migrate`` grants it to the declared roles through a ``post_migrate``
receiver, so grants survive migrating back and forth and every future migration that adds a
function. ``manage.py leases grant`` does the same. Check ``pg_lease_django.W008`` says what a
database lacks, and which grants go beyond the declaration, as `undeclared` finds them: those are
left alone, to be revoked by hand.

``PG_LEASE_KEY_SCOPES``, a map of role to key prefixes, is copied into ``pg_lease_django_key_scope``
the same way; every lease function refuses a key outside the calling role's prefixes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, router, transaction
from psycopg import sql as pgsql

from pg_lease_django import conf, seats
from pg_lease_django.metrics import database_view
from pg_lease_django.sql import Statement, run, statements


@dataclass(frozen=True)
class Privilege:
    """One privilege: ``GRANT privilege ON kind object TO role`` (``WITH GRANT OPTION`` when ``grantable``)."""

    role: str
    kind: str  # FUNCTION or TABLE
    object: str  # schema-qualified, as pg_lease_privileges() names it
    privilege: str
    grantable: bool = False  # held WITH GRANT OPTION: the role may pass it on

    def parts(self) -> dict[str, pgsql.Composable]:
        """``statements.GRANT_PRIVILEGE``'s parts: the kind, object and privilege as ``pg_lease_privileges()``
        spells them (the package's own SQL), the role an identifier."""
        return {
            "privilege": pgsql.SQL(self.privilege),
            "kind": pgsql.SQL(self.kind),
            "object": pgsql.SQL(self.object),
            "role": pgsql.Identifier(self.role),
        }

    def statement(self) -> str:
        """The GRANT, as text (for `leases grant --check` to print)."""
        return statements.GRANT_PRIVILEGE.compose(None, **self.parts()).as_string(None)

    def revoke(self) -> str:
        """The statement that takes it back (only the grant option, when that is what is extra): text to print."""
        revoke = statements.REVOKE_GRANT_OPTION if self.grantable else statements.REVOKE_PRIVILEGE
        return revoke.compose(None, **self.parts()).as_string(None)


#: The tiers of ``pg_lease_privileges()`` each kind of declared role is granted.
TIERS = {"worker": ("worker",), "operator": ("worker", "operator", "monitor"), "monitor": ("monitor",)}
#: What a role may hold beyond its grants without being reported: the operator may be granted the
#: runbook's functions by hand (docs/security.md); every role may run what PUBLIC may.
_ALSO_ALLOWED = {"worker": ("public",), "operator": ("public", "runbook"), "monitor": ("public",)}


def declared() -> dict[str, tuple[str, ...]]:
    """The declared roles, each with its kinds (``worker``, ``operator``, ``monitor``), sorted."""
    roles: dict[str, set[str]] = {}
    for kind, names in (
        ("worker", conf.worker_roles()),
        ("operator", conf.operator_roles()),
        ("monitor", conf.monitor_roles()),
    ):
        for name in names:
            roles.setdefault(name, set()).add(kind)
    return {role: tuple(sorted(kinds)) for role, kinds in sorted(roles.items())}


def _tiers(kinds: tuple[str, ...], *, allowed: bool = False) -> list[str]:
    tiers = {tier for kind in kinds for tier in TIERS[kind]}
    if allowed:
        tiers |= {tier for kind in kinds for tier in _ALSO_ALLOWED[kind]}
    return sorted(tiers)


def installed(using: str) -> bool:
    """Whether database ``using`` has ``pg_lease_privileges()`` (the lease app migrated to 0003 or later)."""
    connection = connections[using]
    try:
        function = f"{run.schema(connection)}.pg_lease_privileges()"
    except ImproperlyConfigured:
        return False  # no lease table: not migrated (or migrated to zero)
    return bool(run.one(connection, statements.FUNCTION_EXISTS, function=function))


def missing(using: str = DEFAULT_DB_ALIAS) -> tuple[list[str], list[Privilege]]:
    """The declared roles database ``using``'s cluster lacks, and the grants its catalog lacks.

    One round trip. Raises ImproperlyConfigured when a setting is invalid or the lease app is not
    migrated there.
    """
    roles = declared()
    if not roles:
        return [], []
    tiers = [",".join(_tiers(kinds)) for kinds in roles.values()]
    rows = run.rows(connections[using], statements.MISSING_PRIVILEGES, roles=list(roles), tiers=tiers)
    absent = sorted({row.role for row in rows if not row.exists})
    lacking = [Privilege(row.role, row.kind, row.object, row.privilege) for row in rows if row.exists and not row.held]
    return absent, lacking


def undeclared(using: str = DEFAULT_DB_ALIAS) -> list[Privilege]:
    """Privileges on the package's functions and tables that the declaration does not give.

    Every role is looked at through its memberships too, and PUBLIC, except superusers, the owner
    of the lease table and its members, and PostgreSQL's predefined ``pg_*`` roles. A privilege
    counts as declared when ``pg_lease_privileges()`` gives it to PUBLIC or to a kind of declared
    role the role is or is a member of, since a login role in a declared group role holds the
    group's grants. Anything else is reported, such as an operator's function held by a worker or
    a table granted by ``GRANT ... ON ALL TABLES``. So is every privilege held WITH GRANT OPTION,
    which lets the role pass it on, as ``grantable``. Each is reported once, for the role it was
    granted to, a group role rather than each member that inherits it: the REVOKE that removes it is
    there. One round trip.
    """
    roles = declared()
    tiers = [",".join(_tiers(kinds, allowed=True)) for kinds in roles.values()]
    rows = run.rows(connections[using], statements.HELD_PRIVILEGES, roles=list(roles), tiers=tiers)
    through_public = {(row.kind, row.object, row.privilege) for row in rows if row.role == "PUBLIC"}
    extra = []
    for row in rows:
        if not row.direct or (row.role != "PUBLIC" and (row.kind, row.object, row.privilege) in through_public):
            continue  # reported once, where it was granted (PUBLIC, a group): a REVOKE there takes it from all
        if not set(row.tiers or ()) & ({"public"} | set(row.allowed or ())):
            extra.append(Privilege(row.role, row.kind, row.object, row.privilege))
        elif row.grantable:
            extra.append(Privilege(row.role, row.kind, row.object, row.privilege, grantable=True))
    return extra


@dataclass(frozen=True)
class Bypass:
    """A way around the lease rules that PostgreSQL's own privilege model gives a role.

    Attributes:
        role: the role that holds it.
        what: what it lets the role do, in a sentence.
        remedy: the statement or step that takes it away.
        error: True when it crosses a key scope or opens the fence now; check E006 or W008 says so.
    """

    role: str
    what: str
    remedy: str
    error: bool = False


#: The lease functions that take a key, so apply the key scope: a role reaching one needs a scope.
SCOPED_FUNCTIONS = (
    "pg_lease_acquire(text, text, interval)",
    "pg_lease_acquire(text, text, interval, interval)",
    "pg_lease_acquire_or_register(text, text, interval, interval)",
    "pg_lease_acquire_within(text, text, interval, interval)",
    "pg_lease_heartbeat(text, text, bigint, interval)",
    "pg_lease_renew(text, text, bigint, interval)",
    "pg_lease_release(text, text, bigint)",
    "pg_lease_inspect(text)",
    "pg_lease_request_handoff(text, bigint)",
    "pg_lease_force_release(text, bigint)",
    "pg_lease_force_release(text, bigint, text)",
    "pg_lease_fence(text, text, bigint)",
    "pg_lease_fence_outcome(text, text, bigint)",
    "pg_lease_check_fence(text, text, bigint)",
    "pg_lease_guard_key(text, jsonb, text)",
    "pg_lease_guard_one_key(text, text, bigint, bigint, text)",
)


def bypasses(using: str = DEFAULT_DB_ALIAS) -> list[Bypass]:
    """What PostgreSQL's privilege model lets roles do around the lease rules, with the remedy for each.

    One round trip on the catalog (any role may run it).
    """
    connection = connections[using]
    # Parameter privileges exist from PostgreSQL 15 on (pg_parameter_acl is unknown before).
    modern = connection.pg_version >= 150000  # type: ignore[attr-defined]
    replica = statements.REPLICA_PRIVILEGES.compose(None) if modern else pgsql.SQL("false")
    createrole = pgsql.SQL("r.rolcreaterole" if connection.pg_version < 160000 else "false")  # type: ignore[attr-defined]
    rows = run.rows(connection, statements.BYPASSES, parts={"replica": replica, "createrole": createrole})
    found: list[Bypass] = []
    for row in rows:
        name = row.role
        if row.creates_roles:
            found.append(
                Bypass(
                    name,
                    "has CREATEROLE: before PostgreSQL 16 it may grant itself membership of the lease tables' "
                    "owner, then write lease rows and fenced rows with no fence",
                    _printed(statements.NO_CREATEROLE, name),
                )
            )
        if row.replica_mode:
            found.append(
                Bypass(
                    name,
                    "may SET session_replication_role: replica mode turns off every trigger not fired ALWAYS "
                    "(the lease triggers are; fence triggers older than this version, check W006, and your "
                    "own are not)",
                    _printed(statements.REVOKE_REPLICA_MODE, name),
                )
            )
        if row.reads_secret:
            found.append(
                Bypass(
                    name,
                    "bypasses row-level security and may read pg_lease_django_secret: it can mint any role's "
                    "opt-out of fencing",
                    f"{_printed(statements.NO_BYPASS_RLS, name)} "
                    f"(and {_printed(statements.REVOKE_MEMBERSHIP, name, 'pg_read_all_data')})",
                    error=True,
                )
            )
        elif row.reads_all:
            found.append(
                Bypass(
                    name,
                    "is a member of pg_read_all_data: it reads every tenant's lease, history and key scope "
                    "rows (keys, owners, epochs; never the opt-out's secret, which row-level security keeps)",
                    _printed(statements.REVOKE_MEMBERSHIP, name, "pg_read_all_data"),
                )
            )
        if row.writes_all:
            found.append(
                Bypass(
                    name,
                    "is a member of pg_write_all_data: it may write the lease, epoch floor, waiter and history "
                    "tables as a grant of INSERT, UPDATE and DELETE on them would (extend or end any lease; "
                    "row-level security keeps the key scopes, limits and secret)",
                    _printed(statements.REVOKE_MEMBERSHIP, name, "pg_write_all_data"),
                )
            )
        if row.maintains:
            found.append(
                Bypass(
                    name,
                    "is a member of pg_maintain: it may LOCK, VACUUM FULL or CLUSTER the lease table, "
                    "stalling every lease call of every tenant",
                    _printed(statements.REVOKE_MEMBERSHIP, name, "pg_maintain"),
                )
            )
    return found


def _printed(statement: Statement[object], role: str, predefined: str | None = None) -> str:
    """A remedy to print: ``statement`` for ``role`` (and the predefined role it is a member of)."""
    parts: dict[str, pgsql.Composable] = {"role": pgsql.SQL("PUBLIC") if role == "PUBLIC" else pgsql.Identifier(role)}
    if predefined is not None:
        parts["predefined"] = pgsql.Identifier(predefined)
    return statement.compose(None, **parts).as_string(None)


def unscoped(using: str = DEFAULT_DB_ALIAS) -> list[Bypass]:
    """Roles that may call a lease function taking a key, while key scopes are configured, with no scope.

    Every call such a role makes is refused, since the check fails closed. It is an error of the
    declaration: give it a scope, make it a member of a scoped group role, or declare it ``"*"`` for
    every key. One round trip; it needs SELECT on the key scope table, which the owner and the
    operators have.
    """
    connection = connections[using]
    schema = run.schema(connection)
    names = run.rows(
        connection, statements.UNSCOPED, functions=[f"{schema}.{function}" for function in SCOPED_FUNCTIONS]
    )
    return [
        Bypass(
            name,
            "may call the lease functions, but no key scope applies to it (neither its own nor a group role's): "
            "every call it makes is refused",
            f'PG_LEASE_KEY_SCOPES["{name}"] = [its prefixes] (or "*" for every key), or GRANT a scoped group '
            "role TO it; then manage.py leases grant",
            error=True,
        )
        for name in names
    ]


def grant_privileges(using: str = DEFAULT_DB_ALIAS) -> list[Privilege]:
    """Grant the declared roles what they lack in database ``using``; return what was granted.

    Idempotent: a role that holds its privileges is granted nothing.

    Raises:
        ImproperlyConfigured: a declared role does not exist, so create it first; or the connection's
            role may not grant the privileges: run it as the lease functions' owner, as ``migrate`` is.
    """
    absent, lacking = missing(using)
    sync_key_scopes(using)
    sync_role_limits(using)
    database_view.sync_metrics_rule(using)
    if absent:
        raise ImproperlyConfigured(
            f"declared lease roles {', '.join(absent)} do not exist in database {using!r}'s cluster: "
            "CREATE ROLE them (docs/security.md), or remove them from PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES "
            "or PG_LEASE_MONITOR_ROLES"
        )
    connection = connections[using]
    with transaction.atomic(using=using):
        for needed in lacking:
            run.run(connection, statements.GRANT_PRIVILEGE, parts=needed.parts())
    if lacking and missing(using)[1]:
        raise ImproperlyConfigured(
            f"the role database {using!r} connects as may not grant the lease privileges (PostgreSQL only "
            "warned): run `manage.py leases grant` or `migrate` as the lease functions' owner"
        )
    return lacking


KEY_SCOPE_TABLE = "pg_lease_django_key_scope"


def stored_key_scopes(using: str = DEFAULT_DB_ALIAS) -> dict[str, tuple[str, ...]] | None:
    """The key scopes database ``using`` enforces, as ``PG_LEASE_KEY_SCOPES`` spells them; None before 0004."""
    connection = connections[using]
    if not run.one(
        connection, statements.RELATION_EXISTS, namespace=run.schema_name(connection), relation=KEY_SCOPE_TABLE
    ):
        return None
    scopes: dict[str, list[str]] = {}
    for scope in run.rows(connection, statements.KEY_SCOPES):
        scopes.setdefault(scope.role, []).append(scope.prefix)
    return {role: tuple(prefixes) for role, prefixes in scopes.items()}


def sync_key_scopes(using: str = DEFAULT_DB_ALIAS) -> bool:
    """Make database ``using`` enforce ``PG_LEASE_KEY_SCOPES``; return whether anything changed.

    Nothing to do before migration 0004 when the setting is empty. With a non-empty setting there it
    raises ImproperlyConfigured: the database could not enforce it.
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
    outermost = connection.get_autocommit()  # not in a caller's transaction, whose snapshot may be older
    with transaction.atomic(using=using):
        if outermost:  # in one, it is too late to choose: the database refuses a stale compilation
            run.run(connection, statements.KEY_SCOPES_READ_COMMITTED)
        run.run(connection, statements.KEY_SCOPES_LOCK)
        run.run(connection, statements.KEY_SCOPES_CLEAR)
        if pairs:
            run.run(connection, statements.KEY_SCOPES_ADD, roles=[r for r, _ in pairs], prefixes=[p for _, p in pairs])
    return True


ROLE_LIMIT_TABLE = "pg_lease_django_role_limit"


def stored_role_limits(using: str = DEFAULT_DB_ALIAS) -> dict[str, tuple[int | None, int | None]] | None:
    """The per-role limits database ``using`` enforces, as `conf.role_limits` returns them; None before 0007."""
    connection = connections[using]
    if not run.one(
        connection, statements.RELATION_EXISTS, namespace=run.schema_name(connection), relation=ROLE_LIMIT_TABLE
    ):
        return None
    limits = run.rows(connection, statements.ROLE_LIMITS)
    return {limit.role: (limit.max_leases, limit.max_tenures_per_key) for limit in limits}


def sync_role_limits(using: str = DEFAULT_DB_ALIAS) -> bool:
    """Make database ``using`` enforce ``PG_LEASE_ROLE_LIMITS``; return whether anything changed.

    Nothing to do before migration 0007 when the setting is empty; with a non-empty one there,
    ImproperlyConfigured (the database could not enforce it).
    """
    wanted = conf.role_limits()
    stored = stored_role_limits(using)
    if stored is None:
        if wanted:
            raise ImproperlyConfigured(
                f"database {using!r} cannot enforce PG_LEASE_ROLE_LIMITS: run `manage.py migrate pg_lease_django "
                f"--database {using}`"
            )
        return False
    if stored == wanted:
        return False
    connection = connections[using]
    with transaction.atomic(using=using):
        run.run(connection, statements.ROLE_LIMITS_LOCK)
        run.run(connection, statements.ROLE_LIMITS_CLEAR)
        if wanted:
            run.run(
                connection,
                statements.ROLE_LIMITS_ADD,
                roles=list(wanted),
                max_leases=[leases for leases, _ in wanted.values()],
                max_tenures_per_key=[kept for _, kept in wanted.values()],
            )
    return True


def absent_roles(names: list[str], using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Which of ``names`` are no role of database ``using``'s cluster (a typo, a rename, a drop)."""
    return run.rows(connections[using], statements.ABSENT_ROLES, names=names)


def grant_privileges_after_migrate(using: str = DEFAULT_DB_ALIAS, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: grant the declared roles in each database the lease app is migrated in.

    A migration that recreates a function (migrating back and forth, an upgrade) leaves it revoked
    from PUBLIC and granted to nobody; this puts the declared grants back. A problem is reported,
    not raised: the migration itself succeeded, and check W008 keeps saying what is missing.
    """
    from pg_lease_django.models import Lease

    if not router.allow_migrate_model(using, Lease) or not installed(using):
        return
    stdout = kwargs.get("stdout") or sys.stdout
    try:
        granted = grant_privileges(using)
    except ImproperlyConfigured as exc:
        stdout.write(f"  pg_lease_django: {exc}\n")
        return
    except DatabaseError as exc:  # a role that may migrate Django's tables, not write the lease grants
        if not seats.denied(exc):
            raise
        stdout.write(f"  pg_lease_django: grants and key scopes not synced: {seats.remedy(using, 'migrate')}\n")
        return
    if granted and verbosity >= 1:
        roles = sorted({g.role for g in granted})
        stdout.write(f"  pg_lease_django: granted {len(granted)} lease privileges to {', '.join(roles)} in {using!r}\n")
