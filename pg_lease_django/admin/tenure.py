"""The tenures' admin (`LeaseTenureAdmin`): the recorded history of every key, read-only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.http import HttpRequest
from django.utils.safestring import SafeString

from pg_lease_django.models import LeaseTenure

from .cells import utc, wrapping

__all__ = ["LeaseTenureAdmin"]

if TYPE_CHECKING:
    _TenureModelAdmin = admin.ModelAdmin[LeaseTenure]
else:  # ModelAdmin is generic only in django-stubs
    _TenureModelAdmin = admin.ModelAdmin


@admin.register(LeaseTenure)
class LeaseTenureAdmin(_TenureModelAdmin):
    """The recorded tenures, read-only: written by the database's triggers, deleted by ``prune-history``.

    Newest first, times in UTC to the millisecond. The ``ended at`` of a tenure still open says
    "open"; a lease's own page says whether it is held or lapsed (`pg_lease_django.timeline.read_history`).
    """

    list_display = (
        "key_display",
        "epoch",
        "owner_display",
        "granted_at_display",
        "ended_at_display",
        "end_reason",
        "ended_by_display",
    )
    list_display_links = ("key_display",)
    list_filter = ("end_reason",)
    search_fields = ("key", "owner", "ended_by")
    ordering = ("-granted_at",)
    list_per_page = 100
    show_full_result_count = False

    @admin.display(description="key", ordering="key")
    def key_display(self, obj: LeaseTenure) -> SafeString:
        """The key, broken anywhere when long."""
        return wrapping(obj.key)

    @admin.display(description="owner", ordering="owner")
    def owner_display(self, obj: LeaseTenure) -> SafeString:
        """The holder, broken anywhere when long."""
        return wrapping(obj.owner)

    @admin.display(description="granted", ordering="granted_at")
    def granted_at_display(self, obj: LeaseTenure) -> str:
        """The grant's time, UTC, to the millisecond (date and time may wrap onto two lines)."""
        return utc(obj.granted_at)

    @admin.display(description="ended", ordering="ended_at")
    def ended_at_display(self, obj: LeaseTenure) -> str:
        """The end's time, UTC, to the millisecond; "open" while the tenure has not ended."""
        return "open" if obj.ended_at is None else utc(obj.ended_at)

    @admin.display(description="by", ordering="ended_by")
    def ended_by_display(self, obj: LeaseTenure) -> SafeString | str:
        """Who ended it: "holder" (its owner, shown beside it), or an operator, broken anywhere when long."""
        if not obj.ended_by:
            return "-"
        return "holder" if obj.ended_by == obj.owner else wrapping(obj.ended_by)

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Never: the database records tenures."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: LeaseTenure | None = None) -> bool:
        """Never: a history edited by hand tells nothing."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: LeaseTenure | None = None) -> bool:
        """Never here: ``manage.py leases prune-history`` deletes by age."""
        return False
