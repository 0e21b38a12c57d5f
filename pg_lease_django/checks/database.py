"""System checks that read the lease database (``check --database``): its table, migrations, history
scope, fence triggers and privileges; and plain ``check``'s probe of it."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router, transaction

from pg_lease_django.sql import run, statements


def check_lease_table_is_reachable(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W002: migrated, yet no lease table on the search_path (``check --database``).

    A database not migrated yet gets Django's own "unapplied migrations" notice, and the first lease
    call there names the ``migrate`` command. This catches the confusing case: the migrations are
    recorded as applied but the connection cannot see the table. The table may be in another
    schema, the search_path may have changed, or a restored dump may lack it.
    """
    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or not recorded_migrations(connection):
            continue
        if not run.one(connection, statements.LEASE_TABLE_VISIBLE):
            warnings.append(
                checks.Warning(
                    f"pg_lease_django is migrated in database {alias!r}, but its lease table is not on the "
                    "connection's search_path: every lease call there will fail.",
                    hint="Check the search_path in DATABASES OPTIONS, or set PG_LEASE_SCHEMA; if the table was "
                    f"dropped, run: manage.py migrate pg_lease_django zero --fake --database {alias}, then migrate.",
                    id="pg_lease_django.W002",
                )
            )
    return warnings


def check_lease_migrations_are_complete(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W004: some of the lease app's migrations applied, not all (``check --database``).

    ``migrate <your app>`` applies only the lease migrations your app depends on. Later ones, which
    add SQL functions the package calls, are nobody's dependency. So the first call that needs one
    fails with "function ... does not exist". A database with none applied is Django's own notice. A
    database that applied only some of the development migrations the baseline replaces cannot
    migrate at all: the warning says which are missing and how to finish them.
    """
    from django.db.migrations.exceptions import NodeNotFoundError
    from django.db.migrations.loader import MigrationLoader

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or (recorded := recorded_migrations(connection)) is None:
            continue
        replaced = [name for app, name in _baseline().replaces if app == "pg_lease_django"]
        unfinished = [name for name in replaced if name not in recorded]
        if recorded & set(replaced) and unfinished:
            warnings.append(
                checks.Warning(
                    f"database {alias!r} applied some of the development migrations of pg_lease_django that "
                    f"0001_baseline replaces, not all: {', '.join(unfinished)} are missing, so it cannot migrate.",
                    hint="Migrate it to 0010_one_statement with the development version that wrote the others "
                    "(0.2.0.dev0 before the baseline), then with this one.",
                    id="pg_lease_django.W004",
                )
            )
            continue
        try:
            loader = MigrationLoader(connection, ignore_no_migrations=True)
        except NodeNotFoundError:
            continue  # an app's migration names one that is not there: migrate says which
        on_disk = sorted(name for app, name in loader.disk_migrations if app == "pg_lease_django")
        applied = {name for app, name in loader.applied_migrations if app == "pg_lease_django"}
        missing = [name for name in on_disk if name not in applied]
        if applied and missing:
            warnings.append(
                checks.Warning(
                    f"database {alias!r} lacks migrations of pg_lease_django: {', '.join(missing)}; "
                    "lease calls that need their SQL functions will fail.",
                    hint=f"Run: manage.py migrate pg_lease_django --database {alias} (or a plain migrate).",
                    id="pg_lease_django.W004",
                )
            )
    return warnings


def recorded_migrations(connection: Any) -> set[str] | None:
    """The lease app's migrations ``connection``'s database records as applied (none without a
    ``django_migrations`` table); None where this role may not read it: a worker's or the monitor's
    seat cannot compare what only the owner's ``migrate`` changes, so its checks say nothing of it."""
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connection)
    try:
        with transaction.atomic(using=connection.alias):  # a refused read must not break the connection
            if not recorder.has_table():
                return set()
            return {name for app, name in recorder.applied_migrations() if app == "pg_lease_django"}
    except DatabaseError:
        return None


def _baseline() -> Any:
    """The migration that replaces the development chain (its ``replaces`` names them)."""
    from importlib import import_module

    return import_module("pg_lease_django.migrations.0001_baseline").Migration


