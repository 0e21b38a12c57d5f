"""A fenced model's lease key, read in Python: the fields it is made of, and its value for one row.

A model declares the key in one of three ways. ``lease_key = "..."`` names it for the whole table.
``lease_key_expression`` names it per row, and the database derives it, as `schema` sets up. Or
the model overrides ``get_lease_key()`` and names the fields in ``lease_key_fields``.

The queryset refuses or recomputes writes to those fields through `key_fields_among`. The model
evaluates the expression for a row with `evaluate_key` and stores a key with `own_key`. The
checks read the declaration through `key_fields`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models


def key_fields(model: Any) -> set[str]:
    """The names of the fields ``model``'s lease key is made of: those its ``lease_key_expression``
    refers to, else its ``lease_key_fields`` (the declaration before the database derived keys)."""
    expression = getattr(model, "lease_key_expression", None)
    if expression is None:
        return set(getattr(model, "lease_key_fields", ()))
    return _field_names(expression)


def _field_names(expression: Any) -> set[str]:
    if isinstance(expression, models.F):
        return {expression.name}  # type: ignore[attr-defined]  # F has .name (untyped)
    names: set[str] = set()
    for part in getattr(expression, "get_source_expressions", list)():
        names |= _field_names(part)
    return names


def key_fields_among(model: Any, names: Iterable[str]) -> set[str]:
    """Which of ``names`` (field names or attnames) are fields ``model``'s lease key derives from."""
    declared = key_fields(model)
    if not declared:
        return set()
    found = set()
    for name in names:
        try:
            field = model._meta.get_field(name)
        except FieldDoesNotExist:
            field = next((f for f in model._meta.concrete_fields if f.attname == name), None)
        if field is not None and field.name in declared:
            found.add(field.name)
    return found


def own_key(row: Any) -> str | None:
    """The lease key ``row`` (a FencedModel) stores: its ``get_lease_key()``, or what it had when there
    is none."""
    try:
        key: str | None = row.get_lease_key()
    except ImproperlyConfigured:
        key = row.lease_id
    return key


def evaluate_key(expression: Any, row: models.Model) -> str | None:
    """``expression`` over ``row`` as the database computes it (F, Value, Concat: NULL parts of a
    Concat count as ''), or ImproperlyConfigured for anything else."""
    from django.db.models.functions import Concat
    from django.db.models.functions.text import ConcatPair

    if isinstance(expression, models.F):
        field = row._meta.get_field(expression.name)  # type: ignore[attr-defined]  # F has .name (untyped)
        value = getattr(row, getattr(field, "attname", expression.name))  # type: ignore[attr-defined]
        return None if value is None else str(value)
    if isinstance(expression, models.Value):
        return None if expression.value is None else str(expression.value)
    if isinstance(expression, Concat | ConcatPair):
        parts = [evaluate_key(part, row) for part in expression.get_source_expressions()]
        return "".join(part or "" for part in parts)
    raise ImproperlyConfigured(
        f"{type(row).__name__}.lease_key_expression uses {type(expression).__name__}, which get_lease_key() does "
        "not evaluate: override get_lease_key() to return the key the database derives"
    )
