"""System checks: configurations under which leases cannot keep their promises."""

from __future__ import annotations

from typing import Any, cast

from django.apps import apps
from django.core import checks
from django.db import DatabaseError, connections, router, transaction


def check_database_is_postgresql(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.E001: the Lease table must live in PostgreSQL (its rules are SQL functions)."""
    lease = apps.get_model("pg_lease_django", "Lease")
    alias = router.db_for_write(lease)
    if connections[alias].vendor == "postgresql":
        return []
    return [
        checks.Error(
            f"Leases are routed to database {alias!r}, which is {connections[alias].vendor}, not PostgreSQL.",
            hint=(
                f"Use ENGINE 'django.db.backends.postgresql' for DATABASES[{alias!r}], or route the "
                "pg_lease_django app to a PostgreSQL database (DATABASE_ROUTERS)."
            ),
            obj=lease,
            id="pg_lease_django.E001",
        )
    ]


def check_fenced_models_share_the_lease_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.E002: a FencedModel must be written to the database that holds the leases.

    Its fence check runs inside its own write statement, against the lease table of that database.
    """
    from .fencing import FencedModel

    lease = apps.get_model("pg_lease_django", "Lease")
    lease_alias = router.db_for_write(lease)
    configs = apps.get_app_configs() if app_configs is None else app_configs
    errors: list[checks.CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel):
                continue
            alias = router.db_for_write(model)
            if alias != lease_alias:
                errors.append(
                    checks.Error(
                        f"{model._meta.label} is a FencedModel routed to database {alias!r}, "
                        f"but leases are routed to {lease_alias!r}: its fence could not see the leases.",
                        hint="Route the model and the pg_lease_django app to the same database (DATABASE_ROUTERS).",
                        obj=model,
                        id="pg_lease_django.E002",
                    )
                )
    return errors


def check_fenced_models_have_fenced_parents(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.E003: a FencedModel must not be a multi-table child of an unfenced model.

    The parent's table would hold some of the row's columns without a fence trigger (only tables
    of fenced models get one), so writes to those columns would not be guarded.
    """
    from .fencing import FencedModel

    configs = apps.get_app_configs() if app_configs is None else app_configs
    errors: list[checks.CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel):
                continue
            for parent in model._meta.get_parent_list():
                if not issubclass(parent, FencedModel):
                    errors.append(
                        checks.Error(
                            f"{model._meta.label} is a FencedModel whose multi-table parent {parent._meta.label} "
                            "is not: the parent's columns would be written without a fence.",
                            hint=f"Make {parent._meta.label} the FencedModel (its children are fenced too), "
                            "or make the parent abstract.",
                            obj=model,
                            id="pg_lease_django.E003",
                        )
                    )
    return errors


def check_fenced_models_declare_their_key_fields(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.W009 / E004: a per-row lease key whose fields are not declared, or not fields.

    ``Model.objects.fenced(g).update(tenant=...)`` cannot recompute the stored lease key; the
    queryset refuses it only for fields named in ``lease_key_fields``. Without them, such an
    update moves rows under another lease with one fence (the database checks the stored key).
    """
    from .fencing import FencedModel

    configs = apps.get_app_configs() if app_configs is None else app_configs
    found: list[checks.CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel) or model._meta.proxy:
                continue
            fenced = cast("type[FencedModel]", model)
            names = {f.name for f in fenced._meta.get_fields()}
            unknown = [name for name in fenced.lease_key_fields if name not in names]
            if unknown:
                found.append(
                    checks.Error(
                        f"{model._meta.label}.lease_key_fields names {', '.join(unknown)}, not fields of the model.",
                        hint="Name the fields get_lease_key() reads.",
                        obj=model,
                        id="pg_lease_django.E004",
                    )
                )
            elif fenced.get_lease_key is not FencedModel.get_lease_key and not fenced.lease_key_fields:
                found.append(
                    checks.Warning(
                        f"{model._meta.label} overrides get_lease_key() but declares no lease_key_fields: "
                        "a fenced update() of the fields it reads would move rows under another lease.",
                        hint="Set lease_key_fields = (...) to the fields get_lease_key() reads (docs/fencing.md).",
                        obj=model,
                        id="pg_lease_django.W009",
                    )
                )
    return found


def check_fenced_many_to_many(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.W003: a FencedModel's many-to-many field whose rows are not fenced.

    Its ``through`` table (Django's automatic one, or a plain model) has no fence trigger: adding or
    removing relations (``obj.tags.add()``) is not guarded by the lease.
    """
    from .fencing import FencedModel

    configs = apps.get_app_configs() if app_configs is None else app_configs
    warnings: list[checks.CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel):
                continue
            for field in model._meta.local_many_to_many:
                through = field.remote_field.through
                if isinstance(through, type) and issubclass(through, FencedModel):
                    continue
                label = through._meta.label if isinstance(through, type) else str(through)  # type: ignore[attr-defined]
                warnings.append(
                    checks.Warning(
                        f"{model._meta.label}.{field.name} is a many-to-many field of a FencedModel whose relation "
                        f"rows ({label}) are not fenced: a stale holder can still add or remove them.",
                        hint="Give it a through= model that is a FencedModel (with the same lease key), or keep the "
                        "relation out of what the lease guards.",
                        obj=model,
                        id="pg_lease_django.W003",
                    )
                )
    return warnings


def check_fenced_models_have_a_fenced_admin(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.W001: a FencedModel registered in the admin with a plain ModelAdmin.

    Its add, change and delete views would fail with UnfencedWriteError on every write.
    """
    if not apps.is_installed("django.contrib.admin"):
        return []
    from django.contrib import admin

    from .admin import FencedModelAdmin
    from .fencing import FencedModel

    return [
        checks.Warning(
            f"{model._meta.label} is a FencedModel registered in the admin with {type(model_admin).__name__}, "
            "which writes without a fence: adding, changing and deleting rows there will fail.",
            hint="Register it with pg_lease_django.admin.FencedModelAdmin (writes become recorded opt-outs).",
            obj=model,
            id="pg_lease_django.W001",
        )
        for model, model_admin in admin.site._registry.items()
        if issubclass(model, FencedModel) and not isinstance(model_admin, FencedModelAdmin)
    ]


def check_lease_table_is_reachable(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W002: migrated, yet no lease table on the search_path (``check --database``).

    A database not migrated yet is Django's own "unapplied migrations" notice (and the first lease
    call there names the ``migrate`` command); this catches the confusing case: the migrations are
    recorded as applied but the connection cannot see the table (another schema, a changed
    search_path, a restored dump without it).
    """
    from django.db.migrations.recorder import MigrationRecorder

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        recorder = MigrationRecorder(connection)
        if not recorder.has_table() or not any(app == "pg_lease_django" for app, _ in recorder.applied_migrations()):
            continue
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_catalog.to_regclass('pg_lease_django_lease') IS NOT NULL")
            (present,) = cursor.fetchone()
        if not present:
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

    ``migrate <your app>`` applies only the lease migrations your app depends on; later ones (new
    SQL functions the package calls) are nobody's dependency, so the first call that needs one fails
    with "function ... does not exist". A database with none applied is Django's own notice. A
    database that applied only some of the development migrations the baseline replaces cannot
    migrate at all: the warning says which are missing and how to finish them.
    """
    from django.db.migrations.exceptions import NodeNotFoundError
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.recorder import MigrationRecorder

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        recorder = MigrationRecorder(connection)
        recorded = {name for app, name in recorder.applied_migrations() if app == "pg_lease_django"}
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
    from . import conf, history

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

    The triggers' SQL is frozen per version (``FenceTrigger``'s ``version``, the triggers' comment):
    after an upgrade that changes it, ``makemigrations`` writes the migration that replaces them,
    and until it is applied the table keeps the old triggers. A table not created yet is Django's
    own unapplied-migrations notice.
    """
    from .fence_schema import FENCE_TRIGGER_VERSION, TRIGGER_NAMES, VERSION_COMMENT, FenceTrigger

    warnings: list[checks.CheckMessage] = []
    fenced = [
        model
        for model in apps.get_models()
        if any(isinstance(constraint, FenceTrigger) for constraint in model._meta.constraints)
    ]
    expected = VERSION_COMMENT.format(version=FENCE_TRIGGER_VERSION)
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        for model in fenced:
            if not router.allow_migrate_model(alias, model):
                continue
            with connection.cursor() as cursor:
                # One round trip: whether the table exists, and its fence triggers with their comments.
                cursor.execute(
                    "SELECT pg_catalog.to_regclass(%s) IS NOT NULL, pg_catalog.array_agg(t.tgname) FILTER (WHERE "
                    "t.oid IS NOT NULL), pg_catalog.array_agg(coalesce(pg_catalog.obj_description(t.oid, "
                    "'pg_trigger'), '')) FILTER (WHERE t.oid IS NOT NULL) FROM (SELECT 1) one "
                    "LEFT JOIN pg_catalog.pg_trigger t "
                    "ON t.tgrelid = pg_catalog.to_regclass(%s) AND t.tgname = ANY (%s)",
                    [connection.ops.quote_name(model._meta.db_table)] * 2 + [list(TRIGGER_NAMES)],
                )
                table_exists, names, comments = cursor.fetchone()
            installed = dict(zip(names or [], comments or [], strict=True))
            if not table_exists:
                continue
            stale = [name for name in TRIGGER_NAMES if installed.get(name) != expected]
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


def check_declared_roles_are_granted(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W008: a declared lease role (``PG_LEASE_*_ROLES``) is missing or under-granted.

    The lease functions are revoked from PUBLIC: a declared role without its grants fails every
    lease call with "permission denied". ``migrate`` grants them; a role created after it, or a
    grant revoked by hand, needs ``manage.py leases grant``.
    """
    from . import conf, privileges

    warnings: list[checks.CheckMessage] = []
    for alias in databases or ():
        if connections[alias].vendor != "postgresql":
            continue
        try:
            if not privileges.installed(alias):
                continue  # W002/W004/W007 say why
            absent, lacking = privileges.missing(alias)
        except DatabaseError:
            continue
        wanted = conf.key_scopes()
        try:
            with transaction.atomic(using=alias):  # a refused read must not break the checks' connection
                stored = privileges.stored_key_scopes(alias)
        except DatabaseError:
            stored = None
            if wanted:
                warnings.append(
                    checks.Warning(
                        f"database {alias!r}: this role may not read the key scopes the database enforces "
                        "(pg_lease_django_key_scope), so they could not be compared with PG_LEASE_KEY_SCOPES.",
                        hint=f"Run, as the lease functions' owner: manage.py leases grant --check --database {alias}",
                        id="pg_lease_django.W008",
                    )
                )
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
            extra = privileges.undeclared(alias)
        except DatabaseError:
            extra = []
        for role in sorted({g.role for g in extra}):
            objects = [f"{g.privilege} on {g.object}" for g in extra if g.role == role]
            warnings.append(
                checks.Warning(
                    f"role {role!r} holds lease privileges in database {alias!r} that PG_LEASE_WORKER_ROLES / "
                    f"PG_LEASE_OPERATOR_ROLES do not give it: {', '.join(objects[:3])}"
                    f"{', ...' if len(objects) > 3 else ''}.",
                    hint="Declare the role (as a worker or an operator), or revoke them: "
                    f"REVOKE EXECUTE ON FUNCTION ... FROM {role} (manage.py leases grant --check lists them).",
                    id="pg_lease_django.W008",
                )
            )
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


def check_metrics_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E005: ``PG_LEASE_METRICS_KEY_LABEL`` is neither one separator character nor a callable (or its path)."""
    from django.core.exceptions import ImproperlyConfigured

    from . import conf

    try:
        conf.metrics_key_label()
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                str(exc),
                hint='Use one character (e.g. ":"), a callable f(key) -> str, or the dotted path of one; '
                "the metrics are not registered until it is fixed.",
                id="pg_lease_django.E005",
            )
        ]
    return []


def register() -> None:
    checks.register(check_database_is_postgresql, checks.Tags.compatibility)
    checks.register(check_metrics_settings)
    checks.register(check_fenced_models_share_the_lease_database, checks.Tags.models)
    checks.register(check_fenced_models_have_fenced_parents, checks.Tags.models)
    checks.register(check_fenced_models_have_a_fenced_admin, checks.Tags.admin)
    checks.register(check_fenced_many_to_many, checks.Tags.models)
    checks.register(check_fenced_models_declare_their_key_fields, checks.Tags.models)
    checks.register(check_lease_table_is_reachable, checks.Tags.database)
    checks.register(check_lease_migrations_are_complete, checks.Tags.database)
    checks.register(check_history_scope_is_current, checks.Tags.database)
    checks.register(check_fence_triggers_are_current, checks.Tags.database)
    checks.register(check_declared_roles_are_granted, checks.Tags.database)


# ---- plain `check`: the lease database's checks, when that database answers at once ------------

#: The longest wait (seconds) of plain ``check`` for the lease database before it says nothing.
PROBE_CONNECT_TIMEOUT = 2


def check_lease_database_without_database_option(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """pg_lease_django.W007: the lease database is not migrated; in plain ``check``, also W002, W004-W006, W008.

    Django runs database checks only for ``check --database`` and ``migrate``, so a plain ``check``
    (and ``runserver``, ``makemigrations``, every command that runs the checks) said "no issues" on
    a database without the lease tables, or after ``PG_LEASE_HISTORY`` changed. This check runs
    when no ``databases`` are given, and only then (with them, W002-W006 run themselves, and
    ``migrate`` is the cure for W007): if Django's connection to the lease database is not open
    yet, a connection of its own must open within `PROBE_CONNECT_TIMEOUT` seconds, or the check
    says nothing (a build step without a database, a server still starting). Then the lease
    database's checks run on Django's connection, which is closed again if they opened it.
    """
    if databases is not None:
        return []
    alias = router.db_for_write(apps.get_model("pg_lease_django", "Lease"))
    connection = connections[alias]
    opened = connection.connection is None
    if connection.vendor != "postgresql" or (opened and not _answers_at_once(connection)):
        return []
    from django.db.migrations.recorder import MigrationRecorder

    try:
        recorder = MigrationRecorder(connection)
        if not recorder.has_table() or not any(app == "pg_lease_django" for app, _ in recorder.applied_migrations()):
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
    from django.core.exceptions import ImproperlyConfigured

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


def register_without_database_option() -> None:
    """Register W007 (no tag: it runs in plain ``check``, unlike the ``database``-tagged ones)."""
    checks.register(check_lease_database_without_database_option)
