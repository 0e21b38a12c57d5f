"""Every SQL call the package sends, written once: schema-qualified, each argument cast.

Qualifying and casting closes the lookalike hole: PostgreSQL resolves an unqualified call to an
exact-type match anywhere on the search_path before a function that needs a cast, so a role that
may CREATE in an earlier (or the same) schema could otherwise answer for ``pg_lease_fence``.
The schema is the one the lease table lives in (where the migrations installed the functions).
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import BaseDatabaseWrapper

from . import conf

ACQUIRE = "SELECT * FROM {schema}.pg_lease_acquire(%s::text, %s::text, %s::interval)"
RENEW = "SELECT * FROM {schema}.pg_lease_renew(%s::text, %s::text, %s::bigint, %s::interval)"
RELEASE = "SELECT * FROM {schema}.pg_lease_release(%s::text, %s::text, %s::bigint)"
INSPECT = "SELECT * FROM {schema}.pg_lease_inspect(%s::text)"
FORCE_RELEASE = "SELECT * FROM {schema}.pg_lease_force_release(%s::text, %s::bigint)"
#: Present a fence for this transaction (raises PL001-PL003 when it does not hold); returns the epoch.
CHECK_FENCE = "{schema}.pg_lease_check_fence(%s::text, %s::text, %s::bigint)"
#: Opt this transaction out of fencing (operators: revoked from PUBLIC).
ALLOW_UNFENCED = "SELECT {schema}.pg_lease_allow_unfenced()"
#: End an opt-out before the transaction does (a built-in: nothing to qualify).
END_UNFENCED = "SELECT pg_catalog.set_config('pg_lease.unfenced', 'off', true)"

# The lease table's schema per database alias, looked up once per process (one catalog query).
_schemas: dict[str, str] = {}

_LOOKUP = (
    "SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = pg_catalog.to_regclass('pg_lease_django_lease')"
)


def schema(connection: BaseDatabaseWrapper) -> str:
    """The quoted schema of the lease functions in ``connection``'s database.

    ``PG_LEASE_SCHEMA`` names it outright; otherwise it is where ``pg_lease_django_lease`` resolves.

    Raises:
        ImproperlyConfigured: the lease table does not exist there (the app is not migrated).
    """
    name = conf.schema() or _schemas.get(connection.alias)
    if name is None:
        with connection.cursor() as cursor:
            cursor.execute(_LOOKUP)
            row = cursor.fetchone()
        if row is None:
            raise ImproperlyConfigured(
                f"database {connection.alias!r} has no lease table (pg_lease_django_lease): "
                f"run `manage.py migrate pg_lease_django --database {connection.alias}`"
            )
        name = _schemas[connection.alias] = row[0]
    return connection.ops.quote_name(name)


def render(connection: BaseDatabaseWrapper, template: str) -> str:
    """``template`` with ``{schema}`` filled in for ``connection``."""
    return template.format(schema=schema(connection))
