"""Fencing: rows the database refuses to write for a holder that lost its lease.

The refusal happens in PostgreSQL, for every writer. Each fenced table carries triggers,
`FenceTrigger`, installed by the migration ``makemigrations`` writes. Once per statement they check
every lease key the statement writes or removes against the fence its transaction presented with
``pg_lease_check_fence``; see ``sql/schema.sql``. Python only presents the right fence in the right
statement.

A fence presented in a transaction locks its lease row FOR KEY SHARE until the transaction ends:
the holder's renewals go on, while a takeover or a release waits. Deliberately unfenced writes opt
the transaction out with ``pg_lease_allow_unfenced()``, which the database lets only granted roles
do.

The rooms, each importing only those before it:

- `resolution`: which lease guards a write, in `resolve_fence` and `unfenced_writes`. It reads the
  holds of this thread from `pg_lease_django.holds.context`, and nothing else of ``holds/``;
- `schema`: what a fenced table carries, `LeaseKeyField` and `FenceTrigger`;
- `statements`: the fence inside Django's own statement, and the database's refusal as an error;
- `lease_key`: a model's lease key read in Python, the fields it is made of and its value for a row;
- `queryset`: `FencedQuerySet` and `FencedManager`;
- `model`: `FencedModel`, which gives every fenced table its triggers as Django prepares the class;
- `admin`: `FencedModelAdmin`. `pg_lease_django.admin` re-exports it; it is not imported here.

Users' code and migrations import every public name from this package: migrations record
``pg_lease_django.fencing.LeaseKeyField`` and ``pg_lease_django.fencing.FenceTrigger``.
"""

from __future__ import annotations

from .model import FencedModel
from .queryset import FencedManager, FencedQuerySet
from .resolution import Fence, resolve_fence, unfenced_writes
from .schema import FenceTrigger, LeaseKeyField

__all__ = [
    "Fence",
    "FenceTrigger",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "LeaseKeyField",
    "resolve_fence",
    "unfenced_writes",
]
