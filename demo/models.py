"""The demo's guarded resource: a counter only the current lease holder may write."""

from __future__ import annotations

from django.db import models

from pg_lease_django.fencing import FencedModel


class JobCounter(FencedModel):
    """Incremented once per unit of work, read -> work -> fenced write, by whoever holds the lease."""

    lease_key = "demo:nightly-report"

    name = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}={self.value}"
