"""FencedModel: rows the database refuses to write for a holder that lost its lease.

The refusal happens in PostgreSQL, for every writer. Each fenced table carries triggers
(`FenceTrigger`, installed by the migration ``makemigrations`` writes) that check, once per
statement, every lease key the statement writes or removes against the fence its transaction
presented with ``pg_lease_check_fence`` (see migrations 0002 and 0004). This module only presents
the right fence in the right statement:

- ``save()`` puts ``lease_epoch = (SELECT pg_lease_check_fence(key, owner, epoch))`` in its own
  UPDATE or INSERT: one statement presents, checks and writes;
- queryset ``update()``/``delete()`` put the same call in their WHERE clause (evaluated once,
  before any row is read), so a stale fence is refused even when no row matches;
- writes Django spreads over several statements (multi-table inheritance, cascades, bulk writes)
  run in one transaction whose first statement presents the fence.

A fence presented in a transaction locks its lease row FOR KEY SHARE until the transaction ends:
the holder's renewals go on, a takeover or a release waits. Deliberately unfenced writes opt the
transaction out with ``pg_lease_allow_unfenced()`` (which the database lets only granted roles do).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, models, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Expression
from django.db.models.constraints import BaseConstraint
from django.db.models.signals import class_prepared
from django.db.models.sql.compiler import SQLCompiler

from . import sql
from .exceptions import (
    REFUSED_WRITE_ERRORS,
    InvalidInputError,
    LeaseError,
    UnfencedWriteError,
)
from .validation import check_epoch, check_name

if TYPE_CHECKING:
    from typing import Self

    from django.db.backends.base.schema import BaseDatabaseSchemaEditor

__all__ = [
    "Fence",
    "FenceTrigger",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "LeaseKeyField",
    "resolve_fence",
    "unfenced_writes",
]

_M = TypeVar("_M", bound=models.Model)

#: The column a FencedModel records the epoch of its last accepted write in.
EPOCH_FIELD = "lease_epoch"
#: The field storing the key of the lease that guards the row (column ``lease_key``).
KEY_FIELD = "lease"

_unfenced_writes: ContextVar[bool] = ContextVar("pg_lease_unfenced_writes", default=False)


@dataclass(frozen=True)
class _QuerysetScope:
    """The fence (or, with None, the opt-out) of a queryset whose create()/get_or_create()/
    update_or_create() is running: Django's code reaches FencedModel.save() without passing it on."""

    model: type[models.Model]
    token: FenceToken | None


# Taken by the one save of that model that the queryset method makes, and hidden from the saves its
# signal handlers make in turn (they name their own fence).
_queryset_fence: ContextVar[_QuerysetScope | None] = ContextVar("pg_lease_queryset_fence", default=None)


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


@contextmanager
def unfenced_writes() -> Iterator[None]:
    """Allow FencedModel writes without a fence inside the block (this thread/task only).

    The explicit opt-out for writes that no lease holder makes: admin edits, data repair from a
    shell, ``loaddata``. Each such write runs in a transaction that tells the database so
    (``pg_lease_allow_unfenced()``, granted to the migrating role; see docs/security.md).
    Greppable on purpose; also usable as a decorator.
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
        key: the lease key the write is guarded by (or a callable computing it, called only when
            a fence is needed).
        unfenced: the caller's explicit opt-out (``save(unfenced=True)``).
        using: the database alias the write goes to, when known: a lease held (``hold(using=...)``)
            in another database is no fence for it.

    Returns:
        The token to present, or None for a deliberately unfenced write.

    Raises:
        UnfencedWriteError: no fence and no opt-out.
        InvalidInputError: both a fence and ``unfenced=True``; a fence for another key; a fence
            that is not a grant (no ``owner``/``epoch``, wrong types).
    """
    if fence is None:
        if unfenced or _unfenced_writes.get():
            return None
        # Inside hold()/@leased, the active lease of the write's key is the fence (innermost first).
        from .jobs import current_lease

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
                "unfenced_writes()"
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


# ---- what the statements carry ---------------------------------------------------------------


class PresentFence(Expression):
    """``(SELECT pg_lease_check_fence(key, owner, epoch))``: presents the fence, raises if it does not
    hold, and evaluates to its epoch. Uncorrelated, so PostgreSQL runs it once per statement."""

    output_field = models.BigIntegerField()

    def __init__(self, token: FenceToken) -> None:
        super().__init__()
        self.token = token

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> tuple[str, tuple[Any, ...]]:
        call = sql.render(connection, sql.CHECK_FENCE)
        return f"(SELECT {call})", (self.token.key, self.token.owner, self.token.epoch)


