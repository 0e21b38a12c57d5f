"""System checks: configurations under which leases cannot keep their promises.

`project` checks the code and settings: fenced models, their admins, the engine, the metrics
settings. `database` reads the lease database, for ``check --database``, and for plain ``check``
when the database answers at once.
"""

from __future__ import annotations

from django.core import checks

from pg_lease_django.checks.database import (
    PROBE_CONNECT_TIMEOUT,
    check_declared_roles_are_granted,
    check_fence_triggers_are_current,
    check_history_scope_is_current,
    check_lease_database_without_database_option,
    check_lease_migrations_are_complete,
    check_lease_table_is_reachable,
    check_owner_is_not_a_superuser,
)
from pg_lease_django.checks.project import (
    check_database_is_postgresql,
    check_fenced_many_to_many,
    check_fenced_models_declare_their_key_fields,
    check_fenced_models_have_a_fenced_admin,
    check_fenced_models_have_fenced_parents,
    check_fenced_models_share_the_lease_database,
    check_metrics_settings,
    check_operators_are_not_tenants,
)

__all__ = [
    "PROBE_CONNECT_TIMEOUT",
    "check_database_is_postgresql",
    "check_declared_roles_are_granted",
    "check_fence_triggers_are_current",
    "check_fenced_many_to_many",
    "check_fenced_models_declare_their_key_fields",
    "check_fenced_models_have_a_fenced_admin",
    "check_fenced_models_have_fenced_parents",
    "check_fenced_models_share_the_lease_database",
    "check_history_scope_is_current",
    "check_lease_database_without_database_option",
    "check_lease_migrations_are_complete",
    "check_lease_table_is_reachable",
    "check_metrics_settings",
    "check_operators_are_not_tenants",
    "check_owner_is_not_a_superuser",
    "register",
    "register_without_database_option",
]


def register() -> None:
    checks.register(check_database_is_postgresql, checks.Tags.compatibility)
    checks.register(check_metrics_settings)
    checks.register(check_operators_are_not_tenants)
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
    checks.register(check_owner_is_not_a_superuser, checks.Tags.database)


def register_without_database_option() -> None:
    """Register W007 (no tag: it runs in plain ``check``, unlike the ``database``-tagged ones)."""
    checks.register(check_lease_database_without_database_option)
