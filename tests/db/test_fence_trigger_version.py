"""A fenced table's triggers carry the version of their SQL, so an upgrade that changes it is seen.

``FenceTrigger`` records `FENCE_TRIGGER_VERSION` (a hash of the templates of
``sql/fence_triggers.sql`` that say what a fenced table carries) in the migration
``makemigrations`` writes, and the installed triggers carry it in their comment: a release that
changes the SQL makes ``makemigrations --check`` fail in every app with a fenced model until the
migration that replaces them is written, and check W006 names every table whose installed
triggers are of another version (or missing) until it is applied.
"""

from __future__ import annotations

import hashlib

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection, models

from pg_lease_django.checks import check_fence_triggers_are_current
from pg_lease_django.fencing import schema as fence_schema
from pg_lease_django.fencing.schema import FENCE_TRIGGER_VERSION, INSTALLED, FenceTrigger
from pg_lease_django.sql import named

pytestmark = pytest.mark.django_db


def fenced_models() -> list[type[models.Model]]:
    return [m for m in apps.get_models() if any(isinstance(c, FenceTrigger) for c in m._meta.constraints)]


def test_the_version_is_a_hash_of_the_triggers_sql() -> None:
    """Of every template of the file but the drop (which installs nothing), in the file's order, their
    comment lines left out (a comment changes no trigger)."""
    templates = named("fence_triggers.sql")
    assert [t.name for t in INSTALLED] == [name for name in templates if name != "fence_triggers_drop"]
    hashed = "\n".join(text for name, text in templates.items() if name != "fence_triggers_drop")
    assert hashlib.sha256(hashed.encode()).hexdigest()[:12] == FENCE_TRIGGER_VERSION
    assert {c.version for m in fenced_models() for c in m._meta.constraints if isinstance(c, FenceTrigger)} == {
        FENCE_TRIGGER_VERSION
    }


def test_installed_triggers_carry_the_version_and_the_check_passes() -> None:
    assert len(fenced_models()) >= 4
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT obj_description(oid, 'pg_trigger') FROM pg_trigger "
            "WHERE tgname LIKE 'pg\\_lease\\_fence\\_%%'"
        )
        assert cursor.fetchall() == [(f"pg_lease_django fence trigger {FENCE_TRIGGER_VERSION}",)]
    assert check_fence_triggers_are_current(databases=["default"]) == []
    assert check_fence_triggers_are_current() == []  # a database check: only with --database


@pytest.fixture
def triggers_sql_changed(monkeypatch: pytest.MonkeyPatch) -> str:
    """As after an upgrade whose fence triggers' SQL differs: the code's version and every fenced
    model's FenceTrigger (as class_prepared gives them) carry the new one."""
    changed = hashlib.sha256((FENCE_TRIGGER_VERSION + " changed").encode()).hexdigest()[:12]
    monkeypatch.setattr(fence_schema, "FENCE_TRIGGER_VERSION", changed)
    for model in fenced_models():
        for constraint in model._meta.constraints:
            if isinstance(constraint, FenceTrigger):
                monkeypatch.setattr(constraint, "version", changed)
    return changed


@pytest.mark.usefixtures("triggers_sql_changed")
def test_changed_trigger_sql_without_a_migration_fails_makemigrations_check() -> None:
    call_command("makemigrations", "pg_lease_django", "--check", "--dry-run", verbosity=0)  # the lease app: nothing
    for app in ("testapp", "compatapp"):
        with pytest.raises(SystemExit) as exited:
            call_command("makemigrations", app, "--check", "--dry-run", verbosity=0)
        assert exited.value.code == 1, app


def test_the_check_names_tables_with_triggers_of_another_version(triggers_sql_changed: str) -> None:
    warnings = check_fence_triggers_are_current(databases=["default"])
    assert {w.obj for w in warnings} == set(fenced_models())
    for warning in warnings:
        assert warning.id == "pg_lease_django.W006"
        assert f"installed: pg_lease_django fence trigger {FENCE_TRIGGER_VERSION}" in warning.msg
        assert triggers_sql_changed in warning.msg
        assert f"makemigrations {warning.obj._meta.app_label}" in (warning.hint or "")


def test_the_check_names_missing_and_unversioned_triggers() -> None:
    """A trigger dropped by hand, and one installed before triggers carried a version (rolled back)."""
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER pg_lease_fence_delete ON testapp_invoice")
        cursor.execute("COMMENT ON TRIGGER pg_lease_fence_update ON testapp_invoice IS NULL")
    [warning] = check_fence_triggers_are_current(databases=["default"])
    assert warning.obj._meta.db_table == "testapp_invoice"
    assert "installed: no version" in warning.msg
    assert "missing: pg_lease_fence_delete" in warning.msg
