"""Models for the fencing tests: a per-row lease key, a class-level one, and a write history."""

from __future__ import annotations

from django.db import models

from pg_lease_django.fencing import FencedModel


class Invoice(FencedModel):
    """Guarded by one lease per account, which the database derives (``lease_key_expression``)."""

    account = models.CharField(max_length=200)
    status = models.CharField(max_length=20, default="draft")
    amount = models.IntegerField(default=0)

    lease_key_expression = models.F("account")


class Report(FencedModel):
    """Guarded by one lease for the whole table (``lease_key``)."""

    lease_key = "testapp-reports"

    title = models.CharField(max_length=100)


class Entry(FencedModel):
    """An append-only history of fenced inserts; ``ticket`` orders them as they committed."""

    account = models.CharField(max_length=200)
    writer = models.CharField(max_length=20)
    ticket = models.BigIntegerField(null=True)

    lease_key_expression = models.F("account")


class CommitTicket(models.Model):
    """One row whose counter a transaction bumps last: its row lock hands tickets out in commit order."""

    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.value)


class CreditNote(Invoice):
    """A multi-table child of a fenced model: its own table, guarded through its parent's lease key."""

    reason = models.CharField(max_length=100, default="")


class ArchivedReport(Report):
    """A proxy of a fenced model: same table, same triggers."""

    class Meta:
        proxy = True
