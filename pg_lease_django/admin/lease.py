"""The Lease admin, `LeaseAdmin`: read-only, states from the server clock, a lease's history, two guarded writes.

Nobody edits a lease by hand: an owner, epoch or expiry typed into a form would break fencing.
The writes go through the manager. "Force release" calls `LeaseManager.force_release`: the epoch
goes up and the holder is fenced, and the user is recorded as the operator. "Request hand-off"
calls `LeaseManager.request_handoff`: advice the holder reads at its next renewal. This module
offers them and checks the permission; `writes` does them. States are read with
`LeaseQuerySet.with_state`. A lease's page also draws its recorded tenures with
`pg_lease_django.timeline`, and `usage` says how to use its key. Keys, owners and operators are
shown through `cells`, escaped.
"""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.contrib.auth import get_permission_codename
from django.core.exceptions import BadRequest, PermissionDenied
from django.db import router
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_POST

from pg_lease_django.display import describe_expiry, format_duration, printable
from pg_lease_django.models import Lease, LeaseTenure
from pg_lease_django.querysets import LeaseQuerySet
from pg_lease_django.status import LeaseStatus
from pg_lease_django.timeline import draw_timeline, read_history

from .cells import nowrap, utc, wrapping
from .usage import usage_snippet
from .writes import force_release_confirmed, posted_epoch, request_handoffs

__all__ = ["HISTORY_LIMIT", "LeaseAdmin", "StateFilter"]

#: How many of a lease's tenures its page draws and lists (the newest; the tenure list has all).
HISTORY_LIMIT = 20

_BADGE_COLOURS: dict[str, tuple[str, str]] = {
    LeaseStatus.HELD: ("#1e6b30", "#dcf1e1"),
    LeaseStatus.LAPSED: ("#7a4b00", "#fcefd3"),
    LeaseStatus.FREE: ("#4a4a4a", "#ececec"),
}


if TYPE_CHECKING:
    _LeaseModelAdmin = admin.ModelAdmin[Lease]
else:  # ModelAdmin is generic only in django-stubs
    _LeaseModelAdmin = admin.ModelAdmin


