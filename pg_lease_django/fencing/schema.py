"""What a fenced table carries: its lease key column and the triggers that refuse stale writes.

Both classes are written into users' migrations as ``pg_lease_django.fencing.LeaseKeyField`` and
``pg_lease_django.fencing.FenceTrigger`` (the package re-exports them); their ``deconstruct()``
keeps that path, so where they live changes no migration.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models.constraints import BaseConstraint
from django.db.models.sql import Query
from psycopg import sql as pgsql

from pg_lease_django.sql import run, statements

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor

#: The column a FencedModel records the epoch of its last accepted write in.
EPOCH_FIELD = "lease_epoch"
#: The field storing the key of the lease that guards the row (column ``lease_key``).
KEY_FIELD = "lease"

#: The module users' migrations import `LeaseKeyField` and `FenceTrigger` from.
PUBLIC_MODULE = "pg_lease_django.fencing"


def _public_path(path: str) -> str:
    """``path`` as users' migrations spell it: this module's classes under `PUBLIC_MODULE`."""
    module, _, name = path.rpartition(".")
    return f"{PUBLIC_MODULE}.{name}" if module == __name__ else path


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

    def deconstruct(self) -> tuple[str, str, Sequence[Any], dict[str, Any]]:
        name, path, args, kwargs = super().deconstruct()
        return name, _public_path(path), args, kwargs

    def validate(self, value: Any, model_instance: models.Model | None) -> None:
        """No lookup: a lease row exists for every key a fence was presented for."""


def fenced_root(model: type[models.Model]) -> type[models.Model]:
    """The concrete model whose table holds the ``lease_key``/``lease_epoch`` columns of ``model``'s rows."""
    root: type[models.Model] = model._meta.get_field(EPOCH_FIELD).model
    return root._meta.concrete_model or root


#: The templates of ``sql/fence_triggers.sql`` that say what a fenced table carries (its drop is left
#: out: it installs nothing).
INSTALLED = (
    statements.FENCE_TRIGGERS_CREATE,
    statements.FENCE_GUARD_ROWS,
    statements.FENCE_GUARD_INHERITED_ROWS,
    statements.FENCE_DERIVE_KEY,
    statements.FENCE_DERIVE_KEY_BODY,
)

#: The triggers of ``fence_triggers_create``, each commented with the version that installed it.
TRIGGER_NAMES = ("pg_lease_fence_insert", "pg_lease_fence_update", "pg_lease_fence_delete", "pg_lease_fence_truncate")
#: The trigger that derives the stored key (a table whose model declares its key has it too).
DERIVE_TRIGGER = "pg_lease_derive_key"

#: A hash of the `INSTALLED` templates' text: what users' migrations record, and the installed
#: triggers' comments carry. Changing a template changes it, so ``makemigrations`` writes a
#: migration that replaces the triggers in every app with a fenced model.
FENCE_TRIGGER_VERSION = hashlib.sha256("\n".join(template.text for template in INSTALLED).encode()).hexdigest()[:12]

#: How an installed trigger's comment names its version (the comment is exactly this).
VERSION_COMMENT = "pg_lease_django fence trigger {version}"


