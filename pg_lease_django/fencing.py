"""FencedModel: rows the database refuses to write for a holder that lost its lease.

Every fenced write carries the check ``(SELECT pg_lease_fence(key, owner, epoch)) = 'ok'`` in its own
WHERE clause (see migration 0002): the check and the write are one statement, and the lease row
stays locked FOR SHARE until the writer's transaction ends, so no takeover can commit in between.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, models, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, Expression, Q
from django.db.models.sql.compiler import SQLCompiler

from .exceptions import (
    EpochMismatchError,
    InvalidInputError,
    LeaseLostError,
    NotOwnerError,
    UnfencedWriteError,
)
from .managers import _LOST_ERRORS
from .validation import check_epoch, check_name

if TYPE_CHECKING:
    from typing import Self

__all__ = ["Fence", "FencedManager", "FencedModel", "FencedQuerySet", "resolve_fence", "unfenced_writes"]

_M = TypeVar("_M", bound=models.Model)
_QS = TypeVar("_QS", bound=models.QuerySet[Any])

#: The column a FencedModel records the epoch of its last accepted write in.
EPOCH_FIELD = "lease_epoch"

_LOST = _LOST_ERRORS  # verdict -> exception, the manager's one mapping

# Evaluated once per statement, before any row is read: an uncorrelated sub-select becomes an
# InitPlan that gates the scan (EXPLAIN shows "One-Time Filter"). Calling the volatile function
# per row instead could accept some rows and refuse others as the lease lapses mid-statement.
_FENCE_SQL = "(SELECT pg_lease_fence(%s, %s, %s)) = 'ok'"

_unfenced_writes: ContextVar[bool] = ContextVar("pg_lease_unfenced_writes", default=False)


class Fence(Protocol):
    """Anything that names a lease grant: a `Grant` is one.

    ``key`` is optional: when present it must match the model's lease key.
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
    shell, ``loaddata``, ``get_or_create``. Greppable on purpose; also usable as a decorator.
    """
    token = _unfenced_writes.set(True)
    try:
        yield
    finally:
        _unfenced_writes.reset(token)


def resolve_fence(fence: Fence | None, key: str | Callable[[], str], *, unfenced: bool = False) -> FenceToken | None:
    """Decide which lease guards a write: the one place that does.

    Args:
        fence: the caller's grant, or None.
        key: the lease key the write is guarded by (or a callable computing it, called only when
            a fence is given).
        unfenced: the caller's explicit opt-out (``save(unfenced=True)``).

    Returns:
        The token to check, or None for a deliberately unfenced write.

    Raises:
        UnfencedWriteError: no fence and no opt-out.
        InvalidInputError: both a fence and ``unfenced=True``; a fence for another key; bad values.
    """
    if fence is None:
        if unfenced or _unfenced_writes.get():
            return None
        # Inside hold()/@leased, the active lease of the write's key is the fence (innermost first).
        from .jobs import current_lease

        if current_lease() is not None and (lease_key := key() if callable(key) else key):
            fence = current_lease(lease_key)
        if fence is None:
            raise UnfencedWriteError(
                "write to a FencedModel without a fence: pass fence=grant (querysets: .fenced(grant)), hold its "
                "lease with hold()/@leased, or opt out explicitly with unfenced=True / .unfenced() / unfenced_writes()"
            )
    if unfenced:
        raise InvalidInputError("pass either a fence or unfenced=True, not both")
    lease_key = check_name("key", key() if callable(key) else key)
    owner = check_name("owner", fence.owner)
    epoch = check_epoch(fence.epoch)
    fence_key = getattr(fence, "key", None)
    if fence_key is not None and fence_key != lease_key:
        raise InvalidInputError(
            f"the fence is a grant for lease {fence_key!r}, but this write is guarded by lease {lease_key!r}",
            key=lease_key,
            owner=owner,
            epoch=epoch,
        )
    return FenceToken(lease_key, owner, epoch)


class _Rejected(Exception):
    """Carries a fence rejection out of Django's save machinery to FencedModel.save()."""

    def __init__(self, error: LeaseLostError) -> None:
        super().__init__(str(error))
        self.error = error