class FencePresented(PresentFence):
    """WHERE-clause form of `PresentFence`: a one-time filter evaluated before any row is read."""

    conditional = True
    output_field = models.BooleanField()  # type: ignore[assignment]

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> tuple[str, tuple[Any, ...]]:
        presented, params = super().as_sql(compiler, connection)
        return f"{presented} IS NOT NULL", params


def _present(connection: BaseDatabaseWrapper, token: FenceToken | None) -> None:
    """Present ``token`` (or, for None, opt out) in the current transaction: one statement."""
    with connection.cursor() as cursor:
        if token is None:
            cursor.execute(sql.render(connection, sql.ALLOW_UNFENCED))
        else:
            cursor.execute(f"SELECT {sql.render(connection, sql.CHECK_FENCE)}", [token.key, token.owner, token.epoch])


def _refusal(error: DatabaseError, action: str) -> LeaseError | None:
    """The typed error for a write the database refused by its fence, or None for any other error."""
    cause = error.__cause__
    kind = REFUSED_WRITE_ERRORS.get(getattr(cause, "sqlstate", None) or "")
    if kind is None:
        return None
    diag = cause.diag  # type: ignore[union-attr]
    try:
        fence = json.loads(diag.message_detail or "{}")
    except ValueError:
        fence = {}
    return kind(
        f"{action} refused: {diag.message_primary}",
        key=fence.get("key"),
        owner=fence.get("owner"),
        epoch=fence.get("epoch"),
    )


@contextmanager
def _refusals_raised(action: str) -> Iterator[None]:
    """Turn the database's refusal of a fenced write into `NotOwnerError`, `LapsedError`, ...

    Inside ``atomic()`` a refused statement leaves the transaction to be rolled back, like any
    failed write (wrap the write in its own ``atomic()`` to carry on after a refusal).
    """
    try:
        yield
    except DatabaseError as error:
        refusal = _refusal(error, action)
        if refusal is None:
            raise
        raise refusal from error


@contextmanager
def _in_one_transaction(using: str, token: FenceToken | None, *, present_first: bool) -> Iterator[None]:
    """A transaction for a write Django may spread over several statements; with ``present_first``
    its first statement presents ``token`` (or opts out), so every later statement is covered.

    An opt-out ends with the block (one more statement): the rest of an enclosing transaction is
    fenced again. A presented fence stays for the transaction, as it holds the lease row locked.
    """
    connection = connections[using]
    with transaction.atomic(using=using, savepoint=False):
        if present_first:
            _present(connection, token)
        yield
        if present_first and token is None:
            # Always, not only inside an enclosing atomic(): with autocommit off, this block's
            # end commits nothing either, and the transaction goes on.
            with connection.cursor() as cursor:
                cursor.execute(sql.END_UNFENCED)


# ---- the trigger, installed per model by its migration ----------------------------------------


def _fenced_root(model: type[models.Model]) -> type[models.Model]:
    """The concrete model whose table holds the ``lease_key``/``lease_epoch`` columns of ``model``'s rows."""
    root: type[models.Model] = model._meta.get_field(EPOCH_FIELD).model
    return root._meta.concrete_model or root


