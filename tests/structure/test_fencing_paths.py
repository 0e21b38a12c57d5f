"""The import paths a fenced model's migration is written with, and the names it imports.

``makemigrations --check`` cannot see a moved class: old and new migration states hold the same
class object, so both deconstruct to the same path. What users' migrations say is pinned here.
"""

from __future__ import annotations

import pytest
from django.db.migrations.writer import MigrationWriter

from devkit.testapp.models import Invoice
from pg_lease_django import fencing
from pg_lease_django.fencing.schema import FENCE_TRIGGER_VERSION
from tests.compatapp.models import Ledger


@pytest.mark.parametrize("model", [Invoice, Ledger])
def test_migrations_import_the_fence_classes_from_fencing(model: type[fencing.FencedModel]) -> None:
    field, field_imports = MigrationWriter.serialize(model._meta.get_field("lease"))
    [trigger] = [c for c in model._meta.constraints if isinstance(c, fencing.FenceTrigger)]
    constraint, constraint_imports = MigrationWriter.serialize(trigger)
    assert field.startswith("pg_lease_django.fencing.LeaseKeyField(")
    key = "key=models.F('account'), " if trigger.key is not None else ""  # Invoice declares its key
    assert constraint == (
        f"pg_lease_django.fencing.FenceTrigger({key}name={trigger.name!r}, version={FENCE_TRIGGER_VERSION!r})"
    )
    assert "import pg_lease_django.fencing" in field_imports & constraint_imports


def test_every_public_name_stays_importable_from_fencing() -> None:
    for name in fencing.__all__:
        assert getattr(fencing, name).__name__ == name
