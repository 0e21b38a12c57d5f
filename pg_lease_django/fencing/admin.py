"""`FencedModelAdmin`: the admin of a fenced model, its writes recorded opt-outs.

Re-exported by `pg_lease_django.admin`, the path the documentation names; not imported by
`pg_lease_django.fencing` itself, so that fencing a model loads no admin.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.models import DELETION, LogEntry
from django.db.models import QuerySet
from django.http import HttpRequest

from .resolution import unfenced_writes

__all__ = ["UNFENCED_NOTE", "FencedModelAdmin"]

#: What the admin records in each LogEntry of a fenced row it wrote.
UNFENCED_NOTE = "Unfenced write from the admin (no lease held)."


class FencedModelAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """ModelAdmin for a `FencedModel`: adding, changing and deleting rows works, as explicit opt-outs.

    An admin user is no lease holder. So every write the admin makes runs under `unfenced_writes`:
    add, change, delete, "Delete selected" and inlines. That is a transaction that calls
    ``pg_lease_allow_unfenced()`` first, which the database lets only granted roles do; see
    docs/security.md. Each LogEntry says so with ``UNFENCED_NOTE``, so the history shows which writes
    bypassed the fence. A plain ``ModelAdmin`` on a fenced model fails on every write, and system check
    ``pg_lease_django.W001`` says so.
    """

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Save as a recorded opt-out."""
        with unfenced_writes():
            super().save_model(request, obj, form, change)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """Inline rows (fenced models too) as recorded opt-outs."""
        with unfenced_writes():
            super().save_formset(request, form, formset, change)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        """Delete as a recorded opt-out."""
        with unfenced_writes():
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """ "Delete selected" as a recorded opt-out."""
        with unfenced_writes():
            super().delete_queryset(request, queryset)

    def construct_change_message(self, request: HttpRequest, form: Any, formsets: Any, add: bool = False) -> Any:
        """Django's description of the change, then ``UNFENCED_NOTE``."""
        described = LogEntry(change_message=json.dumps(super().construct_change_message(request, form, formsets, add)))
        return f"{described.get_change_message()} {UNFENCED_NOTE}".strip()

    def log_deletions(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        """Django's deletion entries, each carrying ``UNFENCED_NOTE``."""
        assert request.user.pk is not None  # the admin has a logged-in user
        return LogEntry.objects.log_actions(
            user_id=request.user.pk, queryset=queryset, action_flag=DELETION, change_message=UNFENCED_NOTE
        )
