"""FencedQuerySet and FencedManager: a queryset's writes present the fence that guards them.

``update()`` and ``delete()`` put ``pg_lease_check_fence(key, owner, epoch)`` in their WHERE clause,
evaluated once, before any row is read. Django spreads some writes over several statements, for
multi-table inheritance, cascades and bulk writes. Those run in one transaction whose first
statement presents the fence. ``create()`` and its kin hand the queryset's fence to the model's
``save()``, that of `FencedModel` in `model`. `resolution` decides which fence that is, and
`statements` how it reaches SQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models, router

from pg_lease_django.exceptions import InvalidInputError

from .lease_key import key_fields_among, own_key
from .resolution import Fence, FenceToken, QuerysetScope, queryset_fence, resolve_fence
from .schema import EPOCH_FIELD, KEY_FIELD
from .statements import FencePresented, in_one_transaction, refusals_raised

if TYPE_CHECKING:
    from typing import Self

__all__ = ["FencedManager", "FencedQuerySet"]

_M = TypeVar("_M", bound=models.Model)


#: Set while bulk_update() runs its batches through `FencedQuerySet.update`: it recomputed the keys.
_recomputing_keys: ContextVar[bool] = ContextVar("pg_lease_recomputing_keys", default=False)


class FencedQuerySet(models.QuerySet[_M]):
    """QuerySet whose writes present a fence, or are refused without one.

    ``Invoice.objects.fenced(grant).filter(...).update(status="sent")`` writes only while ``grant`` is
    the live lease of every matched row, and sets ``lease_epoch`` to the grant's epoch. It is all or
    nothing. The database refuses the whole statement with `EpochMismatchError` if any matched row was
    written at a higher epoch, and with `UnfencedWriteError` if any belongs to another lease.
    ``create()``, ``get_or_create()``, ``update_or_create()``, ``bulk_create()`` and
    ``bulk_update()`` are fenced the same way. ``.unfenced()`` opts out explicitly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pg_lease_token: FenceToken | None = None
        self._pg_lease_unfenced = False

    def _clone(self) -> Self:
        clone: Self = super()._clone()  # type: ignore[misc]
        clone._pg_lease_token = self._pg_lease_token
        clone._pg_lease_unfenced = self._pg_lease_unfenced
        return clone

    def fenced(self, fence: Fence, *, key: str | None = None) -> Self:
        """Guard this queryset's writes with ``fence``.

        Args:
            fence: the grant the writes must still hold (a `Grant`).
            key: the lease key; defaults to the model's ``lease_key``, else the fence's ``key``.

        Raises:
            InvalidInputError: no key can be found, the fence is for another key, or is malformed.
        """
        lease_key = key or getattr(self.model, "lease_key", None) or getattr(fence, "key", None)
        if not lease_key:
            raise InvalidInputError(f"{self.model.__name__} has no class-level lease_key: pass key=...")
        clone = self.all()
        clone._pg_lease_token = resolve_fence(fence, lease_key)  # noqa: SLF001 (a clone of this class)
        clone._pg_lease_unfenced = False  # noqa: SLF001 (a clone of this class)
        return clone

    def unfenced(self) -> Self:
        """Opt this queryset's writes out of fencing, explicitly (admin actions, data repair)."""
        clone = self.all()
        clone._pg_lease_token = None  # noqa: SLF001 (a clone of this class)
        clone._pg_lease_unfenced = True  # noqa: SLF001 (a clone of this class)
        return clone

    def _token(self) -> FenceToken | None:
        if self._pg_lease_token is not None:
            return self._pg_lease_token
        # Inside hold(), a class-level lease_key lets the current lease fence the queryset too.
        return resolve_fence(
            None, getattr(self.model, "lease_key", None) or "", unfenced=self._pg_lease_unfenced, using=self._using()
        )

    def _using(self) -> str:
        return self._db or router.db_for_write(self.model, **self._hints)  # type: ignore[attr-defined]

    @contextmanager
    def _scoped(self) -> Iterator[None]:
        """Hand this queryset's explicit fence or opt-out to the saves that Django's create() and its kin make.

        Without either, each save decides for itself, for instance inside hold().
        """
        if self._pg_lease_token is None and not self._pg_lease_unfenced:
            yield
            return
        scope = queryset_fence.set(QuerysetScope(self.model, self._pg_lease_token))
        try:
            yield
        finally:
            queryset_fence.reset(scope)

    def _refuse_moving_rows(self, kwargs: dict[str, Any]) -> None:
        """An ``update()`` of a field the lease key derives from would leave rows under their old
        lease (the stored key is not recomputed): refused before anything is sent."""
        moved = key_fields_among(self.model, kwargs)
        if moved:
            raise InvalidInputError(
                f"{self.model.__name__}.objects.update() of {', '.join(sorted(moved))} would move rows to another "
                f"lease ({self.model.__name__}.lease_key_fields) without recomputing their stored lease key: save() "
                "each row, or use bulk_update(), which recompute it (and need the fence of every lease involved)"
            )

    def update(self, **kwargs: Any) -> int:
        """Update the matched rows if the fence holds for each of them; see the class docstring.

        Returns:
            The number of rows updated.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: the fence does not hold, even when no row
                matches, or a matched row has a higher epoch; nothing was written.
            UnfencedWriteError: neither ``.fenced()`` nor ``.unfenced()``, or a matched row belongs
                to another lease.
            InvalidInputError: ``kwargs`` set a field of ``lease_key_fields``. Moving rows between
                leases needs their keys recomputed, which ``save()`` and ``bulk_update()`` do.
        """
        token = self._token()
        using = self._using()
        if not _recomputing_keys.get():
            self._refuse_moving_rows(kwargs)
        if token is None:
            with in_one_transaction(using, None, present_first=True):
                return super().update(**kwargs)
        kwargs[EPOCH_FIELD] = token.epoch
        guarded = self.filter(FencePresented(token))
        with refusals_raised("update"):
            if not self.model._meta.parents:
                return models.QuerySet.update(guarded, **kwargs)
            # Multi-table: Django selects the ids, then updates each table. One transaction keeps
            # the fence presented by the first statement for the others.
            with in_one_transaction(using, token, present_first=False):
                return models.QuerySet.update(guarded, **kwargs)

    update.alters_data = True  # type: ignore[attr-defined]

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete the matched rows if the fence holds for each of them; raises like `update`.

        Cascades and signals run as in Django's ``delete()``, in one transaction whose first
        statement presents the fence; cascaded rows of other fenced models need their own lease
        presented in the same transaction (the database checks them too).
        """
        token = self._token()
        using = self._using()
        if token is None:
            with in_one_transaction(using, None, present_first=True):
                return super().delete()
        guarded = self.filter(FencePresented(token))
        with refusals_raised("delete"), in_one_transaction(using, token, present_first=False):
            return models.QuerySet.delete(guarded)

    delete.alters_data = True  # type: ignore[attr-defined]

    def bulk_update(self, objs: Any, fields: Iterable[str], batch_size: int | None = None) -> int:
        """Django's bulk_update(), each batch a fenced `update`; without a fence it is refused up front.

        ``fields`` may include a field the lease key derives from, one of ``lease_key_fields``. Then each
        object's stored key is recomputed by `FencedModel.get_lease_key` and written too. A row that moves
        to another lease then needs that lease's fence as well. The database checks it, raising
        `UnfencedWriteError` when this queryset presents only one.
        """
        self._token()
        fields = list(fields)
        if key_fields_among(self.model, fields):
            objs = list(objs)
            for obj in objs:
                obj.lease_id = own_key(obj)
            fields.append(KEY_FIELD)
        token = _recomputing_keys.set(True)
        try:
            rows: int = super().bulk_update(objs, fields, batch_size=batch_size)
        finally:
            _recomputing_keys.reset(token)
        return rows

    bulk_update.alters_data = True  # type: ignore[attr-defined]

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[_M]:
        """Django's bulk_create() in one transaction that first presents the fence (or opts out).

        Each object's ``lease_key`` is its own `FencedModel.get_lease_key`; the database refuses
        the batch if any of them is not the fenced lease. With ``update_conflicts``, a conflicting
        row's update writes the recomputed key and the epoch as well.
        """
        token = self._token()
        objs = list(objs)
        for obj in objs:
            obj.lease_id = own_key(obj)
            if token is not None:
                obj.lease_epoch = token.epoch
        if kwargs.get("update_conflicts") and kwargs.get("update_fields"):
            # A conflicting row is updated: it takes the recomputed key and the epoch too, so a row
            # moved to another lease needs that lease's fence (the database checks both keys).
            kwargs["update_fields"] = [*kwargs["update_fields"], KEY_FIELD, EPOCH_FIELD]
        with refusals_raised("bulk_create"), in_one_transaction(self._using(), token, present_first=True):
            return super().bulk_create(objs, *args, **kwargs)

    bulk_create.alters_data = True  # type: ignore[attr-defined]

    def create(self, **kwargs: Any) -> _M:
        """Django's create(), saved under this queryset's fence (or opt-out)."""
        with self._scoped():
            return super().create(**kwargs)

    create.alters_data = True  # type: ignore[attr-defined]

    def get_or_create(self, defaults: Any = None, **kwargs: Any) -> tuple[_M, bool]:
        """Django's get_or_create(), the create fenced like `create`."""
        with self._scoped():
            return super().get_or_create(defaults, **kwargs)

    get_or_create.alters_data = True  # type: ignore[attr-defined]

    def update_or_create(self, defaults: Any = None, create_defaults: Any = None, **kwargs: Any) -> tuple[_M, bool]:
        """Django's update_or_create(), its save or create fenced like `create`."""
        with self._scoped():
            return super().update_or_create(defaults, create_defaults, **kwargs)

    update_or_create.alters_data = True  # type: ignore[attr-defined]


class FencedManager(models.Manager[_M]):
    """Default manager of FencedModel: hands out `FencedQuerySet`."""

    def get_queryset(self) -> FencedQuerySet[_M]:
        return FencedQuerySet(self.model, using=self._db, hints=self._hints)  # type: ignore[attr-defined]

    def fenced(self, fence: Fence, *, key: str | None = None) -> FencedQuerySet[_M]:
        """Shortcut for ``get_queryset().fenced(fence, key=key)``."""
        return self.get_queryset().fenced(fence, key=key)

    def unfenced(self) -> FencedQuerySet[_M]:
        """Shortcut for ``get_queryset().unfenced()``."""
        return self.get_queryset().unfenced()