class FenceTrigger(BaseConstraint):
    """The triggers that make PostgreSQL refuse stale writes to a FencedModel's table.

    Listed in the model's ``Meta.constraints`` automatically (every concrete FencedModel, and every
    multi-table child of one), so ``makemigrations`` writes an ``AddConstraint`` that installs them,
    as django-pgtrigger does with its own operation; no SQL Django sends is ever rewritten. After
    each INSERT, UPDATE and DELETE statement they check every row's lease against the fence the
    transaction presented; TRUNCATE is refused unless the transaction opted out.
    """

    _TRIGGERS = ("pg_lease_fence_insert", "pg_lease_fence_update", "pg_lease_fence_delete", "pg_lease_fence_truncate")

    def constraint_sql(  # type: ignore[override]
        self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None
    ) -> None:
        # CREATE TABLE: the triggers need the table to exist first.
        assert model is not None and schema_editor is not None
        schema_editor.deferred_sql.append(self.create_sql(model, schema_editor))

    def create_sql(self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None) -> str:
        assert model is not None and schema_editor is not None
        quote = schema_editor.quote_name
        schema = sql.schema(schema_editor.connection)
        table = quote(model._meta.db_table)
        root = _fenced_root(model)
        if root._meta.db_table == model._meta.db_table:
            function, args = f"{schema}.pg_lease_guard_rows", ""
        else:
            # A multi-table child: its rows' keys live in the fenced ancestor's table.
            ancestor = f"{schema}.{quote(root._meta.db_table)}"
            args = ", ".join(f"'{value}'" for value in (ancestor, root._meta.pk.column, model._meta.pk.column))
            function = f"{schema}.pg_lease_guard_inherited_rows"
        each = "FOR EACH STATEMENT EXECUTE FUNCTION"
        return "; ".join(
            [
                f"CREATE TRIGGER pg_lease_fence_insert AFTER INSERT ON {table} "
                f"REFERENCING NEW TABLE AS pg_lease_new {each} {function}({args})",
                f"CREATE TRIGGER pg_lease_fence_update AFTER UPDATE ON {table} "
                f"REFERENCING OLD TABLE AS pg_lease_old NEW TABLE AS pg_lease_new {each} {function}({args})",
                f"CREATE TRIGGER pg_lease_fence_delete AFTER DELETE ON {table} "
                f"REFERENCING OLD TABLE AS pg_lease_old {each} {function}({args})",
                f"CREATE TRIGGER pg_lease_fence_truncate BEFORE TRUNCATE ON {table} "
                f"{each} {schema}.pg_lease_guard_truncate()",
            ]
        )

    def remove_sql(self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None) -> str:
        assert model is not None and schema_editor is not None
        table = schema_editor.quote_name(model._meta.db_table)
        return "; ".join(f"DROP TRIGGER IF EXISTS {name} ON {table}" for name in self._TRIGGERS)

    def validate(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to validate in Python: the database checks every write."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FenceTrigger) and self.name == other.name

    def __hash__(self) -> int:
        return hash((type(self), self.name))


def fence_trigger_name(model: type[models.Model]) -> str:
    """The constraint name of ``model``'s `FenceTrigger` (Django wants one; the triggers are per table)."""
    return f"pg_lease_fence_{model._meta.db_table}"[:63]


def _add_fence_trigger(sender: type[models.Model], **kwargs: Any) -> None:
    """class_prepared: give every concrete FencedModel table (and MTI child table) its FenceTrigger."""
    meta = sender._meta
    if meta.abstract or meta.proxy or not issubclass(sender, FencedModel) or sender.__module__ == "__fake__":
        return
    if any(isinstance(constraint, FenceTrigger) for constraint in meta.constraints):
        return
    meta.constraints = [*meta.constraints, FenceTrigger(name=fence_trigger_name(sender))]
    # Migrations read a model's options from the Meta attributes it declared.
    meta.original_attrs["constraints"] = meta.constraints


class_prepared.connect(_add_fence_trigger)


class LeaseKeyField(models.ForeignKey):  # type: ignore[type-arg]
    """The lease that guards a fenced row: its key, in column ``lease_key``, beside ``lease_epoch``.

    A foreign key without a database constraint, so a fenced model's migration depends on the
    lease app's (its triggers call the lease functions). ``save()`` writes it from
    `FencedModel.get_lease_key`; the database checks it, so Python does not look it up.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("to", "pg_lease_django.Lease")
        kwargs.setdefault("to_field", "key")
        kwargs.setdefault("on_delete", models.DO_NOTHING)
        kwargs.setdefault("db_constraint", False)
        kwargs.setdefault("db_index", False)
        kwargs.setdefault("db_column", "lease_key")
        kwargs.setdefault("related_name", "+")
        kwargs.setdefault("null", True)
        kwargs.setdefault("blank", True)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def validate(self, value: Any, model_instance: models.Model | None) -> None:
        """No lookup: a lease row exists for every key a fence was presented for."""


# ---- querysets -------------------------------------------------------------------------------


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
        clone._pg_lease_token = resolve_fence(fence, lease_key)
        clone._pg_lease_unfenced = False
        return clone

    def unfenced(self) -> Self:
        """Opt this queryset's writes out of fencing, explicitly (admin actions, data repair)."""
        clone = self.all()
        clone._pg_lease_token = None
        clone._pg_lease_unfenced = True
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
        scope = _queryset_fence.set(_QuerysetScope(self.model, self._pg_lease_token))
        try:
            yield
        finally:
            _queryset_fence.reset(scope)

    def update(self, **kwargs: Any) -> int:
        """Update the matched rows if the fence holds for each of them; see the class docstring.

        Returns:
            The number of rows updated.

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: the fence does not hold (even when no row
                matches), or a matched row has a higher epoch; nothing was written.
            UnfencedWriteError: neither ``.fenced()`` nor ``.unfenced()``, or a matched row belongs
                to another lease.
        """
        token = self._token()
        using = self._using()
        if token is None:
            with _in_one_transaction(using, None, present_first=True):
                return super().update(**kwargs)
        kwargs[EPOCH_FIELD] = token.epoch
        guarded = self.filter(FencePresented(token))
        with _refusals_raised("update"):
            if not self.model._meta.parents:
                return models.QuerySet.update(guarded, **kwargs)
            # Multi-table: Django selects the ids, then updates each table. One transaction keeps
            # the fence presented by the first statement for the others.
            with _in_one_transaction(using, token, present_first=False):
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
            with _in_one_transaction(using, None, present_first=True):
                return super().delete()
        guarded = self.filter(FencePresented(token))
        with _refusals_raised("delete"), _in_one_transaction(using, token, present_first=False):
            return models.QuerySet.delete(guarded)

    delete.alters_data = True  # type: ignore[attr-defined]

    def bulk_update(self, objs: Any, fields: Iterable[str], batch_size: int | None = None) -> int:
        """Django's bulk_update(), each batch a fenced `update` (refused up front without a fence)."""
        self._token()
        rows: int = super().bulk_update(objs, fields, batch_size=batch_size)
        return rows

    bulk_update.alters_data = True  # type: ignore[attr-defined]

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[_M]:
        """Django's bulk_create() in one transaction that first presents the fence (or opts out).

        Each object's ``lease_key`` is its own `FencedModel.get_lease_key`; the database refuses
        the batch if any of them is not the fenced lease.
        """
        token = self._token()
        objs = list(objs)
        for obj in objs:
            obj.lease_id = obj._pg_lease_own_key()
            if token is not None:
                obj.lease_epoch = token.epoch
        with _refusals_raised("bulk_create"), _in_one_transaction(self._using(), token, present_first=True):
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

    #: The lease guarding every row of the model; None when `get_lease_key` decides per row.
    lease_key: ClassVar[str | None] = None

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
        scope = _queryset_fence.get()
        hidden = None
        if scope is not None and fence is None and not unfenced and isinstance(self, scope.model):
            fence, unfenced = scope.token, scope.token is None
            hidden = _queryset_fence.set(None)
        try:
            self._pg_lease_token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced, using=using)
            super().save(*args, **kwargs)
        finally:
            self.__dict__.pop("_pg_lease_token", None)
            if hidden is not None:
                _queryset_fence.reset(hidden)

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
        self.lease_id = token.key if token is not None else self._pg_lease_own_key()
        self._pg_lease_presenting = True
        try:
            if token is None:
                with _in_one_transaction(using, None, present_first=True):
                    super().save_base(*args, **kwargs)
                return
            self.lease_epoch = PresentFence(token)
            with _refusals_raised("save"):
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
        signature = inspect.signature(models.Model._save_table)  # type: ignore[attr-defined]
        using = signature.bind(self, *args, **kwargs).arguments.get("using")
        using = using or router.db_for_write(type(self), instance=self)
        self.lease_id = self._pg_lease_own_key()
        if token is not None:
            self.lease_epoch = token.epoch
        with _refusals_raised("save"), _in_one_transaction(using, token, present_first=True):
            return super()._save_table(*args, **kwargs)  # type: ignore[misc]

    def _pg_lease_own_key(self) -> str | None:
        """The lease key this row stores: `get_lease_key`, or what it had when there is none."""
        try:
            return self.get_lease_key()
        except ImproperlyConfigured:
            return self.lease_id

    def delete(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> Any:
        """Delete if ``fence`` is still the live lease of the stored row; raises like `save`.

        Django's delete (signals, cascades, ``keep_parents``) runs in one transaction whose first
        statement presents the fence: two statements at least, all checked by the database.
        """
        using = kwargs.get("using") or (args[0] if args else None) or router.db_for_write(type(self), instance=self)
        token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced, using=using)
        with _refusals_raised("delete"), _in_one_transaction(using, token, present_first=True):
            return super().delete(*args, **kwargs)

    delete.alters_data = True  # type: ignore[attr-defined]

    async def adelete(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> Any:
        """Async `delete`, with the same ``fence``/``unfenced`` arguments."""
        return await sync_to_async(self.delete)(*args, fence=fence, unfenced=unfenced, **kwargs)

    adelete.alters_data = True  # type: ignore[attr-defined]

    def get_lease_key(self) -> str:
        """The lease that guards writes to this row. Defaults to the class attribute ``lease_key``.

        Raises:
            ImproperlyConfigured: neither ``lease_key`` nor an override is defined.
        """
        if self.lease_key is None:
            raise ImproperlyConfigured(f"{type(self).__name__} must set lease_key or override get_lease_key()")
        return self.lease_key
