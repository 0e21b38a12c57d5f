"""The Lease admin's two writes: force release and hand-off requests, each at the epoch the user saw.

`pg_lease_django.admin.lease.LeaseAdmin` offers them, as its actions and the hand-off button, and
checks the permission. Here they are done. The epochs the page posted are read back: a malformed
one is a bad request, never a write. Each lease is written through the manager only if its epoch
is still the one shown. Every outcome is reported to the user, and each write is recorded as a
LogEntry on the lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import messages
from django.core.exceptions import BadRequest
from django.db import router
from django.http import HttpRequest

from pg_lease_django.exceptions import (
    AlreadyFreeError,
    AlreadyLapsedError,
    EpochMovedOnError,
    InvalidInputError,
    NeverAcquiredError,
)
from pg_lease_django.models import Lease
from pg_lease_django.validation import check_epoch

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin


def posted_epoch(text: str, malformed: str) -> int:
    """An epoch as a page posted it (decimal digits, within the epoch's range), or `BadRequest`."""
    if not text.isdecimal() or not text.isascii():
        raise BadRequest(malformed)
    try:
        return check_epoch(int(text))
    except InvalidInputError:
        raise BadRequest(f"{malformed}: no such epoch") from None


def confirmed_epochs(request: HttpRequest) -> dict[str, int]:
    """The leases the force-release confirmation page posted, each at the epoch it showed
    (``<epoch>:<key>``, so that a key may hold any character)."""
    confirmed: dict[str, int] = {}
    for value in request.POST.getlist("confirmed"):
        epoch_text, sep, key = value.partition(":")
        if not sep:
            raise BadRequest("malformed force-release confirmation")
        confirmed[key] = posted_epoch(epoch_text, "malformed force-release confirmation")
    return confirmed


def request_handoffs(
    model_admin: ModelAdmin[Lease], request: HttpRequest, leases: list[Lease], epochs: dict[str, int]
) -> None:
    """Ask the holder of each of ``leases`` to step down, if it still holds the epoch in ``epochs``."""
    manager = Lease.objects.db_manager(router.db_for_write(Lease))
    asked: list[str] = []
    skipped: list[str] = []
    for lease in leases:
        try:
            done = manager.request_handoff(lease.key, epoch=epochs[lease.key])
        except EpochMovedOnError as exc:
            skipped.append(f"{lease.key!r} changed hands since it was shown (now held by {exc.holder!r})")
            continue
        except (AlreadyFreeError, AlreadyLapsedError, NeverAcquiredError):
            skipped.append(f"{lease.key!r} is not held: nobody to ask")
            continue
        model_admin.log_change(request, lease, f"Requested a hand-off from {done.owner!r} at epoch {done.epoch}.")
        asked.append(f"{done.key!r} ({done.owner!r}, epoch {done.epoch})")
    if asked:
        model_admin.message_user(
            request,
            f"Hand-off requested from {', '.join(asked)}: each holder learns it at its next renewal.",
            messages.SUCCESS,
        )
    if skipped:
        model_admin.message_user(request, f"No hand-off requested: {'; '.join(skipped)}.", messages.WARNING)


def force_release_confirmed(model_admin: ModelAdmin[Lease], request: HttpRequest, leases: list[Lease]) -> None:
    """Free each of ``leases`` the user confirmed, if it is still at the epoch the page showed; the
    user is recorded as the operator."""
    confirmed = confirmed_epochs(request)
    # The write goes where the router sends writes of leases (a changelist's queryset.db is the read alias).
    manager = Lease.objects.db_manager(router.db_for_write(Lease))
    released: list[str] = []
    skipped: list[str] = []
    for lease in leases:
        epoch = confirmed.get(lease.key)
        if epoch is None:  # free when the page was shown, or not on it
            continue
        try:
            new_epoch = manager.force_release(lease.key, epoch=epoch, operator=request.user.get_username())
        except EpochMovedOnError as exc:
            skipped.append(f"{lease.key!r} changed hands after you confirmed (now held by {exc.holder!r})")
            continue
        except (AlreadyFreeError, NeverAcquiredError):  # no row: pruned since, and only free leases are pruned
            skipped.append(f"{lease.key!r} was already free")
            continue
        model_admin.log_change(
            request,
            lease,
            f"Force-released: was held by {lease.owner!r} at epoch {epoch}; new epoch {new_epoch}.",
        )
        released.append(f"{lease.key!r} (epoch {epoch} \N{RIGHTWARDS ARROW} {new_epoch})")
    if released:
        noun = "lease" if len(released) == 1 else "leases"
        model_admin.message_user(
            request, f"Force-released {len(released)} {noun}: {', '.join(released)}.", messages.SUCCESS
        )
    if skipped:
        model_admin.message_user(request, f"Not released: {'; '.join(skipped)}.", messages.WARNING)
    if not released and not skipped:
        model_admin.message_user(request, "Nothing to release: the selected leases are free.", messages.INFO)
