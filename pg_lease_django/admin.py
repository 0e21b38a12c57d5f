"""The Lease admin: read-only, states from the server clock, and a guarded "Force release" action.

Nobody edits a lease by hand (an owner, epoch or expiry typed into a form would break fencing);
the only write is the force-release action, which goes through `LeaseManager.force_release`
so the epoch goes up and the holder is fenced. States are read with `LeaseQuerySet.with_state`.
"""

from __future__ import annotations

import json
import shlex
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_permission_codename
from django.core.exceptions import BadRequest, PermissionDenied
from django.db import router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .display import describe_expiry, format_duration
from .exceptions import AlreadyFreeError, EpochMismatchError, InvalidInputError, NeverAcquiredError
from .fencing import unfenced_writes
from .models import Lease
from .querysets import LeaseQuerySet
from .status import LeaseStatus
from .validation import check_epoch

__all__ = ["FencedModelAdmin", "LeaseAdmin", "StateFilter"]

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


def _nowrap(text: str, title: str = "") -> SafeString:
    """A changelist cell on one line (at 1280 px the default wrapping cut or tripled the row)."""
    return format_html('<span style="white-space:nowrap" title="{}">{}</span>', title, text)


@admin.register(Lease)
class LeaseAdmin(_LeaseModelAdmin):
    """Read-only view of the lease table with a permission-gated "Force release" action.

    The changelist costs a fixed number of queries whatever the page size: state and "expires in"
    are annotations computed by PostgreSQL (`LeaseQuerySet.with_state`). Force release needs the
    ``pg_lease_django.force_release_lease`` permission; without it the action is not offered.
    """

    list_display = ("key", "state_badge", "owner_display", "epoch", "expires_in_display", "acquired_display")
    list_filter = (StateFilter,)
    search_fields = ("key", "owner")
    ordering = ("key",)
    list_per_page = 100
    # On a filtered page, skip the extra COUNT(*) over the whole table (100k rows and more).
    show_full_result_count = False
    actions = ["force_release"]
    fields = (
        "key",
        "state_badge",
        "owner",
        "epoch",
        "acquired_at",
        "expires_at",
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
        return "-" if obj.owner is None else format_html('<span style="overflow-wrap:anywhere">{}</span>', obj.owner)

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
        python_key = json.dumps(obj.key, ensure_ascii=False)
        sql_key = "'" + obj.key.replace("'", "''") + "'"
        snippet = (
            "from pg_lease_django import Lease\n\n"
            f'grant = Lease.objects.acquire({python_key}, "my-worker-id", ttl=30)\n'
            "if grant is not None:  # None: another owner holds it\n"
            "    ...  # pass grant.epoch to guarded writes: obj.save(fence=grant)\n"
            "    Lease.objects.release(grant.key, grant.owner, grant.epoch)\n\n"
            f"$ python manage.py leases show {shlex.quote(obj.key)}\n"
            f"$ python manage.py leases release {shlex.quote(obj.key)} --force --epoch {obj.epoch}\n\n"
            f"SELECT * FROM pg_lease_inspect({sql_key});"
        )
        return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', snippet)

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
            # The write goes where the router sends writes of leases (queryset.db is the read alias).
            self._force_release_confirmed(request, leases, router.db_for_write(Lease))
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

    def _force_release_confirmed(self, request: HttpRequest, leases: list[Lease], using: str) -> None:
        confirmed: dict[str, int] = {}
        for value in request.POST.getlist("confirmed"):
            epoch_text, sep, key = value.partition(":")
            if not sep or not epoch_text.isdecimal() or not epoch_text.isascii():
                raise BadRequest("malformed force-release confirmation")
            try:
                confirmed[key] = check_epoch(int(epoch_text))
            except InvalidInputError:
                raise BadRequest("malformed force-release confirmation: no such epoch") from None
        manager = Lease.objects.db_manager(using)
        released: list[str] = []
        skipped: list[str] = []
        for lease in leases:
            epoch = confirmed.get(lease.key)
            if epoch is None:  # free when the page was shown, or not on it
                continue
            try:
                new_epoch = manager.force_release(lease.key, epoch=epoch)
            except EpochMismatchError as exc:
                skipped.append(f"{lease.key!r} changed hands after you confirmed (now held by {exc.owner!r})")
                continue
            except (AlreadyFreeError, NeverAcquiredError):  # no row: pruned since, and only free leases are pruned
                skipped.append(f"{lease.key!r} was already free")
                continue
            self.log_change(
                request,
                lease,
                f"Force-released: was held by {lease.owner!r} at epoch {epoch}; new epoch {new_epoch}.",
            )
            released.append(f"{lease.key!r} (epoch {epoch} \N{RIGHTWARDS ARROW} {new_epoch})")
        if released:
            noun = "lease" if len(released) == 1 else "leases"
            self.message_user(
                request, f"Force-released {len(released)} {noun}: {', '.join(released)}.", messages.SUCCESS
            )
        if skipped:
            self.message_user(request, f"Not released: {'; '.join(skipped)}.", messages.WARNING)
        if not released and not skipped:
            self.message_user(request, "Nothing to release: the selected leases are free.", messages.INFO)


# ---- fenced models ---------------------------------------------------------------------------

#: What the admin records in each LogEntry of a fenced row it wrote.
UNFENCED_NOTE = "Unfenced write from the admin (no lease held)."


class FencedModelAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """ModelAdmin for a `FencedModel`: adding, changing and deleting rows works, as explicit opt-outs.

    An admin user is no lease holder, so every write the admin makes (add, change, delete, "Delete
    selected", inlines) runs under `unfenced_writes`: a transaction that calls
    ``pg_lease_allow_unfenced()`` first, which the database lets only granted roles do
    (docs/security.md). Each LogEntry says so (``UNFENCED_NOTE``), so the history shows which
    writes bypassed the fence. A plain ``ModelAdmin`` on a fenced model fails on every write
    (system check ``pg_lease_django.W001`` says so).
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