class FenceTrigger(BaseConstraint):
    """The triggers that make PostgreSQL refuse stale writes to a FencedModel's table.

    They are listed in the model's ``Meta.constraints`` automatically, for every concrete FencedModel
    and every multi-table child of one. So ``makemigrations`` writes an ``AddConstraint`` that installs
    them, as django-pgtrigger does with its own operation; no SQL Django sends is ever rewritten. After
    each INSERT, UPDATE and DELETE statement they check every row's lease against the fence the
    transaction presented. TRUNCATE is refused unless the transaction opted out.

    ``version`` is `FENCE_TRIGGER_VERSION` when the migration was written. A release that changes the
    triggers' SQL changes it, so ``makemigrations`` writes a migration that replaces them with a
    ``RemoveConstraint`` and an ``AddConstraint``. Check W006, run with ``check --database``, names the
    tables whose installed triggers are of another version. The SQL installed is always the one of the
    package running the migration, commented with its version.
    """

    def __init__(self, *, name: str, version: str | None = None, key: Any = None, **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.version = version
        #: The lease key the database derives for each row (a Django expression over the row's
        #: fields), or None: the key each writer stores is checked, not derived (see ``fence_derive_key``
        #: in ``sql/fence_triggers.sql``).
        self.key = key

    def trigger_names(self) -> tuple[str, ...]:
        """The triggers it installs, each commented with its version."""
        return (*TRIGGER_NAMES, DERIVE_TRIGGER) if self.key is not None else TRIGGER_NAMES

    def constraint_sql(  # type: ignore[override]
        self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None
    ) -> None:
        # CREATE TABLE: the triggers need the table to exist first.
        assert model is not None and schema_editor is not None
        schema_editor.deferred_sql.append(self.create_sql(model, schema_editor))

    def create_sql(self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None) -> str:
        """The triggers' DDL (``sql/fence_triggers.sql``), and first the derive trigger's for a declared key."""
        assert model is not None and schema_editor is not None
        connection = schema_editor.connection
        schema = run.schema_name(connection)
        root = fenced_root(model)
        if root._meta.db_table == model._meta.db_table:
            guard = statements.FENCE_GUARD_ROWS.compose(schema)
        else:
            # A multi-table child: its rows' keys live in the fenced ancestor's table.
            ancestor = pgsql.Identifier(schema, root._meta.db_table).as_string(None)
            guard = statements.FENCE_GUARD_INHERITED_ROWS.compose(
                schema,
                ancestor=pgsql.Literal(ancestor),
                ancestor_pk=pgsql.Literal(root._meta.pk.column),
                child_pk=pgsql.Literal(model._meta.pk.column),
            )
        triggers = run.render(
            connection, statements.FENCE_TRIGGERS_CREATE, table=_table(model), guard=guard, comment=_comment()
        )
        if self.key is None:
            return triggers
        return self._derive_sql(model, schema_editor) + "\n" + triggers

    def _derive_sql(self, model: type[models.Model], schema_editor: BaseDatabaseSchemaEditor) -> str:
        connection = schema_editor.connection

        def compiled(query: Query, resolved: Any) -> pgsql.SQL:
            # The ORM's SQL for the expression, its parameters made literals as Django's own DDL does.
            text, params = connection.ops.compiler("SQLCompiler")(query, connection, using=None).compile(resolved)
            return pgsql.SQL(str(text % tuple(schema_editor.quote_value(p) for p in params)))

        over_table = Query(model, alias_cols=False)
        stored = compiled(over_table, self.key.resolve_expression(over_table, allow_joins=False))
        over_row = Query(model)
        resolved = self.key.resolve_expression(over_row, allow_joins=False)
        expression = compiled(over_row, resolved.relabeled_clone({model._meta.db_table: "new"}))
        body = run.render(connection, statements.FENCE_DERIVE_KEY_BODY, expression=expression)
        read = {col.target.column for col in _columns(resolved) if col.target.column != KEY_COLUMN}
        columns = pgsql.SQL(", ").join(pgsql.Identifier(column) for column in [KEY_COLUMN, *sorted(read)])
        return run.render(
            connection,
            statements.FENCE_DERIVE_KEY,
            function=pgsql.Identifier(_derive_function(model)),
            body=pgsql.Literal(body),
            columns=columns,
            table=_table(model),
            comment=_comment(),
            stored=stored,
        )

    def remove_sql(self, model: type[models.Model] | None, schema_editor: BaseDatabaseSchemaEditor | None) -> str:
        assert model is not None and schema_editor is not None
        return run.render(
            schema_editor.connection,
            statements.FENCE_TRIGGERS_DROP,
            table=_table(model),
            function=pgsql.Identifier(_derive_function(model)),
        )

    def validate(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to validate in Python: the database checks every write."""

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        path, args, kwargs = super().deconstruct()
        if self.version is not None:
            kwargs["version"] = self.version
        if self.key is not None:
            kwargs["key"] = self.key
        return _public_path(path), args, kwargs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FenceTrigger) and (self.name, self.version, self.key) == (
            other.name,
            other.version,
            other.key,
        )

    def __hash__(self) -> int:
        return hash((type(self), self.name, self.version))


#: The column a fenced row stores its lease key in.
KEY_COLUMN = "lease_key"


def _table(model: type[models.Model]) -> pgsql.Identifier:
    """``model``'s table, unqualified as Django's own DDL names it (found on the search_path)."""
    return pgsql.Identifier(model._meta.db_table)


def _comment() -> pgsql.Literal:
    """The comment each installed trigger carries: its version."""
    return pgsql.Literal(VERSION_COMMENT.format(version=FENCE_TRIGGER_VERSION))


def _derive_function(model: type[models.Model]) -> str:
    """The name of the trigger function that derives ``model``'s lease keys (one per table, <= 63 bytes)."""
    table = model._meta.db_table
    name = f"{table}_lease_key"
    if len(name.encode()) <= 63:
        return name
    return f"{table.encode()[:40].decode(errors='ignore')}_{hashlib.sha256(table.encode()).hexdigest()[:8]}_lease_key"


def _columns(expression: Any) -> list[Any]:
    """The column references (``Col``) of a resolved expression, at any depth."""
    from django.db.models.expressions import Col

    return [node for node in expression.flatten() if isinstance(node, Col)]


def declared_key(model: type[models.Model]) -> Any:
    """The lease key ``model`` declares as an expression the database can derive: its
    ``lease_key_expression``, or its class-level ``lease_key`` as a constant; None when neither."""
    expression = getattr(model, "lease_key_expression", None)
    if expression is not None:
        return expression
    constant = getattr(model, "lease_key", None)
    return models.Value(constant) if isinstance(constant, str) else None


def fence_trigger_name(model: type[models.Model]) -> str:
    """The constraint name of ``model``'s `FenceTrigger` (Django wants one; the triggers are per table)."""
    return f"pg_lease_fence_{model._meta.db_table}"[:63]


def add_fence_trigger(model: type[models.Model]) -> None:
    """List a `FenceTrigger` in the constraints of a fenced model's own table (once; none for an
    abstract or proxy model, or a migration's historical one), where ``makemigrations`` finds it."""
    meta = model._meta
    if meta.abstract or meta.proxy or model.__module__ == "__fake__":
        return
    if any(isinstance(constraint, FenceTrigger) for constraint in meta.constraints):
        return
    key = declared_key(model) if fenced_root(model) is model else None  # an MTI child's key is its root's
    trigger = FenceTrigger(name=fence_trigger_name(model), version=FENCE_TRIGGER_VERSION, key=key)
    meta.constraints = [*meta.constraints, trigger]
    # Migrations read a model's options from the Meta attributes it declared.
    meta.original_attrs["constraints"] = meta.constraints