class FenceHolds(Expression):
    """SQL condition: ``token`` is the live lease (``pg_lease_fence(...) = 'ok'``), checked once per statement."""

    conditional = True
    output_field = models.BooleanField()

    def __init__(self, token: FenceToken) -> None:
        super().__init__()
        self.token = token

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> tuple[str, tuple[Any, ...]]:
        return _FENCE_SQL, (self.token.key, self.token.owner, self.token.epoch)


def _has_epoch_field(model: type[models.Model]) -> bool:
    return any(f.name == EPOCH_FIELD for f in model._meta.concrete_fields)


def _guard(qs: _QS, token: FenceToken, *, whole_set: bool) -> _QS:
    """``qs`` restricted to what ``token`` may write: the fence holds, and no row epoch goes backwards.

    With ``whole_set``, a single row already written at a higher epoch refuses the whole statement
    (all or nothing) instead of being skipped; the per-row condition still catches a row raised
    concurrently (re-checked on the new row version at READ COMMITTED).
    """
    if not _has_epoch_field(qs.model):
        return qs.filter(FenceHolds(token))
    not_newer = Q(**{f"{EPOCH_FIELD}__isnull": True}) | Q(**{f"{EPOCH_FIELD}__lte": token.epoch})
    if whole_set:
        return qs.filter(FenceHolds(token), not_newer, ~Exists(qs.filter(**{f"{EPOCH_FIELD}__gt": token.epoch})))
    return qs.filter(FenceHolds(token), not_newer)


def _lost(verdict: str, token: FenceToken, action: str) -> LeaseLostError:
    return _LOST[verdict](
        f"{action} refused: lease {token.key!r} is not held by {token.owner!r} at epoch {token.epoch} ({verdict})",
        key=token.key,
        owner=token.owner,
        epoch=token.epoch,
    )


