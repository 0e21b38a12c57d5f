"""The admin: leases and their history, read-only, two guarded writes, and `FencedModelAdmin` for fenced models.

Django's autodiscover imports this module. The modules, lowest first; each imports only those
before it, and tests/structure/test_import_graph.py checks it:

- `cells`: how a cell shows others' text and server times. Text is escaped through `printable`,
  since a bidi override or a control character survives HTML escaping. Times are UTC, to the
  millisecond.
- `usage`: the snippets of "how to use this key", an unusual key spelled with escapes each
  language reads back exactly.
- `writes`: the two writes, force release and hand-off requests, each at the epoch the user saw,
  reported and logged.
- `lease`: `LeaseAdmin` and its `StateFilter`: what a lease's pages show and offer.
- `tenure`: `LeaseTenureAdmin`, the recorded tenures.

This module registers both by importing them. It re-exports `FencedModelAdmin` from
`pg_lease_django.fencing.admin`: ``from pg_lease_django.admin import FencedModelAdmin`` is the path
the documentation names.
"""

from pg_lease_django.fencing.admin import UNFENCED_NOTE, FencedModelAdmin

from .lease import LeaseAdmin, StateFilter
from .tenure import LeaseTenureAdmin

__all__ = ["UNFENCED_NOTE", "FencedModelAdmin", "LeaseAdmin", "LeaseTenureAdmin", "StateFilter"]
