"""Every SQL call the package sends, written once: schema-qualified, each argument cast.

Qualifying and casting closes the lookalike hole: PostgreSQL resolves an unqualified call to an
exact-type match anywhere on the search_path before a function that needs a cast, so a role that
may CREATE in an earlier (or the same) schema could otherwise answer for ``pg_lease_fence``.
The schema is the one the lease table lives in (where the migrations installed the functions).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db.backends.base.base import BaseDatabaseWrapper
from django.dispatch import receiver

from pg_lease_django import conf

ACQUIRE = "SELECT * FROM {schema}.pg_lease_acquire(%s::text, %s::text, %s::interval)"
#: A waiter's attempt while it LISTENs: ACQUIRE, and when refused, a registration that makes the next
#: release of the key notify, until the waiter's next attempt is due (the last argument) plus a margin.
ACQUIRE_OR_REGISTER = (
    "SELECT * FROM {schema}.pg_lease_acquire_or_register(%s::text, %s::text, %s::interval, %s::interval)"
)
#: A renewal that also says whether a hand-off was requested (pg_lease_renew without that fourth column).
RENEW = "SELECT * FROM {schema}.pg_lease_heartbeat(%s::text, %s::text, %s::bigint, %s::interval)"
RELEASE = "SELECT * FROM {schema}.pg_lease_release(%s::text, %s::text, %s::bigint)"
#: The columns the package reads (acquired_at left out: one timestamp fewer to parse per call).
INSPECT = "SELECT key, status, owner, epoch, expires_at, server_time FROM {schema}.pg_lease_inspect(%s::text)"
FORCE_RELEASE = "SELECT * FROM {schema}.pg_lease_force_release(%s::text, %s::bigint, %s::text)"
#: Ask the holder to step down at its next renewal (advice: the grant is unchanged).
REQUEST_HANDOFF = "SELECT * FROM {schema}.pg_lease_request_handoff(%s::text, %s::bigint)"
PRUNE = "SELECT key FROM {schema}.pg_lease_prune(%s::interval, %s::boolean)"
#: Raise every epoch and the epoch floor by N (after an asynchronous failover; operators only).
ADVANCE_EPOCHS = "SELECT * FROM {schema}.pg_lease_advance_epochs(%s::bigint, %s::boolean)"
#: Present a fence for this transaction (raises PL001-PL003 when it does not hold); returns the epoch.
CHECK_FENCE = "{schema}.pg_lease_check_fence(%s::text, %s::text, %s::bigint)"
#: Opt this transaction out of fencing (operators: revoked from PUBLIC).
ALLOW_UNFENCED = "SELECT {schema}.pg_lease_allow_unfenced()"
#: Readiness: whether this role may run every function a worker needs (the app migrated, the grants
#: made), and the key prefixes it may use (NULL: every key; an empty array: none, every call refused).
READINESS = (
    "SELECT coalesce(pg_catalog.bool_and(pg_catalog.has_function_privilege(p.object, 'EXECUTE')), false), "
    "{schema}.pg_lease_session_scope() FROM {schema}.pg_lease_privileges() p "
    "WHERE p.role = 'worker' AND p.kind = 'FUNCTION'"
)
#: The database's view for Prometheus: counts by key label (separator, label cap, history on).
METRICS = "SELECT * FROM {schema}.pg_lease_metrics(%s::text, %s::integer, %s::boolean)"
#: End an opt-out before the transaction does (a built-in: nothing to qualify).
END_UNFENCED = "SELECT pg_catalog.set_config('pg_lease.unfenced', 'off', true)"

#: The channel release and force release notify, with the key as payload, when a waiter registered for the key
#: (ACQUIRE_OR_REGISTER); spelled in the migrations' SQL too.
NOTIFY_CHANNEL = "pg_lease_django"
#: What a blocking acquire waits on between attempts (outside a transaction).
LISTEN = f"LISTEN {NOTIFY_CHANNEL}"
UNLISTEN = f"UNLISTEN {NOTIFY_CHANNEL}"

# The lease table's schema per database alias, looked up once per process (one catalog query).
_schemas: dict[str, str] = {}

#: Every schema of the search_path holding a table of that name: more than one is ambiguous (one of
#: them may be a decoy another role created to capture the calls), so the lookup refuses to guess.
SCHEMA_LOOKUP = (
    "SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relname = 'pg_lease_django_lease' AND c.relkind IN ('r', 'p') "
    "AND n.nspname = ANY (pg_catalog.current_schemas(false))"
)


def schema(connection: BaseDatabaseWrapper) -> str:
    """The quoted schema of the lease functions in ``connection``'s database.

    ``PG_LEASE_SCHEMA`` names it outright; otherwise it is the one schema of the search_path that
    has the ``pg_lease_django_lease`` table, looked up once per database alias.

    Raises:
        ImproperlyConfigured: no schema of the search_path has the lease table (the app is not
            migrated), or several do (set ``PG_LEASE_SCHEMA``).
    """
    name = conf.schema() or _schemas.get(connection.alias)
    if name is None:
        with connection.cursor() as cursor:
            cursor.execute(SCHEMA_LOOKUP)
            found = [row[0] for row in cursor.fetchall()]
        if not found:
            raise ImproperlyConfigured(
                f"database {connection.alias!r} has no lease table (pg_lease_django_lease): "
                f"run `manage.py migrate pg_lease_django --database {connection.alias}`"
            )
        if len(found) > 1:
            raise ImproperlyConfigured(
                f"several schemas on the search_path of database {connection.alias!r} have a "
                f"pg_lease_django_lease table ({', '.join(sorted(found))}): set PG_LEASE_SCHEMA to the one "
                "`manage.py migrate` installed the lease functions in"
            )
        name = _schemas[connection.alias] = found[0]
    return connection.ops.quote_name(name)


# Rendered statements per (alias, template): a call renders nothing after its first.
_rendered: dict[tuple[str, str], str] = {}


@receiver(setting_changed)
def _forget_rendered(*, setting: str, **kwargs: Any) -> None:
    """``PG_LEASE_SCHEMA`` changed (``override_settings``): render again."""
    if setting == "PG_LEASE_SCHEMA":
        _rendered.clear()


def render(connection: BaseDatabaseWrapper, template: str) -> str:
    """``template`` with ``{schema}`` filled in for ``connection``."""
    statement = _rendered.get((connection.alias, template))
    if statement is None:
        statement = _rendered[connection.alias, template] = template.format(schema=schema(connection))
    return statement
