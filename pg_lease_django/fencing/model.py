"""FencedModel, its queryset and manager: every write presents the fence that guards it.

The public face of `pg_lease_django.fencing` (which re-exports it): ``save()`` puts
``lease_epoch = (SELECT pg_lease_check_fence(key, owner, epoch))`` in its own UPDATE or INSERT;
queryset ``update()``/``delete()`` put the same call in their WHERE clause (evaluated once, before
any row is read); writes Django spreads over several statements (multi-table inheritance,
cascades, bulk writes) run in one transaction whose first statement presents the fence. Which
fence that is, `resolution` decides; how it reaches SQL, `statements`; the tables' triggers that
check it, `schema`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import models, router
from django.db.models.signals import class_prepared

from pg_lease_django.exceptions import InvalidInputError

from .lease_key import evaluate_key, key_fields_among, own_key
from .resolution import Fence, FenceToken, QuerysetScope, queryset_fence, resolve_fence
from .schema import EPOCH_FIELD, KEY_FIELD, LeaseKeyField, add_fence_trigger
from .statements import FencePresented, PresentFence, in_one_transaction, refusals_raised

if TYPE_CHECKING:
    from typing import Self

__all__ = ["FencedManager", "FencedModel", "FencedQuerySet"]

_M = TypeVar("_M", bound=models.Model)


# ---- querysets -------------------------------------------------------------------------------


#: Set while bulk_update() runs its batches through `FencedQuerySet.update`: it recomputed the keys.
_recomputing_keys: ContextVar[bool] = ContextVar("pg_lease_recomputing_keys", default=False)


class FencedQuerySet(models.QuerySet[_M]):
    """QuerySet whose writes present a fence, or are refused without one.

    ``Invoice.objects.fenced(grant).filter(...).update(status="sent")`` writes only while ``grant``
    is the live lease of every matched row, sets ``lease_epoch`` to the grant's epoch, and is all
    or nothing: the database refuses the whole statement (`EpochMismatchError`) if any matched row
    was written at a higher epoch, and (`UnfencedWriteError`) if any belongs to another lease.
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
        """Hand this queryset's explicit fence (or opt-out) to the saves Django's create() & co. make;
        without either, each save decides for itself (inside hold(), for instance)."""
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
            NotOwnerError, LapsedError, EpochMismatchError: the fence does not hold (even when no row
                matches), or a matched row has a higher epoch; nothing was written.
            UnfencedWriteError: neither ``.fenced()`` nor ``.unfenced()``, or a matched row belongs
                to another lease.
            InvalidInputError: ``kwargs`` set a field of ``lease_key_fields`` (moving rows between
                leases needs their keys recomputed: ``save()`` or ``bulk_update()``).
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
        """Django's bulk_update(), each batch a fenced `update` (refused up front without a fence).

        When ``fields`` include a field the lease key derives from (``lease_key_fields``), each
        object's stored key is recomputed (`FencedModel.get_lease_key`) and written too: a row that
        moves to another lease then needs that lease's fence as well, which the database checks
        (`UnfencedWriteError` when this queryset presents only one).
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


# ---- the model -------------------------------------------------------------------------------

_AMBIENT = object()  # save_base() called without save(): decide the fence there (loaddata does)


class FencedModel(models.Model):
    """Abstract model whose rows PostgreSQL writes only for the current holder of their lease.

    Subclasses name the lease with ``lease_key = "billing"`` or per row by overriding
    `get_lease_key`, and write with ``obj.save(fence=grant)`` / ``obj.delete(fence=grant)`` /
    ``Model.objects.fenced(grant).update(...)``. A write is accepted only if, on the server clock,
    the lease is held by ``grant.owner`` at ``grant.epoch`` and has not lapsed; otherwise it raises
    `NotOwnerError`, `LapsedError` or `EpochMismatchError` and writes nothing. Writes without a
    fence raise `UnfencedWriteError` unless opted out (``unfenced=True``, ``unfenced_writes()``).
    The database enforces the same rule on every other writer (raw SQL, psql, other languages).

    Each row stores the key of its lease (``lease``, column ``lease_key``) and the epoch of its
    last accepted write (``lease_epoch``). A write at a lower epoch than the row's is refused, and
    moving a row to another lease needs the fences of both.

    Inside ``atomic()``, a refused write leaves the block to roll back, as any failed write does.
    The model must live in the database that holds the leases (check ``pg_lease_django.E002``).
    """

    #: The lease guarding every row of the model; None when the key is per row (`lease_key_expression`).
    lease_key: ClassVar[str | None] = None
    #: A per-row lease key as an expression over the row's own fields, which the database derives
    #: for every row whoever writes it (a trigger sets ``lease_key``): ``F("account")``,
    #: ``Concat(Value("invoice:"), "account")``. `get_lease_key` evaluates F, Value and Concat in
    #: Python; with other functions, override it to return the same key (a write whose fence is for
    #: another key than the database derives is refused). Check ``pg_lease_django.W009`` asks for it.
    lease_key_expression: ClassVar[Any] = None
    #: The fields a per-row key is made of, for a model that does not declare `lease_key_expression`
    #: (from which they are read otherwise): ``update()`` of one of them is refused (it cannot
    #: recompute the stored key), ``bulk_update()`` recomputes the key; see `FencedQuerySet.update`.
    lease_key_fields: ClassVar[tuple[str, ...]] = ()

    lease = LeaseKeyField(help_text="Key of the lease that guards this row.")
    lease_epoch = models.BigIntegerField(
        null=True, blank=True, editable=False, help_text="Lease epoch of the last accepted (fenced) write."
    )

    objects = FencedManager()

    class Meta:
        abstract = True

    def save(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> None:
        """Save if ``fence`` is still the live lease: check and write are one statement.

        Args:
            *args: passed to Django's ``save()``.
            fence: the grant the write must hold (a `Grant`).
            unfenced: write without a fence, deliberately (admin edits, data repair).
            **kwargs: passed to Django's ``save()`` (``update_fields`` gains the lease fields).

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: refused; nothing was written and the
                instance keeps its previous ``lease_epoch``.
            UnfencedWriteError: neither a fence nor an opt-out, or the stored row belongs to a
                lease this write presented no fence for.
            InvalidInputError: a fence for another lease key, or a malformed fence.
        """
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        scope = queryset_fence.get()
        hidden = None
        if scope is not None and fence is None and not unfenced and isinstance(self, scope.model):
            fence, unfenced = scope.token, scope.token is None
            hidden = queryset_fence.set(None)
        try:
            self._pg_lease_token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced, using=using)
            super().save(*args, **kwargs)
        finally:
            self.__dict__.pop("_pg_lease_token", None)
            if hidden is not None:
                queryset_fence.reset(hidden)

    save.alters_data = True  # type: ignore[attr-defined]

    async def asave(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> None:
        """Async `save`, with the same ``fence``/``unfenced`` arguments."""
        await sync_to_async(self.save)(*args, fence=fence, unfenced=unfenced, **kwargs)

    asave.alters_data = True  # type: ignore[attr-defined]

    def save_base(self, *args: Any, **kwargs: Any) -> None:
        """Django's save_base(), its statements presenting the fence (or opting out) to the database."""
        token = self.__dict__.pop("_pg_lease_token", _AMBIENT)
        if token is _AMBIENT:  # called directly (loaddata): refused unless opted out or inside hold()
            token = resolve_fence(None, self.get_lease_key, using=kwargs.get("using"))
        assert token is None or isinstance(token, FenceToken)
        if kwargs.get("update_fields"):  # empty update_fields: Django saves nothing
            kwargs["update_fields"] = {*kwargs["update_fields"], KEY_FIELD, EPOCH_FIELD}
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        previous = (self.lease_id, self.lease_epoch)
        self.lease_id = token.key if token is not None else own_key(self)
        self._pg_lease_presenting = True
        try:
            if token is None:
                with in_one_transaction(using, None, present_first=True):
                    super().save_base(*args, **kwargs)
                return
            self.lease_epoch = PresentFence(token)
            with refusals_raised("save"):
                super().save_base(*args, **kwargs)
            self.lease_epoch = token.epoch
        except BaseException:
            self.lease_id, self.lease_epoch = previous
            raise
        finally:
            del self._pg_lease_presenting

    save_base.alters_data = True  # type: ignore[attr-defined]

    def _save_table(self, *args: Any, **kwargs: Any) -> Any:
        """Django's _save_table(); reached without our save_base() only from ``Model.save_base(obj)``
        called directly (``loaddata`` does): present the ambient fence or opt-out first, then."""
        if self.__dict__.get("_pg_lease_presenting"):
            return super()._save_table(*args, **kwargs)  # type: ignore[misc]
        token = resolve_fence(None, self.get_lease_key)
        signature = inspect.signature(models.Model._save_table)  # type: ignore[attr-defined]  # noqa: SLF001 (Django's hook this overrides)
        using = signature.bind(self, *args, **kwargs).arguments.get("using")
        using = using or router.db_for_write(type(self), instance=self)
        self.lease_id = own_key(self)
        if token is not None:
            self.lease_epoch = token.epoch
        with refusals_raised("save"), in_one_transaction(using, token, present_first=True):
            return super()._save_table(*args, **kwargs)  # type: ignore[misc]

    def delete(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> Any:
        """Delete if ``fence`` is still the live lease of the stored row; raises like `save`.

        Django's delete (signals, cascades, ``keep_parents``) runs in one transaction whose first
        statement presents the fence: two statements at least, all checked by the database.
        """
        using = kwargs.get("using") or (args[0] if args else None) or router.db_for_write(type(self), instance=self)
        token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced, using=using)
        with refusals_raised("delete"), in_one_transaction(using, token, present_first=True):
            return super().delete(*args, **kwargs)

    delete.alters_data = True  # type: ignore[attr-defined]

    async def adelete(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> Any:
        """Async `delete`, with the same ``fence``/``unfenced`` arguments."""
        return await sync_to_async(self.delete)(*args, fence=fence, unfenced=unfenced, **kwargs)

    adelete.alters_data = True  # type: ignore[attr-defined]

    def get_lease_key(self) -> str:
        """The lease that guards writes to this row: ``lease_key_expression`` evaluated over this row
        (F, Value and Concat), else the class attribute ``lease_key``.

        Raises:
            ImproperlyConfigured: neither is declared, or the expression needs an override of this
                method (it uses other functions than Concat); also when the key it yields is NULL.
        """
        if self.lease_key_expression is not None:
            key = evaluate_key(self.lease_key_expression, self)
            if key is None:
                raise ImproperlyConfigured(f"{type(self).__name__}'s lease_key_expression is NULL for this row")
            return key
        if self.lease_key is None:
            raise ImproperlyConfigured(
                f"{type(self).__name__} must set lease_key or lease_key_expression, or override get_lease_key()"
            )
        return self.lease_key


# ---- every fenced table gets its triggers ---------------------------------------------------


def _add_fence_trigger(sender: type[models.Model], **kwargs: Any) -> None:
    """class_prepared: give every concrete FencedModel table (and MTI child table) its FenceTrigger."""
    if issubclass(sender, FencedModel):
        add_fence_trigger(sender)


class_prepared.connect(_add_fence_trigger)