class StateFilter(admin.SimpleListFilter):
    """Filter the changelist by state (held / lapsed / free), evaluated in SQL on the server clock."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]) -> list[tuple[str, str]]:
        """The three states."""
        return list(LeaseStatus.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        """Keep the leases in the chosen state (the queryset carries the ``state`` annotation)."""
        if self.value() in LeaseStatus.values:
            return queryset.filter(state=self.value())
        return queryset


@admin.register(Lease)
class LeaseAdmin(_LeaseModelAdmin):
    """Read-only view of the lease table with permission-gated "Force release" and "Request hand-off".

    The changelist costs a fixed number of queries whatever the page size: state and "expires in"
    are annotations computed by PostgreSQL, through `LeaseQuerySet.with_state`. A lease's page adds
    its history: a timeline chart, drawn on the server as inline SVG, and a table of its newest
    tenures. Both writes need the ``pg_lease_django.force_release_lease`` permission: whoever may
    break a lease may ask its holder to step down. Without it neither is offered.
    """

    list_display = ("key_display", "state_badge", "owner_display", "epoch", "expires_in_display", "acquired_display")
    list_display_links = ("key_display",)
    list_filter = (StateFilter,)
    search_fields = ("key", "owner")
    ordering = ("key",)
    list_per_page = 100
    # On a filtered page, skip the extra COUNT(*) over the whole table (100k rows and more).
    show_full_result_count = False
    actions = ["force_release", "request_handoff"]
    fields = (
        "key_display",  # not the fields themselves: Django would show their text raw (HTML-escaped only)
        "state_badge",
        "owner_display",
        "epoch",
        "acquired_at_display",
        "expires_at_display",
        "expires_in_display",
        "usage",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lease]:
        """Leases annotated with ``state``, ``expires_in`` and ``held_for``, all from the server clock."""
        leases = super().get_queryset(request)
        assert isinstance(leases, LeaseQuerySet)  # Lease.objects' queryset
        return leases.with_state()

    # -- read-only ---------------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Never: leases are created by acquiring them."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Lease | None = None) -> bool:
        """Never: a hand-edited owner, epoch or expiry would break fencing."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Lease | None = None) -> bool:
        """Never: deleting a row would restart its epoch (and the database refuses it)."""
        return False

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        """Whether the user holds ``pg_lease_django.force_release_lease``."""
        codename = get_permission_codename("force_release", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    # -- columns -------------------------------------------------------------------------------------

    @admin.display(description="key", ordering="key")
    def key_display(self, obj: Lease) -> SafeString:
        """The key, broken anywhere when long (a 150-character key would push every other column off-screen)."""
        return wrapping(obj.key)

    @admin.display(description="acquired at")
    def acquired_at_display(self, obj: Lease) -> str:
        """The current grant's time, UTC, to the millisecond (Django's format stops at the minute)."""
        return utc(obj.acquired_at)

    @admin.display(description="expires at")
    def expires_at_display(self, obj: Lease) -> str:
        """The expiry, UTC, to the millisecond: a 0.5 s lease's grant and expiry differ."""
        return utc(obj.expires_at)

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Lease) -> SafeString:
        """The state as a coloured badge."""
        state = str(getattr(obj, "state", None) or "?")
        colour, background = _BADGE_COLOURS.get(state, ("#000", "#fff"))
        return format_html(
            '<span class="pg-lease-state pg-lease-state-{}" style="color:{};background:{};'
            'padding:1px 8px;border-radius:8px;font-weight:600">{}</span>',
            state,
            colour,
            background,
            state,
        )

    @admin.display(description="expires", ordering="expires_at")
    def expires_in_display(self, obj: Lease) -> str:
        """When the lease lapses, relative to the server clock (``in 29s``, ``lapsed 3m 05s ago``)."""
        expires_in: timedelta | None = getattr(obj, "expires_in", None)
        return nowrap(describe_expiry(str(getattr(obj, "state", None) or LeaseStatus.FREE), expires_in))

    @admin.display(description="owner", ordering="owner")
    def owner_display(self, obj: Lease) -> str:
        """The holder, broken anywhere when long (identities like ``host:pid:random`` have no spaces)."""
        return "-" if obj.owner is None else wrapping(obj.owner)

    @admin.display(description="acquired at", ordering="acquired_at")
    def acquired_display(self, obj: Lease) -> str:
        """How long ago the current grant was made (server clock; ``4m 05s ago``), the time as a tooltip."""
        held_for: timedelta | None = getattr(obj, "held_for", None)
        if obj.acquired_at is None or held_for is None:
            return "-"
        return nowrap(f"{format_duration(held_for)} ago", obj.acquired_at.astimezone(UTC).isoformat(sep=" "))

    @admin.display(description="how to use this key")
    def usage(self, obj: Lease) -> SafeString:
        """Snippets that use this key from Python, the shell and SQL (`usage_snippet`)."""
        return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', usage_snippet(obj.key, obj.epoch))

    # -- history and hand-off ------------------------------------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Lease | None = None,
    ) -> HttpResponse:
        """The lease's facts, then its history: the timeline chart and the newest tenures.

        Here rather than in ``change_view``: Django has checked the permissions and found the row.
        """
        if obj is not None:
            context.update(self._history_context(request, obj.key), holder=printable(obj.owner or "-"))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _history_context(self, request: HttpRequest, key: str) -> dict[str, Any]:
        history = read_history(key, using=router.db_for_read(LeaseTenure), limit=HISTORY_LIMIT)
        now = history.server_time
        return {
            "history": history,
            # Safe: draw_timeline escapes every text it draws (keys and owners are user data).
            "history_chart": mark_safe(draw_timeline(history)),
            "tenures": [
                {
                    "row": row,
                    "owner": printable(row.owner),
                    "ended_by": printable(row.ended_by or "-"),
                    "granted_at": utc(row.granted_at),
                    "ended_at": utc(row.ended_at),
                    "outcome": printable(row.describe(now)),
                    "duration": format_duration(row.duration(now)),
                }
                for row in reversed(history.tenures)  # newest first, as the eye reads a log
            ],
            "tenure_list_url": self._tenure_list_url(request, key),
            "can_request_handoff": self.has_force_release_permission(request),
            "handoff_url": reverse(
                f"{self.admin_site.name}:pg_lease_django_lease_handoff",
                args=[quote(key)],
                current_app=self.admin_site.name,
            ),
        }

    def _tenure_list_url(self, request: HttpRequest, key: str) -> str | None:
        tenure_admin = (
            self.admin_site.get_model_admin(LeaseTenure) if self.admin_site.is_registered(LeaseTenure) else None
        )
        if tenure_admin is None or not tenure_admin.has_view_permission(request):
            return None
        url = reverse(
            f"{self.admin_site.name}:pg_lease_django_leasetenure_changelist", current_app=self.admin_site.name
        )
        return f"{url}?{urlencode({'key': key})}"

    def get_urls(self) -> list[URLPattern]:
        """The admin's URLs, plus ``<key>/handoff/`` (POST) for the button on a lease's page."""
        handoff = path(
            "<path:object_id>/handoff/",
            self.admin_site.admin_view(require_POST(self.handoff_view)),
            name=f"{self.opts.app_label}_{self.opts.model_name}_handoff",
        )
        return [handoff, *super().get_urls()]  # before the catch-all "<path:object_id>/"

    def handoff_view(self, request: HttpRequest, object_id: str) -> HttpResponseRedirect:
        """Ask the holder of one lease to step down, if it still holds the epoch the page showed."""
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        key = unquote(object_id)
        epoch = posted_epoch(request.POST.get("epoch", ""), "malformed hand-off request")
        lease = self.get_object(request, key)
        if lease is None:
            raise BadRequest("no such lease")
        request_handoffs(self, request, [lease], {key: epoch})
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:pg_lease_django_lease_change",
                args=[quote(key)],
                current_app=self.admin_site.name,
            )
        )

    @admin.action(permissions=["force_release"], description="Request hand-off from the holders of selected leases")
    def request_handoff(self, request: HttpRequest, queryset: QuerySet[Lease]) -> None:
        """Ask each selected lease's holder to step down at its next renewal.

        Advice, not a force: no confirmation page. Each is asked at the epoch read as the action
        starts, so a lease that changes hands meanwhile is left alone and reported.
        """
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        leases = list(queryset)
        request_handoffs(self, request, leases, {lease.key: lease.epoch for lease in leases})

    # -- force release -------------------------------------------------------------------------------

    @admin.action(permissions=["force_release"], description="Force release selected leases")
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lease]) -> TemplateResponse | None:
        """Show a confirmation page, then free the confirmed leases through the manager.

        The page lists each lease with its owner and epoch; confirming releases each one only if its
        epoch is still the one shown (a lease that changed hands meanwhile is left alone and
        reported). Each release is recorded as a LogEntry on the lease.
        """
        if not self.has_force_release_permission(request):  # the action list already hides it
            raise PermissionDenied
        leases = list(queryset)
        if request.POST.get("post") == "yes":
            force_release_confirmed(self, request, leases)
            return None
        return TemplateResponse(
            request,
            "admin/pg_lease_django/lease/force_release_confirmation.html",
            {
                **self.admin_site.each_context(request),
                "title": "Force release leases",
                "subtitle": None,
                "opts": self.opts,
                "leases": [
                    {
                        "lease": lease,
                        "key": printable(lease.key),
                        "owner": printable(lease.owner or "-"),
                        "state": self.state_badge(lease),
                        "expires": self.expires_in_display(lease),
                        "confirmed": f"{lease.epoch}:{lease.key}",
                    }
                    for lease in leases
                ],
                "releasable": sum(1 for lease in leases if lease.owner is not None),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "media": self.media,
            },
        )
