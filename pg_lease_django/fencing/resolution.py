"""Which lease guards a write: the caller's fence, a queryset's, the lease held by ``hold()``, or an opt-out.

Decided in Python, before any SQL is sent, by `resolve_fence` alone; the database checks the
outcome again. Its public names are re-exported by `pg_lease_django.fencing`. It reads the holds of
this thread or task from `pg_lease_django.holds.context` only, a leaf: fencing loads none of the
machinery that holds leases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from django.db import models

from pg_lease_django.exceptions import InvalidInputError, UnfencedWriteError
from pg_lease_django.holds.context import current_lease
from pg_lease_django.validation import check_epoch, check_name

_unfenced_writes: ContextVar[bool] = ContextVar("pg_lease_unfenced_writes", default=False)


class Fence(Protocol):
    """Anything that names a lease grant: a `Grant` or a `HeldLease` is one.

    ``key`` is optional: when present it must match the lease key the write is guarded by.
    """

    @property
    def owner(self) -> str: ...

    @property
    def epoch(self) -> int: ...


@dataclass(frozen=True)
class FenceToken:
    """A resolved fence: the lease ``(key, owner, epoch)`` a write must still hold to land."""

    key: str
    owner: str
    epoch: int


@dataclass(frozen=True)
class QuerysetScope:
    """The fence (or, with None, the opt-out) of a queryset whose create()/get_or_create()/
    update_or_create() is running: Django's code reaches FencedModel.save() without passing it on."""

    model: type[models.Model]
    token: FenceToken | None


#: Taken by the one save of that model that the queryset method makes, and hidden from the saves its
#: signal handlers make in turn (they name their own fence).
queryset_fence: ContextVar[QuerysetScope | None] = ContextVar("pg_lease_queryset_fence", default=None)


@contextmanager
def unfenced_writes() -> Iterator[None]:
    """Allow FencedModel writes without a fence inside the block, in this thread or task only.

    It is the explicit opt-out for writes that no lease holder makes: admin edits, data repair from a
    shell, ``loaddata``. Each such write runs in a transaction that tells the database so with
    ``pg_lease_allow_unfenced()``, which is granted to the migrating role; see docs/security.md. It is
    greppable on purpose, and also usable as a decorator.
    """
    token = _unfenced_writes.set(True)
    try:
        yield
    finally:
        _unfenced_writes.reset(token)


def resolve_fence(
    fence: Fence | None, key: str | Callable[[], str], *, unfenced: bool = False, using: str | None = None
) -> FenceToken | None:
    """Decide which lease guards a write: the one place that does.

    Args:
        fence: the caller's grant, or None.
        key: the lease key the write is guarded by, or a callable computing it, which is called only
            when a fence is needed.
        unfenced: the caller's explicit opt-out, as ``save(unfenced=True)`` gives it.
        using: the database alias the write goes to, when known. A lease held in another database,
            through ``hold(using=...)``, is no fence for it.

    Returns:
        The token to present, or None for a deliberately unfenced write.

    Raises:
        UnfencedWriteError: no fence and no opt-out.
        InvalidInputError: both a fence and ``unfenced=True``; a fence for another key; a fence
            that is not a grant, with no ``owner`` or ``epoch`` or with the wrong types.
    """
    if fence is None:
        if unfenced or _unfenced_writes.get():
            return None
        # Inside hold()/@leased, the active lease of the write's key is the fence (innermost first).
        if current_lease() is not None and (lease_key := key() if callable(key) else key):
            held = current_lease(lease_key)
            if held is not None and using is not None and held.using != using:
                raise UnfencedWriteError(
                    f"lease {lease_key!r} is held in database {held.using!r} (hold(..., using={held.using!r})), "
                    f"but this write goes to database {using!r}: a lease only fences writes to its own database",
                    key=lease_key,
                    owner=held.owner,
                    epoch=held.epoch,
                )
            fence = held
        if fence is None:
            raise UnfencedWriteError(
                "write to a FencedModel without a fence: pass fence=grant (querysets: .fenced(grant)), hold "
                "its lease with hold()/@leased, or opt out explicitly with unfenced=True / .unfenced() / "
                "unfenced_writes(); in the admin, register the model with pg_lease_django.admin.FencedModelAdmin "
                "(check pg_lease_django.W001)"
            )
    if unfenced:
        raise InvalidInputError("pass either a fence or unfenced=True, not both")
    try:
        owner, epoch = fence.owner, fence.epoch
    except AttributeError:
        raise InvalidInputError(
            f"a fence is a grant with owner and epoch (a Grant or a held lease), not {type(fence).__name__}"
        ) from None
    lease_key = check_name("key", key() if callable(key) else key)
    check_name("owner", owner)
    check_epoch(epoch)
    fence_key = getattr(fence, "key", None)
    if fence_key is not None and fence_key != lease_key:
        raise InvalidInputError(
            f"the fence is a grant for lease {fence_key!r}, but this write is guarded by lease {lease_key!r}",
            key=lease_key,
            owner=owner,
            epoch=epoch,
        )
    return FenceToken(lease_key, owner, epoch)
