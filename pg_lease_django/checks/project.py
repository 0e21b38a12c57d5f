"""System checks of the project: fenced models, their admins, the lease database's engine, the metrics settings."""

from __future__ import annotations

from typing import Any, cast

from django.apps import apps
from django.core import checks
from django.db import connections, router


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
    from pg_lease_django.fencing import FencedModel

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
    from pg_lease_django.fencing import FencedModel

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
    """pg_lease_django.W009 / E004: a per-row lease key the database cannot derive, or a bad declaration.

    A model can declare its key with ``lease_key_expression`` or a class-level ``lease_key``. The
    database then derives it for every row, whoever writes it: no writer can store a row whose
    fields say one lease and whose key says another. A model that only overrides
    ``get_lease_key()`` stores the key each writer computes. The database checks that key but
    cannot derive it, and W009 says so.
    """
    from pg_lease_django.fencing import FencedModel
    from pg_lease_django.fencing.lease_key import key_fields

    configs = apps.get_app_configs() if app_configs is None else app_configs
    found: list[checks.CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel) or model._meta.proxy:
                continue
            fenced = cast("type[FencedModel]", model)
            names = {f.name for f in fenced._meta.get_fields()} | {f.attname for f in fenced._meta.concrete_fields}
            unknown = sorted(name for name in key_fields(fenced) if name not in names)
            if unknown or (fenced.lease_key_expression is not None and fenced.lease_key is not None):
                what = (
                    f"names {', '.join(unknown)}, not fields of the model"
                    if unknown
                    else "is declared beside a class-level lease_key"
                )
                found.append(
                    checks.Error(
                        f"{model._meta.label}'s lease key declaration {what}.",
                        hint='Declare one key: lease_key = "..." for the whole table, or lease_key_expression = '
                        'F("field") (or a Concat of fields and values) for a key per row.',
                        obj=model,
                        id="pg_lease_django.E004",
                    )
                )
            elif fenced.lease_key_expression is None and fenced.lease_key is None:
                found.append(
                    checks.Warning(
                        f"{model._meta.label} computes its lease key in Python (get_lease_key()) without declaring "
                        "it: the database checks the key each writer stores but cannot derive it, so a writer "
                        "with a fence of its own can store rows whose fields name another lease.",
                        hint='Declare lease_key_expression = F("account") (or a Concat of fields and values) to '
                        "what get_lease_key() returns, then run makemigrations and migrate: the database derives "
                        "every row's key from then on (docs/fencing.md).",
                        obj=model,
                        id="pg_lease_django.W009",
                    )
                )
    return found


def check_fenced_many_to_many(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """pg_lease_django.W003: a FencedModel's many-to-many field whose rows are not fenced.

    Its ``through`` table, Django's automatic one or a plain model, has no fence trigger. So adding
    or removing relations, as ``obj.tags.add()`` does, is not guarded by the lease.
    """
    from pg_lease_django.fencing import FencedModel

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

    from pg_lease_django.admin import FencedModelAdmin
    from pg_lease_django.fencing import FencedModel

    return [
        checks.Warning(
            f"{model._meta.label} is a FencedModel registered in the admin with {type(model_admin).__name__}, "
            "which writes without a fence: adding, changing and deleting rows there will fail.",
            hint="Register it with pg_lease_django.admin.FencedModelAdmin (writes become recorded opt-outs).",
            obj=model,
            id="pg_lease_django.W001",
        )
        for model, model_admin in admin.site._registry.items()  # noqa: SLF001 (AdminSite lists its registrations nowhere else)
        if issubclass(model, FencedModel) and not isinstance(model_admin, FencedModelAdmin)
    ]


def check_metrics_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E005: a metrics setting is invalid (``PG_LEASE_METRICS_KEY_LABEL``, ``_MAX_LABELS``, ``_PUSHGATEWAY``):
    the metrics are not registered until it is fixed."""
    from django.core.exceptions import ImproperlyConfigured

    from pg_lease_django import conf

    hints = {
        conf.metrics_key_label: 'Use one character (e.g. ":"), a callable f(key) -> str, or the dotted path of one',
        conf.metrics_max_labels: "Use a positive int (the default is 16)",
        conf.metrics_pushgateway: "Use the Pushgateway's http(s) URL, or None",
    }
    found: list[checks.CheckMessage] = []
    for read, hint in hints.items():
        try:
            read()
        except ImproperlyConfigured as exc:
            advice = f"{hint}; the metrics are not registered until it is fixed."
            found.append(checks.Error(str(exc), hint=advice, id="pg_lease_django.E005"))
    return found


def check_operators_are_not_tenants(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """W008: a role of ``PG_LEASE_OPERATOR_ROLES`` has a tenant's key scope (a list of prefixes); a
    role of ``PG_LEASE_ROLE_LIMITS`` has no key scope of its own.

    Operators read the lease and history tables, which key scopes do not cover: a tenant's group
    declared an operator lets each of its members read every tenant's keys, holders and epochs. A
    limit counts the keys under the limited role's own scope prefixes: set on a login member whose
    scope is its group's, it limits nothing.
    """
    from django.core.exceptions import ImproperlyConfigured

    from pg_lease_django import conf

    try:
        scopes, operators, limits = conf.key_scopes(), conf.operator_roles(), conf.role_limits()
    except ImproperlyConfigured:
        return []  # the settings' own checks say why
    unscoped: list[checks.CheckMessage] = [
        checks.Warning(
            f"PG_LEASE_ROLE_LIMITS limits role {role!r}, which has no key scope of its own in PG_LEASE_KEY_SCOPES: "
            "a limit counts the keys under the limited role's own prefixes, so this one limits nothing (a login "
            "member's keys are under its group's scope).",
            hint=f"Set the limit on the role whose scope {role!r} uses (its group role), then run, as the owner: "
            "manage.py leases grant",
            id="pg_lease_django.W008",
        )
        for role in limits
        if role not in scopes
    ]
    return unscoped + [
        checks.Warning(
            f"role {role!r} is declared an operator (PG_LEASE_OPERATOR_ROLES) and has a tenant's key scope "
            f"{list(scopes[role])!r}: operators read every tenant's leases and history (keys, holders, epochs), "
            "which key scopes do not cover, so each of its members would.",
            hint=f"Remove {role!r} from PG_LEASE_OPERATOR_ROLES (an operator is a role of its own, listed with "
            f'"*" in PG_LEASE_KEY_SCOPES), then run, as the owner: manage.py leases grant --check, and the '
            "REVOKE lines it prints.",
            id="pg_lease_django.W008",
        )
        for role in operators
        if scopes.get(role, ("",)) != ("",)
    ]
