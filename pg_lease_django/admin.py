"""The Lease admin: read-only, states from the server clock, a lease's history, and two guarded writes.

Nobody edits a lease by hand (an owner, epoch or expiry typed into a form would break fencing).
The writes go through the manager: "Force release" (`LeaseManager.force_release`: the epoch goes
up and the holder is fenced; the user is recorded as the operator) and "Request hand-off"
(`LeaseManager.request_handoff`: advice the holder reads at its next renewal). States are read with
`LeaseQuerySet.with_state`; a lease's page also draws its recorded tenures
(`pg_lease_django.timeline`). `LeaseTenureAdmin` lists the tenures, read-only. What the two writes
do is `pg_lease_django.admin_writes`; `FencedModelAdmin`, for users' fenced models, is
`pg_lease_django.fencing.admin`, re-exported here (the path the documentation names).

Keys, owners and operators are other roles' data: Django escapes their HTML, and every page here
also shows them through `printable`, since a bidi override or a control character survives HTML
escaping and reorders or hides the text beside it. The snippets of "how to use this key" spell an
unusual key with escapes its language reads back exactly.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
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

from .admin_writes import force_release_confirmed, posted_epoch, request_handoffs
from .display import describe_expiry, format_duration, printable
from .fencing.admin import UNFENCED_NOTE, FencedModelAdmin
from .models import Lease, LeaseTenure
from .querysets import LeaseQuerySet
from .status import LeaseStatus
from .timeline import read_history, render_timeline

__all__ = ["UNFENCED_NOTE", "FencedModelAdmin", "LeaseAdmin", "LeaseTenureAdmin", "StateFilter"]

#: How many of a lease's tenures its page draws and lists (the newest; the tenure list has all).
HISTORY_LIMIT = 20

_BADGE_COLOURS: dict[str, tuple[str, str]] = {
    LeaseStatus.HELD: ("#1e6b30", "#dcf1e1"),
    LeaseStatus.LAPSED: ("#7a4b00", "#fcefd3"),
    LeaseStatus.FREE: ("#4a4a4a", "#ececec"),
}


if TYPE_CHECKING:
    _LeaseModelAdmin = admin.ModelAdmin[Lease]
    _TenureModelAdmin = admin.ModelAdmin[LeaseTenure]
else:  # ModelAdmin is generic only in django-stubs
    _LeaseModelAdmin = admin.ModelAdmin
    _TenureModelAdmin = admin.ModelAdmin


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


def _wrapping(text: str, min_width: str = "6em") -> SafeString:
    """A cell of other roles' data (a key, an owner), escaped (`printable`), broken anywhere when long
    (keys and owners have no spaces to break at), yet at least ``min_width`` wide, so that a long one
    is a few lines, not a column of syllables."""
    text = printable(text)
    return format_html(
        '<span style="display:inline-block;min-width:min({},{}ch);overflow-wrap:anywhere">{}</span>',
        min_width,
        len(text),
        text,
    )


def _nowrap(text: str, title: str = "") -> SafeString:
    """A changelist cell on one line (at 1280 px the default wrapping cut or tripled the row)."""
    return format_html('<span style="white-space:nowrap" title="{}">{}</span>', title, text)


@admin.register(Lease)
class LeaseAdmin(_LeaseModelAdmin):
    """Read-only view of the lease table with permission-gated "Force release" and "Request hand-off".

    The changelist costs a fixed number of queries whatever the page size: state and "expires in"
    are annotations computed by PostgreSQL (`LeaseQuerySet.with_state`). A lease's page adds its
    history: a timeline chart (inline SVG drawn on the server) and a table of its newest tenures.
    Both writes need the ``pg_lease_django.force_release_lease`` permission (whoever may break a
    lease may ask its holder to step down); without it neither is offered.
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
        return _wrapping(obj.key)

    @admin.display(description="acquired at")
    def acquired_at_display(self, obj: Lease) -> str:
        """The current grant's time, UTC, to the millisecond (Django's format stops at the minute)."""
        return _utc(obj.acquired_at)

    @admin.display(description="expires at")
    def expires_at_display(self, obj: Lease) -> str:
        """The expiry, UTC, to the millisecond: a 0.5 s lease's grant and expiry differ."""
        return _utc(obj.expires_at)

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
        return _nowrap(describe_expiry(str(getattr(obj, "state", None) or LeaseStatus.FREE), expires_in))

    @admin.display(description="owner", ordering="owner")
    def owner_display(self, obj: Lease) -> str:
        """The holder, broken anywhere when long (identities like ``host:pid:random`` have no spaces)."""
        return "-" if obj.owner is None else _wrapping(obj.owner)

    @admin.display(description="acquired at", ordering="acquired_at")
    def acquired_display(self, obj: Lease) -> str:
        """How long ago the current grant was made (server clock; ``4m 05s ago``), the time as a tooltip."""
        held_for: timedelta | None = getattr(obj, "held_for", None)
        if obj.acquired_at is None or held_for is None:
            return "-"
        return _nowrap(f"{format_duration(held_for)} ago", obj.acquired_at.astimezone(UTC).isoformat(sep=" "))

    @admin.display(description="how to use this key")
    def usage(self, obj: Lease) -> SafeString:
        """Snippets that use this key from Python, the shell and SQL."""
        python_key = _spelled(json.dumps(obj.key, ensure_ascii=False), _unicode_escape)
        if _plain(obj.key):
            shell_key, sql_key = shlex.quote(obj.key), "'" + obj.key.replace("'", "''") + "'"
        else:  # bash's ANSI-C quoting and PostgreSQL's escape strings read the escapes back exactly
            shell_key = "$'" + _spelled(obj.key.replace("\\", "\\\\").replace("'", "\\'"), _c_escape) + "'"
            sql_key = "E'" + _spelled(obj.key.replace("\\", "\\\\").replace("'", "''"), _c_escape) + "'"
        snippet = (
            "from pg_lease_django import Lease\n\n"
            f'grant = Lease.objects.acquire({python_key}, "my-worker-id", ttl=30)\n'
            "if grant is not None:  # None: another owner holds it\n"
            "    ...  # pass grant.epoch to guarded writes: obj.save(fence=grant)\n"
            "    Lease.objects.release(grant.key, grant.owner, grant.epoch)\n\n"
            f"$ python manage.py leases show {shell_key}\n"
            f"$ python manage.py leases release {shell_key} --force --epoch {obj.epoch}\n\n"
            f"SELECT * FROM pg_lease_inspect({sql_key});"
        )
        return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', snippet)

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
            # Safe: render_timeline escapes every text it draws (keys and owners are user data).
            "history_chart": mark_safe(render_timeline(history)),
            "tenures": [
                {
                    "row": row,
                    "owner": printable(row.owner),
                    "ended_by": printable(row.ended_by or "-"),
                    "granted_at": _utc(row.granted_at),
                    "ended_at": _utc(row.ended_at),
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


def _plain(text: str) -> bool:
    """Whether ``text`` has no character a browser or a terminal acts on (`printable` leaves it be)."""
    return printable(text) == text


def _spelled(literal: str, escape: Callable[[int], str]) -> str:
    """``literal`` with each character a browser or a terminal acts on written as ``escape(code)``."""
    return "".join(char if char == "\\" or _plain(char) else escape(ord(char)) for char in literal)


def _unicode_escape(code: int) -> str:
    """Python's escape of a character (JSON's for the BMP): ``\\u202e``, ``\\U0001d173``."""
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _c_escape(code: int) -> str:
    """The escape bash's ``$'...'`` and PostgreSQL's ``E'...'`` both read: ``\\x1b``, ``\\u202e``."""
    return f"\\x{code:02x}" if code < 0x80 else _unicode_escape(code)


def _utc(moment: datetime | None) -> str:
    """A server time for a table cell: UTC, to the millisecond."""
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


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
        return _wrapping(obj.key)

    @admin.display(description="owner", ordering="owner")
    def owner_display(self, obj: LeaseTenure) -> SafeString:
        """The holder, broken anywhere when long."""
        return _wrapping(obj.owner)

    @admin.display(description="granted", ordering="granted_at")
    def granted_at_display(self, obj: LeaseTenure) -> str:
        """The grant's time, UTC, to the millisecond (date and time may wrap onto two lines)."""
        return _utc(obj.granted_at)

    @admin.display(description="ended", ordering="ended_at")
    def ended_at_display(self, obj: LeaseTenure) -> str:
        """The end's time, UTC, to the millisecond; "open" while the tenure has not ended."""
        return "open" if obj.ended_at is None else _utc(obj.ended_at)

    @admin.display(description="by", ordering="ended_by")
    def ended_by_display(self, obj: LeaseTenure) -> SafeString | str:
        """Who ended it: "holder" (its owner, shown beside it), or an operator, broken anywhere when long."""
        if not obj.ended_by:
            return "-"
        return "holder" if obj.ended_by == obj.owner else _wrapping(obj.ended_by)

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Never: the database records tenures."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: LeaseTenure | None = None) -> bool:
        """Never: a history edited by hand tells nothing."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: LeaseTenure | None = None) -> bool:
        """Never here: ``manage.py leases prune-history`` deletes by age."""
        return False
