"""A Django 6 task under a lease, for tests/db/test_jobs.py (imported only where django.tasks exists)."""

from __future__ import annotations

from django.tasks import task

from pg_lease_django import current_lease, leased


@task
@leased("{key}:add", ttl=5)
def add_under_lease(a: int, b: int, *, key: str) -> list[object]:
    """Add two numbers while holding ``<key>:add``; report whether the lease was current."""
    lease = current_lease()
    return [a + b, lease is not None and lease.key == f"{key}:add"]
