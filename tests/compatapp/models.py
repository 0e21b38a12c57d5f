"""Fenced models that also carry django-pghistory and django-pgtrigger triggers of their own.

Both libraries talk to their triggers by prefixing the SQL Django sends (``pghistory.context()``,
``pgtrigger.ignore()``: an execute wrapper adds ``SELECT set_config(...);`` to each statement), so
fenced writes must not depend on the SQL text they produce.
"""

from __future__ import annotations

import pghistory
import pgtrigger
from django.db import models

from pg_lease_django.fencing import FencedModel

#: The one lease guarding every Vault row.
VAULT_KEY = "compat-vault"


@pghistory.track(pghistory.InsertEvent(), pghistory.UpdateEvent(), pghistory.DeleteEvent())
class Ledger(FencedModel):
    """Guarded by one lease per account (``get_lease_key``); every insert, update and delete
    is an event (pghistory triggers), recorded with the ``pghistory.context()`` it ran in."""

    account = models.CharField(max_length=200)
    balance = models.IntegerField(default=0)

    lease_key_fields = ("account",)

    def get_lease_key(self) -> str:
        return self.account


class Vault(FencedModel):
    """Guarded by one lease for the whole table; pgtrigger refuses deletes unless ignored."""

    lease_key = VAULT_KEY

    label = models.CharField(max_length=200)

    class Meta:
        triggers = [pgtrigger.Protect(name="protect_deletes", operation=pgtrigger.Delete)]
