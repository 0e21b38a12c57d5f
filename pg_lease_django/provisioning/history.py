"""Which keys the database records the tenures of: ``PG_LEASE_HISTORY``, copied into the database.

The lease table's history triggers in ``sql/schema.sql`` record a tenure when its key starts with a
prefix listed in ``pg_lease_django_history_scope``, whoever sends the statement, so the setting
lives in the database too. ``migrate`` copies it there through a ``post_migrate`` receiver. Check
``pg_lease_django.W005``, run by ``check --database``, says when a database's copy differs from the
setting.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, router, transaction

from pg_lease_django import conf, seats
from pg_lease_django.sql import run, statements

HISTORY_SCOPE_TABLE = "pg_lease_django_history_scope"


def _has_scope_table(using: str) -> bool:
    """Whether database ``using`` has the history scope table (migrated that far)."""
    connection = connections[using]
    try:
        schema = run.schema_name(connection)
    except ImproperlyConfigured:
        return False  # no lease table: not migrated (or migrated to zero)
    return bool(run.one(connection, statements.RELATION_EXISTS, namespace=schema, relation=HISTORY_SCOPE_TABLE))


def recorded_prefixes(using: str = DEFAULT_DB_ALIAS) -> tuple[str, ...] | None:
    """The key prefixes database ``using`` records the tenures of, sorted; None when it cannot record any."""
    if not _has_scope_table(using):
        return None
    return tuple(run.rows(connections[using], statements.HISTORY_SCOPE))


def sync_scope(using: str = DEFAULT_DB_ALIAS) -> tuple[str, ...]:
    """Make database ``using`` record the keys ``PG_LEASE_HISTORY`` names, from the next transition on.

    ``migrate`` calls it. Call it yourself after changing the setting without migrating, as tests do.

    Raises:
        ImproperlyConfigured: the setting is invalid, or the database has no lease table.
        RuntimeError: the database is not migrated far enough to record history.
    """
    prefixes = conf.history_prefixes()
    if not _has_scope_table(using):
        raise RuntimeError(
            f"database {using!r} cannot record lease history: "
            f"run `manage.py migrate pg_lease_django --database {using}`"
        )
    if set(recorded_prefixes(using) or ()) == set(prefixes):
        # Nothing to change, so nothing written: a write of the scope table waits for every brand-new
        # key in flight (pg_lease_rescope), and a migrate with nothing to do must not.
        return prefixes
    with transaction.atomic(using=using):
        run.run(connections[using], statements.HISTORY_SCOPE_KEEP, prefixes=list(prefixes))
        run.run(connections[using], statements.HISTORY_SCOPE_ADD, prefixes=list(prefixes))
    return prefixes


def sync_after_migrate(using: str = DEFAULT_DB_ALIAS, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: copy the setting into each database the lease app is migrated in.

    When that changes what the database records, ``migrate`` says so (verbosity 1 and up): its own
    "No migrations to apply" would leave a changed ``PG_LEASE_HISTORY`` looking ignored.
    """
    from pg_lease_django.models import Lease

    if not router.allow_migrate_model(using, Lease) or not _has_scope_table(using):
        return
    stdout = kwargs.get("stdout") or sys.stdout
    try:
        before = recorded_prefixes(using)
        after = sync_scope(using)
    except DatabaseError as exc:  # a role that may migrate Django's tables, not the lease app's
        if not seats.denied(exc):
            raise
        stdout.write(f"  pg_lease_django: history scope not synced: {seats.remedy(using, 'migrate')}\n")
        return
    if verbosity >= 1 and before != after:
        stdout.write(
            f"  pg_lease_django: database {using!r} now records the lease history of keys starting with "
            f"{list(after)!r} (PG_LEASE_HISTORY; it recorded {list(before or ())!r})\n"
        )