def check_history_scope_is_current(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W005: a database records the history of other keys than ``PG_LEASE_HISTORY`` says.

    The database decides what it records (every caller is recorded alike), from its own copy of the
    setting, which ``migrate`` refreshes: a changed setting takes effect at the next migrate.
    """
    from pg_lease_django import conf
    from pg_lease_django.provisioning import history

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        if connections[alias].vendor != "postgresql":
            continue
        try:
            recorded = history.recorded_prefixes(alias)
        except DatabaseError:
            continue  # W002/W004 say why
        if recorded is not None and recorded != conf.history_prefixes():
            warnings.append(
                checks.Warning(
                    f"database {alias!r} records the lease history of keys starting with {list(recorded)!r}, "
                    f"but PG_LEASE_HISTORY is {list(conf.history_prefixes())!r}.",
                    hint=f"Run: manage.py migrate --database {alias} (it copies the setting into the database).",
                    id="pg_lease_django.W005",
                )
            )
    return warnings


def check_fence_triggers_are_current(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W006: a fenced table's installed triggers are missing or of another version
    than this package's (``check --database``).

    The triggers' SQL is frozen per version, which ``FenceTrigger``'s ``version`` and the triggers'
    comment name. After an upgrade that changes it, ``makemigrations`` writes the migration that
    replaces them. Until it is applied the table keeps the old triggers. A table not created yet
    gets Django's own unapplied-migrations notice.
    """
    from pg_lease_django.fencing.schema import FENCE_TRIGGER_VERSION, VERSION_COMMENT, FenceTrigger

    warnings: list[checks.CheckMessage] = []
    fenced = [
        (model, trigger)
        for model in apps.get_models()
        for trigger in model._meta.constraints
        if isinstance(trigger, FenceTrigger)
    ]
    expected = VERSION_COMMENT.format(version=FENCE_TRIGGER_VERSION)
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        for model, trigger in fenced:
            wanted = trigger.trigger_names()
            if not router.allow_migrate_model(alias, model):
                continue
            # One round trip: whether the table exists, and its fence triggers with their comments.
            table = connection.ops.quote_name(model._meta.db_table)
            triggers = run.one(connection, statements.FENCE_TRIGGERS, table=table, names=list(wanted))
            installed = dict(zip(triggers.names or [], triggers.comments or [], strict=True))
            if not triggers.table_exists:
                continue
            stale = [name for name in wanted if installed.get(name) != expected]
            if stale:
                found = sorted({installed[name] or "no version" for name in stale if name in installed})
                missing = [name for name in stale if name not in installed]
                warnings.append(
                    checks.Warning(
                        f"the fence triggers of table {model._meta.db_table!r} in database {alias!r} are not the "
                        f"ones this version of pg_lease_django installs ({expected!r}): "
                        + "; ".join(
                            ([f"installed: {', '.join(found)}"] if found else [])
                            + ([f"missing: {', '.join(missing)}"] if missing else [])
                        )
                        + ".",
                        hint=f"Run: manage.py makemigrations {model._meta.app_label}, then manage.py migrate "
                        f"--database {alias} (the new migration replaces the triggers).",
                        obj=model,
                        id="pg_lease_django.W006",
                    )
                )
    return warnings


def unread(alias: str, what: str, exc: DatabaseError) -> checks.Warning:
    """W008 for a read that failed: never an all-clear the check did not establish."""
    return checks.Warning(
        f"database {alias!r}: {what} could not be read: {str(exc).strip()}",
        hint=f"Run, as the lease functions' owner: manage.py leases grant --check --database {alias}",
        id="pg_lease_django.W008",
    )


def check_declared_roles_are_granted(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W008: a declared lease role (``PG_LEASE_*_ROLES``) is missing or under-granted.

    The lease functions are revoked from PUBLIC: a declared role without its grants fails every
    lease call with "permission denied". ``migrate`` grants them; a role created after it, or a
    grant revoked by hand, needs ``manage.py leases grant``.
    """
    from pg_lease_django import conf
    from pg_lease_django.provisioning import privileges

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        if connections[alias].vendor != "postgresql":
            continue
        try:
            if not privileges.installed(alias):
                continue  # W002/W004/W007 say why
            with transaction.atomic(using=alias):
                absent, lacking = privileges.missing(alias)
        except DatabaseError as exc:
            warnings.append(unread(alias, "which privileges the declared lease roles hold", exc))
            continue
        wanted = conf.key_scopes()
        try:
            with transaction.atomic(using=alias):  # a refused read must not break the checks' connection
                stored = privileges.stored_key_scopes(alias)
        except DatabaseError:
            stored = None  # only the owner may read them: its check and migrate compare them, not this seat's
        for role in privileges.absent_roles(sorted(wanted), alias):
            warnings.append(
                checks.Warning(
                    f"PG_LEASE_KEY_SCOPES names role {role!r}, which does not exist in database {alias!r}'s cluster: "
                    "its scope limits nobody (a renamed role keeps no scope).",
                    hint="Fix the role name in PG_LEASE_KEY_SCOPES, then run: manage.py leases grant",
                    id="pg_lease_django.W008",
                )
            )
        if stored is not None and stored != wanted:
            warnings.append(
                checks.Warning(
                    f"database {alias!r} enforces the key scopes {stored!r}, but PG_LEASE_KEY_SCOPES is {wanted!r}.",
                    hint=f"Run, as the lease functions' owner: manage.py leases grant --database {alias}",
                    id="pg_lease_django.W008",
                )
            )
        try:
            with transaction.atomic(using=alias):  # a refused read must not break the checks' connection
                extra = privileges.undeclared(alias)
        except DatabaseError as exc:
            extra = []
            warnings.append(unread(alias, "which roles hold lease privileges", exc))
        for role in sorted({g.role for g in extra}):
            held = [g for g in extra if g.role == role]
            objects = [f"{g.privilege} on {g.object}{' WITH GRANT OPTION' if g.grantable else ''}" for g in held]
            warnings.append(
                checks.Warning(
                    f"role {role!r} holds lease privileges in database {alias!r} that PG_LEASE_WORKER_ROLES, "
                    f"PG_LEASE_OPERATOR_ROLES and PG_LEASE_MONITOR_ROLES do not give it (or may pass them on): "
                    f"{', '.join(objects[:3])}{', ...' if len(objects) > 3 else ''}.",
                    hint="Declare the role (or make it a member of a declared role) if it should hold them; else "
                    f"revoke them: {held[0].revoke()}; ... (manage.py leases grant --check lists them all).",
                    id="pg_lease_django.W008",
                )
            )
        warnings += around_the_rules(alias)
        for role in absent:
            warnings.append(
                checks.Warning(
                    f"declared lease role {role!r} does not exist in database {alias!r}'s cluster.",
                    hint=f"CREATE ROLE {role} (docs/security.md), then run: manage.py leases grant --database {alias}",
                    id="pg_lease_django.W008",
                )
            )
        for role in sorted({g.role for g in lacking}):
            objects = [f"{g.privilege} on {g.object}" for g in lacking if g.role == role]
            warnings.append(
                checks.Warning(
                    f"declared lease role {role!r} lacks {len(objects)} privileges in database {alias!r}: "
                    f"{', '.join(objects[:3])}{', ...' if len(objects) > 3 else ''}.",
                    hint=f"Run, as the lease functions' owner: manage.py leases grant --database {alias}",
                    id="pg_lease_django.W008",
                )
            )
    return warnings


def around_the_rules(alias: str) -> list[checks.CheckMessage]:
    """W008 / E006: what PostgreSQL's privilege model lets a role do around the lease rules.

    It names parameter grants on ``session_replication_role``, and memberships of
    ``pg_read_all_data``, ``pg_write_all_data`` and ``pg_maintain``. It names BYPASSRLS with a way
    to the secret, which is E006. It names roles that may call the lease functions with no key scope
    while scopes are configured, E006 too: every call of theirs is refused. Each comes with the
    remedy that removes it.
    """
    from pg_lease_django.provisioning import privileges

    found: list[privileges.Bypass] = []
    try:
        with transaction.atomic(using=alias):
            found += privileges.bypasses(alias)
    except DatabaseError as exc:
        return [unread(alias, "which roles may get around the lease rules", exc)]
    try:
        with transaction.atomic(using=alias):
            found += privileges.unscoped(alias)
    except DatabaseError:
        pass  # no SELECT on the key scope table: the scope comparison above already says so when scopes are set
    return [
        (checks.Error if bypass.error else checks.Warning)(
            f"database {alias!r}: role {bypass.role!r} {bypass.what}.",
            hint=bypass.remedy,
            id="pg_lease_django.E006" if bypass.error else "pg_lease_django.W008",
        )
        for bypass in found
    ]


def check_owner_is_not_a_superuser(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W008: roles are declared, and the lease tables' owner is a superuser (``check --database``).

    The lease functions are SECURITY DEFINER: they run as their owner. A deployment that declares
    seats in ``PG_LEASE_*_ROLES`` means the owner to be a role of its own, as docs/security.md
    says. A ``migrate`` run as a superuser made every function run as one. A project that declares
    no role is not told: one role does everything there, as in development.
    """
    from pg_lease_django.provisioning import privileges

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or not privileges.declared():
            continue
        try:
            relation = f"{run.schema(connection)}.pg_lease_django_lease"
            superuser = run.first(connection, statements.SUPERUSER_OWNER, relation=relation)
        except (DatabaseError, ImproperlyConfigured):
            continue  # not migrated: W002/W004/W007 say so
        if superuser is not None:
            warnings.append(
                checks.Warning(
                    f"database {alias!r}: the lease tables and functions are owned by superuser {superuser!r} "
                    "(migrate ran as it): their SECURITY DEFINER functions run as a superuser.",
                    hint="Migrate as an owner role that is not a superuser (docs/security.md, app_owner): on a "
                    "fresh database, or move these with ALTER TABLE / ALTER FUNCTION ... OWNER TO that role.",
                    id="pg_lease_django.W008",
                )
            )
    return warnings


# ---- plain `check`: the lease database's checks, when that database answers at once ------------

#: The longest wait (seconds) of plain ``check`` for the lease database before it says nothing.
PROBE_CONNECT_TIMEOUT = 2


def check_lease_database_without_database_option(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W007: the lease database is not migrated; in plain ``check``, also W002, W004-W006, W008.

    Django runs database checks only for ``check --database`` and ``migrate``. So a plain
    ``check`` said "no issues" on a database without the lease tables, or after
    ``PG_LEASE_HISTORY`` changed; so did ``runserver``, ``makemigrations`` and every command that
    runs the checks. This check runs when no ``databases`` are given, and only then. With them,
    W002-W006 run themselves, and ``migrate`` is the cure for W007. If Django's connection to the
    lease database is not open yet, a connection of its own must open within
    `PROBE_CONNECT_TIMEOUT` seconds, or the check says nothing. That is a build step without a
    database, or a server still starting. Then the lease database's checks run on Django's
    connection, which is closed again if they opened it.
    """
    if databases is not None:
        return []
    alias = router.db_for_write(apps.get_model("pg_lease_django", "Lease"))
    connection = connections[alias]
    opened = connection.connection is None
    if connection.vendor != "postgresql" or (opened and not _answers_at_once(connection)):
        return []
    try:
        recorded = recorded_migrations(connection)
        if recorded is None:
            return []  # a seat that may not read django_migrations: the owner's check says it
        if not recorded:
            return [
                checks.Warning(
                    f"database {alias!r} holds no lease tables: pg_lease_django is not migrated there, so every "
                    "lease call and `manage.py leases` will fail.",
                    hint=f"Run: manage.py migrate pg_lease_django --database {alias} (or a plain migrate).",
                    id="pg_lease_django.W007",
                )
            ]
        found: list[checks.CheckMessage] = []
        for check in (
            check_lease_table_is_reachable,
            check_lease_migrations_are_complete,
            check_history_scope_is_current,
            check_fence_triggers_are_current,
            check_declared_roles_are_granted,
            check_owner_is_not_a_superuser,
        ):
            found += check(app_configs, databases=[alias])
        return found
    except DatabaseError:
        return []  # `check --database` runs the same checks and lets the error through
    finally:
        if opened and not connection.in_atomic_block:
            connection.close()


def _answers_at_once(connection: Any) -> bool:
    """Whether a connection with ``connection``'s settings opens within `PROBE_CONNECT_TIMEOUT` seconds."""
    import psycopg

    try:
        params = connection.get_connection_params()
    except ImproperlyConfigured:
        return False  # Django says so at the first query
    timeout = int(params.get("connect_timeout") or PROBE_CONNECT_TIMEOUT)
    params["connect_timeout"] = max(1, min(timeout, PROBE_CONNECT_TIMEOUT))
    try:
        psycopg.connect(**params).close()
    except psycopg.Error:
        return False
    return True