def _diagnose(
    connection: BaseDatabaseWrapper, token: FenceToken, rows: models.QuerySet[Any], action: str
) -> LeaseLostError | None:
    """Why a guarded statement wrote nothing: the lease error, or None when the fence held."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_lease_fence_outcome(%s, %s, %s)", [token.key, token.owner, token.epoch])
        row = cursor.fetchone()
    verdict = row[0] if row else None
    if verdict != "ok":
        return _lost(verdict or "not_owner", token, action)
    if _has_epoch_field(rows.model) and rows.filter(**{f"{EPOCH_FIELD}__gt": token.epoch}).exists():
        return EpochMismatchError(
            f"{action} refused: a row was already written at an epoch above {token.epoch} (lease {token.key!r}); "
            "row epochs never go backwards",
            key=token.key,
            owner=token.owner,
            epoch=token.epoch,
        )
    return None


# ---- INSERT: INSERT INTO t (cols) VALUES (v) -> INSERT INTO t (cols) SELECT v WHERE <fence> ----

_PLACEHOLDER = re.compile(r"%%|%s")


class _InsertRefused(Exception):
    """The fenced INSERT inserted no row."""


def _values_span(sql: str) -> tuple[int, int]:
    """Start of `` VALUES (`` and index of its closing parenthesis, skipping quoted text."""
    depth, i, start = 0, 0, -1
    while i < len(sql):
        char = sql[i]
        if char in "'\"":
            i = sql.index(char, i + 1)
            while sql.startswith(char, i + 1):  # doubled quote: an escaped one
                i = sql.index(char, i + 2)
        elif char == "(":
            if depth == 0 and start < 0 and sql.endswith(" VALUES ", 0, i):
                start = i - len(" VALUES ")
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0 and start >= 0:
                return start, i
        i += 1
    raise ValueError("no VALUES list")


def _fence_insert(sql: str, params: Any, token: FenceToken) -> tuple[str, tuple[Any, ...]]:
    """Rewrite Django's single-row INSERT so it inserts only while the fence holds (same statement)."""
    try:
        start, end = _values_span(sql)
    except ValueError:
        start = end = -1
    if not sql.startswith("INSERT INTO ") or start < 0 or sql[end + 1 :].lstrip().startswith(","):
        raise DatabaseError(f"FencedModel cannot fence this INSERT (expected one VALUES row): {sql[:200]}")
    values = sql[start + len(" VALUES (") : end]
    if re.search(r"\bDEFAULT\b", values):
        # Django 5.2 renders a db_default field as DEFAULT, which INSERT ... SELECT cannot carry.
        raise DatabaseError(
            "FencedModel cannot fence an INSERT that uses a column DEFAULT (db_default on Django 5.2): "
            "give the field a value before a fenced save"
        )
    consumed = sum(1 for m in _PLACEHOLDER.finditer(values) if m.group() == "%s")
    params = tuple(params or ())
    fenced_sql = f"{sql[:start]} SELECT {values} WHERE {_FENCE_SQL}{sql[end + 1 :]}"
    return fenced_sql, (*params[:consumed], token.key, token.owner, token.epoch, *params[consumed:])


class _InsertGuard:
    """Execute wrapper (``connection.execute_wrapper``) that fences the one INSERT of a save."""

    def __init__(self, token: FenceToken) -> None:
        self.token = token
        self.used = False

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if self.used or many:
            raise DatabaseError("FencedModel expected exactly one INSERT statement per save")
        self.used = True
        sql, params = _fence_insert(sql, params, self.token)
        result = execute(sql, params, many, context)
        if context["cursor"].rowcount == 0:
            raise _InsertRefused
        return result


# ---- querysets -------------------------------------------------------------------------------


class FencedQuerySet(models.QuerySet[_M]):
    """QuerySet whose ``update()`` and ``delete()`` are fenced, or refused without a fence.

    ``Invoice.objects.fenced(grant).filter(...).update(status="sent")`` writes only while
    ``grant`` is the live lease, sets ``lease_epoch`` to the grant's epoch, and is all or nothing:
    it raises `EpochMismatchError` if any matched row was written at a higher epoch.
    ``.unfenced()`` opts out explicitly. ``bulk_create()`` bypasses ``save()`` and cannot be fenced:
    it is refused unless unfenced.
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
        """Guard this queryset's ``update()`` and ``delete()`` with ``fence``.

        Args:
            fence: the grant the writes must still hold (a `Grant`).
            key: the lease key; defaults to the model's ``lease_key``, else the fence's ``key``.

        Raises:
            InvalidInputError: no key can be found, or the fence is for another key.
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
        return resolve_fence(None, getattr(self.model, "lease_key", None) or "", unfenced=self._pg_lease_unfenced)

    def _write_connection(self) -> BaseDatabaseWrapper:
        alias: str | None = self._db  # type: ignore[attr-defined]
        return connections[alias or router.db_for_write(self.model, **self._hints)]  # type: ignore[attr-defined]

    def update(self, **kwargs: Any) -> int:
        """Update the matched rows if the fence holds; see the class docstring.

        Returns:
            The number of rows updated (0 when nothing matched and the fence holds).

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: the fence does not hold, or a matched row
                has a higher epoch; nothing was written and the transaction is still usable.
            UnfencedWriteError: neither ``.fenced()`` nor ``.unfenced()``.
        """
        token = self._token()
        if token is None:
            return super().update(**kwargs)
        if _has_epoch_field(self.model):
            kwargs[EPOCH_FIELD] = token.epoch
        rows: int = super(FencedQuerySet, _guard(self, token, whole_set=True)).update(**kwargs)
        if rows == 0:
            error = _diagnose(self._write_connection(), token, self, "update")
            if error is not None:
                raise error
        return rows

    update.alters_data = True  # type: ignore[attr-defined]

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete the matched rows if the fence holds; raises like `update`.

        Cascades and signals run as in Django's ``delete()``, inside one transaction that keeps the
        lease row locked; cascaded rows of other models are not fenced themselves.
        """
        token = self._token()
        if token is None:
            return super().delete()
        guarded = _guard(self, token, whole_set=True)
        connection = self._write_connection()
        with transaction.atomic(using=connection.alias, savepoint=False):
            deleted, per_model = super(FencedQuerySet, guarded).delete()
            error = _diagnose(connection, token, self, "delete") if deleted == 0 else None
        # Raised outside the atomic block: nothing was written, the caller's transaction stays usable.
        if error is not None:
            raise error
        return deleted, per_model

    delete.alters_data = True  # type: ignore[attr-defined]

    def bulk_update(self, *args: Any, **kwargs: Any) -> int:
        """Django's bulk_update(), whose per-batch ``update()`` calls are fenced.

        Refused up front without a fence. A refusal by the fence happens inside the transaction
        Django opens for the batches, which marks an enclosing ``atomic()`` for rollback.
        """
        self._token()
        rows: int = super().bulk_update(*args, **kwargs)
        return rows

    bulk_update.alters_data = True  # type: ignore[attr-defined]

    def bulk_create(self, *args: Any, **kwargs: Any) -> list[_M]:
        """Refused unless unfenced: it bypasses ``save()``. Save objects one by one with a fence instead."""
        if not (self._pg_lease_unfenced or _unfenced_writes.get()):
            raise UnfencedWriteError(
                f"bulk_create() on {self.model.__name__} cannot be fenced; save each object with fence=..., "
                "or opt out with .unfenced() / unfenced_writes()"
            )
        return super().bulk_create(*args, **kwargs)


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


class FencedModel(models.Model):
    """Abstract model whose writes land only while the writer holds its lease.

    Subclasses name the lease with ``lease_key = "billing"`` or by overriding
    `get_lease_key`, and write with ``obj.save(fence=grant)`` / ``obj.delete(fence=grant)`` /
    ``Model.objects.fenced(grant).update(...)``. A write is accepted only if, on the server clock,
    the lease is held by ``grant.owner`` at ``grant.epoch`` and has not lapsed; otherwise it raises
    `NotOwnerError`, `LapsedError` or `EpochMismatchError`, writes nothing and
    leaves the caller's transaction usable. Writes without a fence raise
    `UnfencedWriteError` unless opted out (``unfenced=True``, ``unfenced_writes()``).

    ``lease_epoch`` records the epoch of the last accepted write; a write at a lower epoch is
    refused (`EpochMismatchError`), so a row's epoch never goes backwards.

    The model must live in the database that holds the leases (system check
    ``pg_lease_django.E002``).
    """

    #: The lease guarding every row of the model; None when `get_lease_key` decides per row.
    lease_key: ClassVar[str | None] = None

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
            **kwargs: passed to Django's ``save()`` (``update_fields`` gains ``lease_epoch``).

        Raises:
            NotOwnerError, LapsedError, EpochMismatchError: refused; nothing was written, the instance
                keeps its previous ``lease_epoch``, and the caller's transaction is still usable.
            UnfencedWriteError: neither a fence nor an opt-out.
            InvalidInputError: a fence for another lease key, or a malformed fence.
        """
        token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced)
        if token is not None and kwargs.get("update_fields"):  # empty update_fields: Django saves nothing
            kwargs["update_fields"] = {*kwargs["update_fields"], EPOCH_FIELD}
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        previous_epoch = self.lease_epoch
        if token is not None:
            self.lease_epoch = token.epoch
        self._pg_lease_token = token
        try:
            super().save(*args, **kwargs)
        except _Rejected as rejected:
            self.lease_epoch = previous_epoch
            # Django marked the enclosing atomic block for rollback. The refused statement wrote
            # nothing and raised no database error, so the transaction is sound: unmark it. Not for
            # multi-table models, whose parent row may already have been written.
            if connections[using].in_atomic_block and not self._meta.parents:
                transaction.set_rollback(False, using=using)
            raise rejected.error from None
        except BaseException:
            self.lease_epoch = previous_epoch
            raise
        finally:
            self.__dict__.pop("_pg_lease_token", None)

    save.alters_data = True  # type: ignore[attr-defined]

    def delete(self, *args: Any, fence: Fence | None = None, unfenced: bool = False, **kwargs: Any) -> Any:
        """Delete if ``fence`` is still the live lease; raises like `save`.

        Django's delete (signals, cascades, ``keep_parents``) runs after a fenced check of this row,
        in one transaction that keeps the lease row locked: two statements, not one.
        """
        token = resolve_fence(fence, self.get_lease_key, unfenced=unfenced)
        if token is None:
            return super().delete(*args, **kwargs)
        using = kwargs.get("using") or (args[0] if args else None) or router.db_for_write(type(self), instance=self)
        rows = type(self)._base_manager.using(using).filter(pk=self.pk)
        with transaction.atomic(using=using, savepoint=False):
            if _guard(rows, token, whole_set=False).exists():
                error = None
            else:
                error = _diagnose(connections[using], token, rows, "delete")
            if error is None:
                result = super().delete(*args, **kwargs)
        if error is not None:
            raise error
        return result

    delete.alters_data = True  # type: ignore[attr-defined]

    def get_lease_key(self) -> str:
        """The lease that guards writes to this row. Defaults to the class attribute ``lease_key``.

        Raises:
            ImproperlyConfigured: neither ``lease_key`` nor an override is defined.
        """
        if self.lease_key is None:
            raise ImproperlyConfigured(f"{type(self).__name__} must set lease_key or override get_lease_key()")
        return self.lease_key

    def save_base(self, *args: Any, **kwargs: Any) -> None:
        """Django's save_base(), refusing up front (before signals) when called without save()'s fence."""
        if "_pg_lease_token" not in self.__dict__:
            resolve_fence(None, "")
        super().save_base(*args, **kwargs)

    save_base.alters_data = True  # type: ignore[attr-defined]

    def _pending_token(self) -> FenceToken | None:
        # Absent when Model.save_base() is called directly (loaddata does): refuse unless opted out.
        if "_pg_lease_token" not in self.__dict__:
            return resolve_fence(None, "")
        token: FenceToken | None = self.__dict__["_pg_lease_token"]
        return token

    def _do_update(
        self,
        base_qs: models.QuerySet[Any],
        using: str | None,
        pk_val: Any,
        values: Any,
        update_fields: Any,
        forced_update: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        token = self._pending_token()
        if token is None:
            return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update, *args, **kwargs)
        guarded = _guard(base_qs, token, whole_set=False)
        result = super()._do_update(guarded, using, pk_val, values, update_fields, forced_update, *args, **kwargs)
        if result:
            return result
        # Nothing updated: the fence failed, the row is newer, or the row does not exist (Django
        # then inserts, and the insert is fenced too).
        error = _diagnose(connections[using or DEFAULT_DB_ALIAS], token, base_qs.filter(pk=pk_val), "save")
        if error is not None:
            raise _Rejected(error)
        return result

    def _do_insert(self, manager: models.Manager[Any], using: str, *args: Any, **kwargs: Any) -> Any:
        token = self._pending_token()
        if token is None:
            return super()._do_insert(manager, using, *args, **kwargs)  # type: ignore[misc]
        connection = connections[using]
        try:
            with connection.execute_wrapper(_InsertGuard(token)):
                return super()._do_insert(manager, using, *args, **kwargs)  # type: ignore[misc]
        except _InsertRefused:
            pass
        error = _diagnose(connection, token, manager.none(), "save")
        raise _Rejected(error or NotOwnerError("save refused: the fenced insert wrote nothing", key=token.key))
