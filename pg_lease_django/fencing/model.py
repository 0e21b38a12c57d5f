"""FencedModel: a row's ``save()`` and ``delete()`` present the fence that guards it.

This is the public face of `pg_lease_django.fencing`, which re-exports it with the queryset and
manager of `queryset`. ``save()`` puts ``lease_epoch = pg_lease_check_fence(key, owner, epoch)`` in
its own UPDATE or INSERT of one row. Django spreads some writes over several statements, for
multi-table inheritance and cascades. Those run in one transaction whose first statement presents
the fence. `resolution` decides which fence that is, and `statements` how it reaches SQL. The
tables' triggers that check it are in `schema`, whose `add_fence_trigger` this module calls for
every FencedModel Django prepares.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import models, router
from django.db.models.signals import class_prepared

from .lease_key import evaluate_key, own_key
from .queryset import FencedManager
from .resolution import Fence, FenceToken, queryset_fence, resolve_fence
from .schema import EPOCH_FIELD, KEY_FIELD, LeaseKeyField, add_fence_trigger
from .statements import PresentFence, in_one_transaction, refusals_raised

__all__ = ["FencedModel"]


_AMBIENT = object()  # save_base() called without save(): decide the fence there (loaddata does)


class FencedModel(models.Model):
    """Abstract model whose rows PostgreSQL writes only for the current holder of their lease.

    Subclasses name the lease with ``lease_key = "billing"``, or per row by overriding
    `get_lease_key`. They write with ``obj.save(fence=grant)``, ``obj.delete(fence=grant)`` or
    ``Model.objects.fenced(grant).update(...)``. A write is accepted only if, on the server clock, the
    lease is held by ``grant.owner`` at ``grant.epoch`` and has not lapsed. Otherwise it raises
    `NotOwnerError`, `LapsedError` or `EpochMismatchError` and writes nothing. Writes without a fence
    raise `UnfencedWriteError` unless opted out with ``unfenced=True`` or ``unfenced_writes()``. The
    database enforces the same rule on every other writer: raw SQL, psql, other languages.

    Each row stores the key of its lease in ``lease``, column ``lease_key``, and the epoch of its last
    accepted write in ``lease_epoch``. A write at a lower epoch than the row's is refused, and moving a
    row to another lease needs the fences of both.

    Inside ``atomic()``, a refused write leaves the block to roll back, as any failed write does.
    The model must live in the database that holds the leases; check ``pg_lease_django.E002`` says so.
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
            fence: the `Grant` the write must hold.
            unfenced: write without a fence, deliberately, as for admin edits or data repair.
            **kwargs: passed to Django's ``save()``. ``update_fields`` gains the lease fields.

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
        """The lease that guards writes to this row.

        That is ``lease_key_expression`` evaluated over this row, made of F, Value and Concat. Without
        one, it is the class attribute ``lease_key``.

        Raises:
            ImproperlyConfigured: neither is declared, or the key it yields is NULL. Also when the
                expression uses other functions than Concat, which needs an override of this method.
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
