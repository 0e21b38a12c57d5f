"""System checks: configurations under which leases cannot keep their promises."""

from __future__ import annotations

from typing import Any

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
            hint="Route the pg_lease_django app to a PostgreSQL database (DATABASE_ROUTERS).",
            obj=lease,
            id="pg_lease_django.E001",
        )
    ]


def register() -> None:
    checks.register(check_database_is_postgresql, checks.Tags.compatibility)
