"""Django's private and undocumented APIs that pg_lease_django leans on, each pinned by a test.

docs/COMPATIBILITY.md, "Django internals we lean on", lists them: where the package uses each,
what it relies on, and the test here that pins it. A Django release that changes one fails that
test with a message naming the API and the page (`leaning_on`). Where supported Django versions
differ, the test accepts each version's form explicitly (`SIGNATURES`, `for_this_django`), and the
page says so. Most tests need no database; those marked ``django_db`` need one for the behaviour they
check (a connect, an ``atomic()``, the migration tables, PostgreSQL's client-side parameter merge).
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from django.apps import apps as django_apps
from django.contrib.admin import ModelAdmin
from django.contrib.admin.models import LogEntryManager
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    DataError,
    IntegrityError,
    InternalError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.creation import TEST_DATABASE_PREFIX
from django.db.backends.postgresql.base import DatabaseWrapper as PostgreSQLDatabaseWrapper
from django.db.backends.postgresql.schema import DatabaseSchemaEditor as PostgreSQLSchemaEditor
from django.db.backends.utils import CursorWrapper
from django.db.migrations import RunSQL
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from django.db.models import F, Value
from django.db.models.constraints import BaseConstraint
from django.db.models.functions import Concat
from django.db.models.sql import Query
from django.db.transaction import TransactionManagementError
from django.db.utils import DatabaseErrorWrapper, load_backend
from django.test.runner import DiscoverRunner

import pg_lease_django
from devkit.testapp.models import ArchivedReport, CommitTicket, CreditNote, Invoice, Report
from pg_lease_django.fencing import FencedModel, FenceTrigger
from pg_lease_django.management.leases.arguments import SubcommandParser
from pg_lease_django.models import Lease
from tests.parsing import parse

#: Where the internals are listed; every failure here points at it.
DOC = 'docs/COMPATIBILITY.md, "Django internals we lean on"'
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "COMPATIBILITY.md"
#: The package whose modules the page cites.
PACKAGE = Path(pg_lease_django.__file__).parent

#: The connection object itself (``django.db.connection`` is a proxy to it).
connection = connections[DEFAULT_DB_ALIAS]


@contextmanager
def leaning_on(api: str) -> Iterator[None]:
    """Fail naming ``api`` and `DOC` when the block raises (a failed assertion included)."""
    try:
        yield
    except (Exception, pytest.fail.Exception) as exc:  # a failed assertion, pytest.raises' "did not raise"
        pytest.fail(
            f"Django {django.get_version()} changed {api}, which pg_lease_django leans on ({DOC}): "
            f"{type(exc).__name__}: {exc}",
            pytrace=False,
        )


def for_this_django(forms: dict[tuple[int, int], str]) -> str:
    """The form of the newest Django version listed that is not newer than the running one (the
    oldest listed form for an older Django): a later release is held to its predecessor's form."""
    running = django.VERSION[:2]
    listed = sorted(forms)
    return forms[max((v for v in listed if v <= running), default=listed[0])]


def fresh_wrapper(alias: str = "pg-lease-internals", **options: Any) -> BaseDatabaseWrapper:
    """A Django connection of its own for the test database, built as `LeaseConnection` builds one
    (not connected: nothing here opens it unless the test does)."""
    source = connections[DEFAULT_DB_ALIAS].settings_dict
    settings = {**source, "OPTIONS": {**(source.get("OPTIONS") or {}), **options}}
    wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias)
    return wrapper


# ---- signatures: what the package calls, overrides or binds --------------------------------------

#: (API, how to reach it, its signature per Django version: the form of the newest listed version
#: not newer than the running one). Where one form serves every supported version, one entry (5.2).
SIGNATURES: list[tuple[str, Callable[[], Any], dict[tuple[int, int], str]]] = [
    # the connection (BaseDatabaseWrapper, PostgreSQL's DatabaseWrapper)
    (
        "DatabaseWrapper(settings_dict, alias)",
        lambda: BaseDatabaseWrapper.__init__,
        {(5, 2): "(self, settings_dict, alias='default')"},
    ),
    ("DatabaseWrapper.ensure_connection()", lambda: BaseDatabaseWrapper.ensure_connection, {(5, 2): "(self)"}),
    (
        "DatabaseWrapper.close_if_health_check_failed()",
        lambda: BaseDatabaseWrapper.close_if_health_check_failed,
        {(5, 2): "(self)"},
    ),
    (
        "DatabaseWrapper.validate_thread_sharing()",
        lambda: BaseDatabaseWrapper.validate_thread_sharing,
        {(5, 2): "(self)"},
    ),
    (
        "DatabaseWrapper.validate_no_broken_transaction()",
        lambda: BaseDatabaseWrapper.validate_no_broken_transaction,
        {(5, 2): "(self)"},
    ),
    ("DatabaseWrapper.inc_thread_sharing()", lambda: BaseDatabaseWrapper.inc_thread_sharing, {(5, 2): "(self)"}),
    ("DatabaseWrapper.dec_thread_sharing()", lambda: BaseDatabaseWrapper.dec_thread_sharing, {(5, 2): "(self)"}),
    ("DatabaseWrapper.on_commit()", lambda: BaseDatabaseWrapper.on_commit, {(5, 2): "(self, func, robust=False)"}),
    ("DatabaseWrapper.get_autocommit()", lambda: BaseDatabaseWrapper.get_autocommit, {(5, 2): "(self)"}),
    (
        "DatabaseWrapper.set_autocommit()",
        lambda: BaseDatabaseWrapper.set_autocommit,
        {(5, 2): "(self, autocommit, force_begin_transaction_with_broken_autocommit=False)"},
    ),
    ("DatabaseWrapper.commit()", lambda: BaseDatabaseWrapper.commit, {(5, 2): "(self)"}),
    ("DatabaseWrapper.close()", lambda: BaseDatabaseWrapper.close, {(5, 2): "(self)"}),
    (
        "DatabaseWrapper.get_connection_params()",
        lambda: PostgreSQLDatabaseWrapper.get_connection_params,
        {(5, 2): "(self)"},
    ),
    ("DatabaseWrapper.close_pool()", lambda: PostgreSQLDatabaseWrapper.close_pool, {(5, 2): "(self)"}),
    ("django.db.utils.load_backend()", lambda: load_backend, {(5, 2): "(backend_name)"}),
    (
        "DatabaseCreation.get_test_db_clone_settings()",
        lambda: connection.creation.get_test_db_clone_settings,
        {(5, 2): "(suffix)"},
    ),
    # models and querysets (fencing/model.py, fencing/queryset.py)
    (
        "Model._save_table()",
        lambda: models.Model._save_table,  # type: ignore[attr-defined]
        {(5, 2): "(self, raw=False, cls=None, force_insert=False, force_update=False, using=None, update_fields=None)"},
    ),
    (
        "Model.save_base()",
        lambda: models.Model.save_base,
        {(5, 2): "(self, raw=False, force_insert=False, force_update=False, using=None, update_fields=None)"},
    ),
    # 5.2 still takes (deprecated) positional arguments, which FencedModel.save passes through; 6.0 refuses them.
    (
        "Model.save()",
        lambda: models.Model.save,
        {
            (5, 2): "(self, *args, force_insert=False, force_update=False, using=None, update_fields=None)",
            (6, 0): "(self, *, force_insert=False, force_update=False, using=None, update_fields=None)",
        },
    ),
    ("QuerySet._clone()", lambda: models.QuerySet._clone, {(5, 2): "(self)"}),  # type: ignore[attr-defined]
    (
        "QuerySet(model, query, using, hints)",
        lambda: models.QuerySet.__init__,
        {(5, 2): "(self, model=None, query=None, using=None, hints=None)"},
    ),
    # compiling a lease key expression for the trigger (fencing/schema.py)
    ("Query(model, alias_cols)", lambda: Query.__init__, {(5, 2): "(self, model, alias_cols=True)"}),
    (
        "Expression.resolve_expression()",
        lambda: models.Expression.resolve_expression,
        {(5, 2): "(self, query=None, allow_joins=True, reuse=None, summarize=False, for_save=False)"},
    ),
    (
        "F.resolve_expression()",
        lambda: F.resolve_expression,
        {(5, 2): "(self, query=None, allow_joins=True, reuse=None, summarize=False, for_save=False)"},
    ),
    ("Expression.relabeled_clone()", lambda: models.Expression.relabeled_clone, {(5, 2): "(self, change_map)"}),
    ("Expression.flatten()", lambda: models.Expression.flatten, {(5, 2): "(self)"}),
    ("DatabaseOperations.compiler()", lambda: connection.ops.compiler, {(5, 2): "(compiler_name)"}),
    (
        "SQLCompiler(query, connection, using)",
        lambda: connection.ops.compiler("SQLCompiler").__init__,
        {(5, 2): "(self, query, connection, using, elide_empty=True)"},
    ),
    ("SQLCompiler.compile()", lambda: connection.ops.compiler("SQLCompiler").compile, {(5, 2): "(self, node)"}),
    ("SchemaEditor.quote_value()", lambda: PostgreSQLSchemaEditor.quote_value, {(5, 2): "(self, value)"}),
    ("SchemaEditor.execute()", lambda: PostgreSQLSchemaEditor.execute, {(5, 2): "(self, sql, params=())"}),
    # FenceTrigger's hooks (fencing/schema.py). 5.2 still takes (deprecated) positional arguments; 6.0 requires name=.
    (
        "BaseConstraint(name=...)",
        lambda: BaseConstraint.__init__,
        {
            (5, 2): "(self, *args, name=None, violation_error_code=None, violation_error_message=None)",
            (6, 0): "(self, *, name, violation_error_code=None, violation_error_message=None)",
        },
    ),
    (
        "BaseConstraint.constraint_sql()",
        lambda: BaseConstraint.constraint_sql,
        {(5, 2): "(self, model, schema_editor)"},
    ),
    ("BaseConstraint.create_sql()", lambda: BaseConstraint.create_sql, {(5, 2): "(self, model, schema_editor)"}),
    ("BaseConstraint.remove_sql()", lambda: BaseConstraint.remove_sql, {(5, 2): "(self, model, schema_editor)"}),
    # Renamed in 6.0: Django calls the one of its version; FenceTrigger inherits it.
    (
        "BaseConstraint's system-check hook",
        lambda: getattr(BaseConstraint, "check" if django.VERSION >= (6, 0) else "_check"),
        {(5, 2): "(self, model, connection)"},
    ),
    # migrations (checks/database.py, sql/files.py)
    ("MigrationRecorder(connection)", lambda: MigrationRecorder.__init__, {(5, 2): "(self, connection)"}),
    ("MigrationRecorder.has_table()", lambda: MigrationRecorder.has_table, {(5, 2): "(self)"}),
    ("MigrationRecorder.applied_migrations()", lambda: MigrationRecorder.applied_migrations, {(5, 2): "(self)"}),
    (
        "MigrationLoader(connection, ignore_no_migrations)",
        lambda: MigrationLoader.__init__,
        {(5, 2): "(self, connection, load=True, ignore_no_migrations=False, replace_migrations=True)"},
    ),
    (
        "RunSQL(sql, reverse_sql, hints)",
        lambda: RunSQL.__init__,
        {(5, 2): "(self, sql, reverse_sql=None, state_operations=None, hints=None, elidable=False)"},
    ),
    (
        "RunSQL.database_forwards()",
        lambda: RunSQL.database_forwards,
        {(5, 2): "(self, app_label, schema_editor, from_state, to_state)"},
    ),
    (
        "RunSQL.database_backwards()",
        lambda: RunSQL.database_backwards,
        {(5, 2): "(self, app_label, schema_editor, from_state, to_state)"},
    ),
    # the admin, the commands, the test runner
    (
        "LogEntry.objects.log_actions()",
        lambda: LogEntryManager.log_actions,
        {(5, 2): "(self, user_id, queryset, action_flag, change_message='', *, single_object=False)"},
    ),
    ("ModelAdmin.log_deletions()", lambda: ModelAdmin.log_deletions, {(5, 2): "(self, request, queryset)"}),
    (
        "CommandParser(called_from_command_line)",
        lambda: CommandParser.__init__,
        {(5, 2): "(self, *, missing_args_message=None, called_from_command_line=None, **kwargs)"},
    ),
    ("CommandParser.add_subparsers()", lambda: vars(CommandParser)["add_subparsers"], {(5, 2): "(self, **kwargs)"}),
    ("OutputWrapper(out)", lambda: OutputWrapper.__init__, {(5, 2): "(self, out, ending='\\n')"}),
    ("DiscoverRunner.setup_databases()", lambda: DiscoverRunner.setup_databases, {(5, 2): "(self, **kwargs)"}),
    (
        "DiscoverRunner.teardown_databases()",
        lambda: DiscoverRunner.teardown_databases,
        {(5, 2): "(self, old_config, **kwargs)"},
    ),
]


@pytest.mark.parametrize(("api", "reach", "forms"), SIGNATURES, ids=[api for api, _, _ in SIGNATURES])
def test_signature_of_each_internal_we_call_or_override(
    api: str, reach: Callable[[], Any], forms: dict[tuple[int, int], str], django_db_blocker: Any
) -> None:
    # Unblocked: pytest-django blocks the database by replacing ensure_connection(); this opens nothing.
    with django_db_blocker.unblock(), leaning_on(api):
        found = str(inspect.signature(reach()))
        assert found == for_this_django(forms), f"signature {found}, pinned {for_this_django(forms)}"


# ---- the connection ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_connection_attribute_is_the_psycopg_connection_or_none() -> None:
    """sql.run, sql.confirmation, wait/, lease_connection, checks and metrics.database_view read
    ``connection.connection`` (None: not connected); lease_connection sets it to None."""
    with leaning_on("DatabaseWrapper.connection"):
        wrapper = fresh_wrapper()
        assert wrapper.connection is None, "a new DatabaseWrapper is not connected"
        wrapper.ensure_connection()
        try:
            assert isinstance(wrapper.connection, psycopg.Connection)
        finally:
            wrapper.close()
        assert wrapper.connection is None, "close() leaves connection None"
        wrapper.connection = None  # lease_connection: after a close() that failed


def test_a_broken_transaction_is_refused_by_validate_no_broken_transaction() -> None:
    with leaning_on("DatabaseWrapper.validate_no_broken_transaction()"):
        wrapper = fresh_wrapper()
        wrapper.in_atomic_block = True
        wrapper.needs_rollback = True
        with pytest.raises(TransactionManagementError):
            wrapper.validate_no_broken_transaction()
        wrapper.needs_rollback = False
        wrapper.validate_no_broken_transaction()


def test_another_thread_is_refused_by_validate_thread_sharing_until_sharing_is_allowed() -> None:
    """sql.run's direct path calls ``validate_thread_sharing()``; lease_connection lends its
    wrapper to other threads between ``inc_thread_sharing()`` and ``dec_thread_sharing()``."""
    with leaning_on("DatabaseWrapper.validate_thread_sharing() / inc_thread_sharing() / dec_thread_sharing()"):
        wrapper = fresh_wrapper()
        raised: list[BaseException | None] = []

        def other_thread() -> None:
            try:
                wrapper.validate_thread_sharing()
                raised.append(None)
            except BaseException as exc:
                raised.append(exc)

        for share in (False, True):
            if share:
                wrapper.inc_thread_sharing()
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        assert isinstance(raised[0], DatabaseError), raised
        assert raised[1] is None, raised
        wrapper.dec_thread_sharing()
        assert not wrapper.allow_thread_sharing
        with pytest.raises(RuntimeError):  # lease_connection.close() suppresses this one
            wrapper.dec_thread_sharing()


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (psycopg.errors.UniqueViolation, IntegrityError),
        (psycopg.errors.QueryCanceled, OperationalError),
        (psycopg.errors.RaiseException, ProgrammingError),
        (psycopg.errors.NumericValueOutOfRange, DataError),
        (psycopg.errors.InFailedSqlTransaction, InternalError),
        (psycopg.OperationalError, OperationalError),
    ],
)
def test_wrap_database_errors_maps_psycopg_errors_to_djangos(
    raised: type[Exception], expected: type[Exception]
) -> None:
    """sql.run's direct path and wait/'s drivers run psycopg calls inside ``wrap_database_errors``:
    callers see Django's errors, the psycopg one (``sqlstate``, ``diag``) as ``__cause__``."""
    with leaning_on("DatabaseWrapper.wrap_database_errors"):
        wrapper = fresh_wrapper()
        assert isinstance(wrapper.wrap_database_errors, DatabaseErrorWrapper)
        original = raised("from the server")
        with pytest.raises(expected) as info, wrapper.wrap_database_errors:
            raise original
        assert type(info.value) is expected
        assert info.value.__cause__ is original


def test_an_execute_wrapper_is_listed_in_execute_wrappers_while_installed() -> None:
    """`sql.run._nothing_in_between` takes the direct path only when ``execute_wrappers`` is empty;
    `CallerCommitCheck` appends to it and removes itself."""
    with leaning_on("DatabaseWrapper.execute_wrappers"):
        wrapper = fresh_wrapper()

        def watching(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
            return execute(sql, params, many, context)

        assert wrapper.execute_wrappers == []
        with wrapper.execute_wrapper(watching):
            assert wrapper.execute_wrappers == [watching]
        assert wrapper.execute_wrappers == []


def test_queries_logged_says_whether_djangos_cursor_logs() -> None:
    with leaning_on("DatabaseWrapper.queries_logged"):
        wrapper = fresh_wrapper()
        assert wrapper.queries_logged is False  # DEBUG is off in tests
        wrapper.force_debug_cursor = True  # what CaptureQueriesContext and assertNumQueries set
        assert wrapper.queries_logged is True


def test_djangos_cursor_is_a_method_of_the_class_and_its_wrapper_unpatched() -> None:
    """`sql.run._nothing_in_between`: a ``cursor`` in the instance's ``__dict__`` is a patch
    (django-debug-toolbar); ``CursorWrapper.execute`` defined elsewhere than its module, an APM agent."""
    with leaning_on("DatabaseWrapper.cursor / CursorWrapper.execute"):
        assert "cursor" in vars(BaseDatabaseWrapper)
        assert "cursor" not in vars(fresh_wrapper())
        assert CursorWrapper.execute.__module__ == CursorWrapper.__module__ == "django.db.backends.utils"
        assert type(fresh_wrapper()) is PostgreSQLDatabaseWrapper


@pytest.mark.django_db
def test_the_psycopg_connection_loads_timestamps_in_the_connections_time_zone() -> None:
    """`sql.run._loads_in_django_time_zone`: Django registers a timestamptz loader carrying its
    zone (``.timezone``) when it connects; the direct path uses the connection's loaders."""
    with leaning_on("the timestamptz loader Django registers (loader.timezone == connection.timezone)"):
        connection.ensure_connection()
        raw = connection.connection
        loader = raw.adapters.get_loader(psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT)
        assert loader is not None
        assert loader.timezone == connection.timezone
        from django.db.backends.postgresql.psycopg_any import register_tzloader

        assert callable(register_tzloader)


@pytest.mark.parametrize(
    ("owner", "make", "names"),
    [
        (
            "DatabaseWrapper",
            fresh_wrapper,
            ("_pg_lease_notices", "_pg_lease_caller_commit", "_pg_lease_zone", "_pg_lease_cursor"),
        ),
        ("Model", lambda: CommitTicket(value=1), ("_pg_lease_token", "_pg_lease_presenting")),
        ("QuerySet", lambda: models.QuerySet(CommitTicket), ("_pg_lease_token", "_pg_lease_unfenced")),
    ],
)
def test_the_attributes_we_set_on_djangos_objects_are_ours(
    owner: str, make: Callable[[], Any], names: tuple[str, ...]
) -> None:
    """sql.confirmation and sql.run keep state on the connection, fencing on model instances
    and querysets, in the instance's ``__dict__``: Django must not use the names nor drop ``__dict__``."""
    with leaning_on(f"attributes of {owner} instances ({', '.join(names)})"):
        instance = make()
        for name in names:
            assert not hasattr(instance, name), f"Django's {owner} has {name} of its own"
            setattr(instance, name, "set")
            assert vars(instance)[name] == "set"


@pytest.mark.django_db
def test_on_commit_hooks_are_kept_as_savepoints_function_robust_inside_atomic() -> None:
    """`CallerCommitCheck` finds its hook in ``run_on_commit`` as ``entry[1]``, and watches only
    while ``in_atomic_block`` (wait.settling, lease_connection, heartbeat, the checks and
    metrics.database_view read it too)."""
    with leaning_on("DatabaseWrapper.run_on_commit / in_atomic_block"):

        def hook() -> None:
            pass

        with transaction.atomic():
            assert connection.in_atomic_block is True
            connection.on_commit(hook)
            entry = connection.run_on_commit[-1]
            assert len(entry) == 3
            assert entry[1] is hook
            assert entry[2] is False  # robust


def test_get_connection_params_are_psycopg_connect_arguments() -> None:
    """checks' probe passes them to ``psycopg.connect()`` as they are; the async wait takes
    ``cursor_factory`` out to tell client- from server-side binding."""
    with leaning_on("DatabaseWrapper.get_connection_params()"):
        wrapper = fresh_wrapper(isolation_level=psycopg.IsolationLevel.READ_COMMITTED, assume_role="someone")
        params = wrapper.get_connection_params()
        assert params["dbname"] == wrapper.settings_dict["NAME"]
        assert issubclass(params["cursor_factory"], psycopg.ClientCursor)
        # psycopg.connect()'s own arguments; everything else must be a libpq keyword.
        conninfo = {k: v for k, v in params.items() if k not in {"context", "cursor_factory", "prepare_threshold"}}
        assert not {"isolation_level", "assume_role", "pool", "server_side_binding"} & conninfo.keys()
        psycopg.conninfo.make_conninfo("", **conninfo)  # raises on a keyword libpq does not know
        server_side = fresh_wrapper(server_side_binding=True).get_connection_params()
        assert not issubclass(server_side["cursor_factory"], psycopg.ClientCursor)


def test_a_wrapper_built_from_settings_is_not_connected_until_used() -> None:
    """lease_connection builds its own Django connection: ``load_backend(ENGINE).DatabaseWrapper(settings, alias)``."""
    with leaning_on("load_backend(ENGINE).DatabaseWrapper(settings_dict, alias)"):
        settings = dict(connections[DEFAULT_DB_ALIAS].settings_dict)
        wrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, "pg-lease-internals")
        assert wrapper.alias == "pg-lease-internals"
        assert wrapper.settings_dict is settings
        assert wrapper.connection is None
        wrapper.close_pool()  # testing: no pool configured, nothing to close


@pytest.mark.django_db
def test_pg_version_is_the_servers_version_number() -> None:
    with leaning_on("DatabaseWrapper.pg_version"):
        assert isinstance(connection.pg_version, int)  # type: ignore[attr-defined]
        assert connection.pg_version >= 140000  # type: ignore[attr-defined]


def test_quote_name_quotes_an_identifier_and_keeps_a_quoted_one() -> None:
    """The schema a migration's SQL file is rendered for and the table names the checks and the
    listings hand the catalog are quoted with it (every other identifier is composed with psycopg.sql)."""
    with leaning_on("DatabaseOperations.quote_name()"):
        assert connection.ops.quote_name("pg_lease_django_lease") == '"pg_lease_django_lease"'
        assert connection.ops.quote_name('"public"') == '"public"'


# ---- models and querysets (fencing/model.py, fencing/queryset.py) --------------------------------

PROBE_ALIAS = "pg-lease-internals-probe"


def test_save_base_hands_the_alias_to_save_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """FencedModel._save_table finds ``using`` by binding its arguments to Django's signature:
    save_base passes them by position, _save_parents by keyword."""
    with leaning_on("Model._save_table() (called by save_base with using)"):
        seen: dict[str, Any] = {}

        def recording(self: models.Model, *args: Any, **kwargs: Any) -> bool:
            signature = inspect.signature(models.Model._save_table)  # type: ignore[attr-defined]
            seen.update(signature.bind(self, *args, **kwargs).arguments)
            return True

        monkeypatch.setattr(CommitTicket, "_save_table", recording)
        CommitTicket(value=1).save_base(using=PROBE_ALIAS)
        assert seen["using"] == PROBE_ALIAS


def test_save_passes_using_and_update_fields_to_save_base_by_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    """FencedModel.save_base reads ``kwargs["using"]`` and adds the lease fields to ``kwargs["update_fields"]``."""
    with leaning_on("Model.save() -> save_base(using=, update_fields=)"):
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def recording(self: models.Model, *args: Any, **kwargs: Any) -> None:
            calls.append((args, kwargs))

        monkeypatch.setattr(CommitTicket, "save_base", recording)
        CommitTicket(pk=1, value=1).save(using=PROBE_ALIAS, update_fields=["value"])
        [(args, kwargs)] = calls
        assert args == ()
        assert kwargs["using"] == PROBE_ALIAS
        assert set(kwargs["update_fields"]) == {"value"}


def test_loaddata_saves_through_model_save_base_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """``loaddata`` (DeserializedObject.save) calls ``models.Model.save_base(obj, ...)``, past
    FencedModel.save_base: FencedModel._save_table catches that path."""
    from django.core.serializers.base import DeserializedObject

    with leaning_on("DeserializedObject.save() -> models.Model.save_base(obj)"):
        calls: list[tuple[models.Model, dict[str, Any]]] = []

        def recording(self: models.Model, *args: Any, **kwargs: Any) -> None:
            assert args == ()
            calls.append((self, kwargs))

        def bypassed(self: models.Model, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("loaddata called the model's own save_base()")

        monkeypatch.setattr(models.Model, "save_base", recording)
        monkeypatch.setattr(FencedModel, "save_base", bypassed)
        report = Report(title="loaded")
        DeserializedObject(report).save(using=PROBE_ALIAS)
        assert calls == [(report, {"using": PROBE_ALIAS, "raw": True})]


def test_querysets_chain_through_clone_with_db_and_hints() -> None:
    """FencedQuerySet copies its fence in ``_clone()``; it and FencedManager read ``_db`` and ``_hints``."""
    with leaning_on("QuerySet._clone() / QuerySet._db / QuerySet._hints / Manager._db / Manager._hints"):
        queryset = Report.objects.unfenced()
        for chained in (
            queryset.all(),
            queryset.filter(title="x"),
            queryset.exclude(pk=1).order_by("pk"),
            queryset.using("other"),
        ):
            assert chained._pg_lease_unfenced is True
        assert queryset.using("other")._db == "other"  # type: ignore[attr-defined]
        report = Report(title="x")
        manager = Report.objects.db_manager("other", hints={"instance": report})
        assert manager._db == "other"
        assert manager._hints == {"instance": report}  # type: ignore[attr-defined]
        assert manager.get_queryset()._hints == {"instance": report}  # type: ignore[attr-defined]


def test_f_names_its_field_and_concat_nests_concat_pairs() -> None:
    """fencing.lease_key reads ``F.name`` and evaluates ``Concat`` through its ``ConcatPair`` chain."""
    from django.db.models.functions.text import ConcatPair

    with leaning_on("F.name / Concat's ConcatPair"):
        assert F("account").name == "account"  # type: ignore[attr-defined]
        parts: list[Any] = []
        pending: list[Any] = Concat(Value("invoice:"), F("account"), F("status")).get_source_expressions()
        while pending:
            node = pending.pop(0)
            if isinstance(node, ConcatPair):
                pending[:0] = node.get_source_expressions()
            else:
                parts.append(node)
        assert [type(p).__name__ for p in parts] == ["Value", "F", "F"]
        assert [getattr(p, "name", None) or p.value for p in parts] == ["invoice:", "account", "status"]


OPTIONS: list[tuple[str, Callable[[], bool]]] = [
    ("Options.original_attrs", lambda: isinstance(Invoice._meta.original_attrs, dict)),
    ("Options.constraints", lambda: any(isinstance(c, FenceTrigger) for c in Invoice._meta.constraints)),
    ("Options.concrete_fields", lambda: "lease_epoch" in {f.name for f in Invoice._meta.concrete_fields}),
    ("Options.parents", lambda: Invoice in CreditNote._meta.parents),
    ("Options.get_parent_list()", lambda: CreditNote._meta.get_parent_list() == [Invoice]),
    ("Options.local_many_to_many", lambda: list(Invoice._meta.local_many_to_many) == []),
    ("Options.concrete_model", lambda: ArchivedReport._meta.concrete_model is Report),
    ("Options.pk", lambda: Invoice._meta.pk is not None and Invoice._meta.pk.column == "id"),
    ("Options.proxy", lambda: ArchivedReport._meta.proxy is True and Report._meta.proxy is False),
]


@pytest.mark.parametrize(("api", "holds"), OPTIONS, ids=[api for api, _ in OPTIONS])
def test_the_model_options_we_read(api: str, holds: Callable[[], bool]) -> None:
    """fencing.schema, fencing.lease_key, fencing.queryset and checks.project read these undocumented
    attributes of ``_meta``."""
    with leaning_on(api):
        assert holds()


def test_migrations_take_constraints_from_meta_once_listed_in_original_attrs(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_fence_trigger appends the FenceTrigger to ``_meta.constraints`` and lists ``constraints``
    in ``_meta.original_attrs``: ``ModelState.from_model`` (makemigrations) reads only options listed there."""
    from django.db.migrations.state import ModelState

    with leaning_on("Options.original_attrs read by ModelState.from_model()"):
        [trigger] = [c for c in Report._meta.constraints if isinstance(c, FenceTrigger)]
        assert ModelState.from_model(Report).options["constraints"] == [trigger]
        monkeypatch.delitem(Report._meta.original_attrs, "constraints")
        assert trigger not in ModelState.from_model(Report).options.get("constraints", [])


def test_historical_models_live_in_the_fake_module() -> None:
    """add_fence_trigger skips a migration's historical model by its ``__module__``."""
    from django.db.migrations.state import ProjectState

    with leaning_on('historical models\' __module__ == "__fake__"'):
        historical = ProjectState.from_apps(django_apps).apps.get_model("testapp", "Report")
        assert historical.__module__ == "__fake__"
        assert sum(isinstance(c, FenceTrigger) for c in historical._meta.constraints) == 1


# ---- a lease key expression compiled for the trigger (fencing/schema.py) --------------------------


def _compiled(query: Query, expression: Any) -> tuple[str, tuple[Any, ...]]:
    sql, params = connection.ops.compiler("SQLCompiler")(query, connection, using=None).compile(expression)
    return sql, tuple(params)


def test_a_query_without_alias_cols_compiles_a_field_unqualified() -> None:
    with leaning_on("Query(model, alias_cols=False) + SQLCompiler.compile()"):
        query = Query(Invoice, alias_cols=False)
        assert _compiled(query, F("account").resolve_expression(query, allow_joins=False)) == ('"account"', ())


def test_a_relabeled_column_compiles_against_the_new_alias() -> None:
    """The trigger's expression reads the row being written: the table's alias relabeled to ``new``."""
    with leaning_on("Query(model) + resolve_expression() + relabeled_clone()"):
        query = Query(Invoice)
        resolved = F("account").resolve_expression(query, allow_joins=False)
        assert _compiled(query, resolved) == ('"testapp_invoice"."account"', ())
        relabeled = resolved.relabeled_clone({Invoice._meta.db_table: "new"})
        assert _compiled(query, relabeled) == ('"new"."account"', ())


def test_a_resolved_expression_flattens_to_columns_that_name_their_field() -> None:
    """The derive trigger fires on updates of the columns the key reads: ``Col.target.column``."""
    from django.db.models.expressions import Col

    with leaning_on("Expression.flatten() / Col.target.column"):
        resolved = Concat(Value("invoice:"), F("account")).resolve_expression(Query(Invoice), allow_joins=False)
        columns = [node for node in resolved.flatten() if isinstance(node, Col)]
        assert [column.target.column for column in columns] == ["account"]


def test_a_value_compiles_to_a_parameter_that_quote_value_makes_a_literal() -> None:
    with leaning_on("SchemaEditor.quote_value() for SQLCompiler's parameters"):
        query = Query(Invoice, alias_cols=False)
        sql, params = _compiled(query, Value("it's 100%").resolve_expression(query))
        assert (sql, params) == ("%s", ("it's 100%",))
        with PostgreSQLSchemaEditor(connection, collect_sql=True, atomic=False) as editor:
            assert sql % tuple(editor.quote_value(p) for p in params) == "'it''s 100%'"


# ---- FenceTrigger's constraint hooks (fencing/schema.py) --------------------------------------------


class _Probe(BaseConstraint):
    """A constraint written the way FenceTrigger is: SQL without parameters, with a ``%`` in it."""

    def constraint_sql(self, model: Any, schema_editor: Any) -> None:  # type: ignore[override]
        schema_editor.deferred_sql.append(f"SELECT 'deferred {self.name} 100%'")

    def create_sql(self, model: Any, schema_editor: Any) -> str:
        return f"SELECT 'created {self.name} 100%'"

    def remove_sql(self, model: Any, schema_editor: Any) -> str:
        return f"SELECT 'removed {self.name} 100%%'"  # run with params=(): merged, so %% is one %


@pytest.mark.django_db  # remove_constraint: PostgreSQL's editor merges its () parameters on a cursor
def test_the_schema_editor_runs_a_constraints_sql_hooks() -> None:
    """CREATE TABLE leaves out what ``constraint_sql`` returns when falsy and runs ``deferred_sql``
    after the table, at the end, and ``add_constraint`` runs ``create_sql``, both with
    ``params=None`` (a ``%`` stays as it is); ``remove_constraint`` runs ``remove_sql`` with
    ``params=()``, merged client-side: a ``%`` there must be doubled (FenceTrigger's has none)."""
    from django.test.utils import isolate_apps

    with leaning_on("BaseConstraint.constraint_sql() / create_sql() / remove_sql() and SchemaEditor.deferred_sql"):
        with isolate_apps("devkit.testapp"):

            class Probed(models.Model):
                class Meta:
                    app_label = "testapp"
                    constraints = [_Probe(name="at_create")]

                def __str__(self) -> str:
                    return str(self.pk)

        with PostgreSQLSchemaEditor(connection, collect_sql=True, atomic=False) as editor:
            editor.create_model(Probed)
            editor.add_constraint(Probed, _Probe(name="added"))
            editor.remove_constraint(Probed, _Probe(name="added"))
        create_table, *rest = editor.collected_sql
        assert create_table.startswith('CREATE TABLE "testapp_probed"'), create_table
        assert "None" not in create_table and "at_create" not in create_table
        assert rest == [
            "SELECT 'created added 100%';",
            "SELECT 'removed added 100%';",
            "SELECT 'deferred at_create 100%';",
        ]


def test_a_fence_trigger_reports_no_system_check_error() -> None:
    """Django calls a constraint's check hook, ``_check`` on 5.2 and ``check`` from 6.0: FenceTrigger
    inherits BaseConstraint's, which reports nothing."""
    hook = "check" if django.VERSION >= (6, 0) else "_check"
    with leaning_on(f"BaseConstraint.{hook}(model, connection)"):
        [trigger] = [c for c in Invoice._meta.constraints if isinstance(c, FenceTrigger)]
        assert getattr(trigger, hook)(Invoice, connection) == []


# ---- migrations (checks/database.py, sql/files.py) -----------------------------------------------


@pytest.mark.django_db
def test_the_migration_recorder_lists_applied_migrations_by_app_and_name() -> None:
    with leaning_on("MigrationRecorder.has_table() / applied_migrations()"):
        recorder = MigrationRecorder(connection)
        assert recorder.has_table()
        applied = recorder.applied_migrations()
        assert ("pg_lease_django", "0001_baseline") in applied
        assert all(isinstance(k, tuple) and len(k) == 2 for k in applied)


@pytest.mark.django_db
def test_the_migration_loader_lists_disk_and_applied_migrations_by_app_and_name() -> None:
    from django.db.migrations.exceptions import NodeNotFoundError

    with leaning_on("MigrationLoader.disk_migrations / applied_migrations / NodeNotFoundError"):
        loader = MigrationLoader(connection, ignore_no_migrations=True)
        latest = ("pg_lease_django", "0007_tenants_apart")
        assert latest in loader.disk_migrations
        assert latest in loader.applied_migrations
        assert issubclass(NodeNotFoundError, Exception)


@pytest.mark.django_db
def test_schema_editor_execute_without_parameters_sends_percent_signs_as_they_are() -> None:
    """RunSQLFile runs each SQL file with ``schema_editor.execute(sql, params=None)``: the files'
    RAISE formats (``%``) must reach the server untouched."""
    from pg_lease_django.sql.files import RunSQLFile

    with leaning_on("SchemaEditor.execute(sql, params=None) / RunSQL.hints"):
        with PostgreSQLSchemaEditor(connection) as editor:  # Django's own (pgtrigger's wraps it in the tests)
            editor.execute("DO $$ BEGIN RAISE NOTICE '% of %', 1, '100%'; END $$", params=None)
        operation = RunSQLFile(
            "schema.sql", "schema.sql", sha256="0" * 64, reverse_sha256="0" * 64, hints={"target": "x"}
        )
        assert operation.hints == {"target": "x"}


# ---- the admin, the commands ----------------------------------------------------------------------


def test_the_admin_sites_registry_maps_models_to_their_model_admins() -> None:
    """Check W001 reads ``admin.site._registry``: no public API lists an AdminSite's registrations."""
    from django.contrib import admin

    from pg_lease_django.admin import LeaseAdmin

    with leaning_on("AdminSite._registry"):
        assert isinstance(admin.site._registry, dict)
        assert isinstance(admin.site._registry[Lease], LeaseAdmin)


@pytest.mark.parametrize("key", ["nightly", "tenant/a_b:c", "50% off", "x y"])
def test_admin_quote_and_unquote_round_trip_a_lease_key(key: str) -> None:
    """The admin's URLs carry lease keys (the primary key) through ``admin.utils.quote``/``unquote``."""
    from django.contrib.admin.utils import quote, unquote

    with leaning_on("django.contrib.admin.utils.quote() / unquote()"):
        assert "/" not in quote(key)
        assert unquote(quote(key)) == key


def _blocks(name: str) -> set[str]:
    """The block names of template ``name`` and of every template it extends."""
    from django.template import engines
    from django.template.loader_tags import BlockNode, ExtendsNode

    engine = engines["django"].engine  # type: ignore[attr-defined]
    found: set[str] = set()
    while name:
        template = engine.get_template(name)
        found |= {node.name for node in template.nodelist.get_nodes_by_type(BlockNode)}
        extends = template.nodelist.get_nodes_by_type(ExtendsNode)
        name = extends[0].parent_name.var if extends else ""
    return found


@pytest.mark.parametrize(
    ("template", "blocks"),
    [
        ("admin/change_form.html", {"after_field_sets", "content"}),
        ("admin/base_site.html", {"extrahead", "bodyclass", "breadcrumbs", "content"}),
    ],
)
def test_the_admin_templates_have_the_blocks_ours_fill(template: str, blocks: set[str]) -> None:
    """templates/admin/pg_lease_django/lease/: change_form.html and force_release_confirmation.html."""
    with leaning_on(f"the blocks of {template}"):
        assert blocks <= _blocks(template), f"missing: {sorted(blocks - _blocks(template))}"


def test_a_commands_output_wrapper_keeps_its_stream_in_out() -> None:
    """``leases watch`` hands rich the stream itself (``self.stdout._out``); the supervisor wraps
    sys.stdout / sys.stderr in OutputWrapper."""
    with leaning_on("OutputWrapper._out"):
        stream = io.StringIO()
        assert vars(OutputWrapper(stream))["_out"] is stream
        assert vars(BaseCommand(stdout=stream).stdout)["_out"] is stream


def test_subparsers_are_made_with_the_parser_class_and_called_from_command_line() -> None:
    """``manage.py leases`` declares its subcommands with ``parser_class=SubcommandParser``: Django
    passes ``called_from_command_line`` on, so a bad argument is a CommandError from call_command."""
    with leaning_on("CommandParser.add_subparsers(parser_class=...)"):
        parser = CommandParser(called_from_command_line=False)
        subparser = parser.add_subparsers(dest="subcommand", parser_class=SubcommandParser).add_parser("list")
        assert isinstance(subparser, SubcommandParser)
        assert subparser.called_from_command_line is False
        with pytest.raises(CommandError):
            parser.parse_args(["list", "--no-such-option"])


def test_flush_raises_a_command_error_from_the_database_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our ``flush`` finds the refused TRUNCATE as the ``__cause__`` of Django's CommandError."""
    from django.core.management.commands import flush

    with leaning_on("flush.Command.handle() raises CommandError from the database error"):
        refused = DatabaseError("refused")

        def execute_sql_flush(sql_list: list[str]) -> None:
            raise refused

        monkeypatch.setattr(flush, "sql_flush", lambda *args, **kwargs: ["TRUNCATE nothing"])
        monkeypatch.setattr(connection.ops, "execute_sql_flush", execute_sql_flush)
        with pytest.raises(CommandError) as info:
            flush.Command().handle(database=DEFAULT_DB_ALIAS, verbosity=0, interactive=False, inhibit_post_migrate=True)
        assert info.value.__cause__ is refused


# ---- the test runner and the pytest plugin (testing.py, pytest_plugin.py) ------------------------


def test_setup_databases_returns_connection_old_name_and_destroy_per_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    """LeaseTestRunner reads what ``setup_databases`` returned as (connection, original NAME, first
    alias of its database), and ``self.parallel``; ``teardown_databases`` takes the same list back."""
    with leaning_on("DiscoverRunner.setup_databases() / teardown_databases() / parallel"):
        created: list[dict[str, Any]] = []
        destroyed: list[tuple[Any, ...]] = []
        monkeypatch.setattr(connection.creation, "create_test_db", lambda **kwargs: created.append(kwargs))
        monkeypatch.setattr(connection.creation, "destroy_test_db", lambda *args, **kwargs: destroyed.append(args))
        runner = DiscoverRunner(verbosity=0, interactive=False)
        assert isinstance(runner.parallel, int)
        old_config = runner.setup_databases(aliases={DEFAULT_DB_ALIAS}, serialized_aliases=set())
        assert len(created) == 1
        assert old_config == [(connection, connection.settings_dict["NAME"], True)]
        runner.teardown_databases(old_config)
        assert [args[0] for args in destroyed] == [connection.settings_dict["NAME"]]


def test_a_test_database_is_named_with_the_prefix_unless_test_name_is_set() -> None:
    """plan_test_databases predicts the name ``create_test_db()`` will use: TEST["NAME"], else
    ``TEST_DATABASE_PREFIX`` + NAME; parallel clones are NAME_<n>."""
    with leaning_on("TEST_DATABASE_PREFIX / DatabaseCreation._get_test_db_name() / get_test_db_clone_settings()"):
        settings = connections[DEFAULT_DB_ALIAS].settings_dict
        assert settings["TEST"]["NAME"] is None or isinstance(settings["TEST"]["NAME"], str)
        plain = load_backend(settings["ENGINE"]).DatabaseWrapper(
            {**settings, "NAME": "app", "TEST": {**settings["TEST"], "NAME": None}}
        )
        assert plain.creation._get_test_db_name() == TEST_DATABASE_PREFIX + "app" == "test_app"
        named = load_backend(settings["ENGINE"]).DatabaseWrapper(
            {**settings, "NAME": "app", "TEST": {**settings["TEST"], "NAME": "mine"}}
        )
        assert named.creation._get_test_db_name() == "mine"
        assert plain.creation.get_test_db_clone_settings("2")["NAME"] == "app_2"


def test_pytest_django_names_its_database_setup_fixture_and_blocker(request: pytest.FixtureRequest) -> None:
    """The pytest plugin wraps the fixture named ``django_db_setup`` and unblocks the database with
    ``django_db_blocker.unblock()`` (pytest-django's, not Django's)."""
    import pytest_django.fixtures

    with leaning_on("pytest-django's django_db_setup / django_db_blocker.unblock()"):
        assert callable(pytest_django.fixtures.django_db_setup)
        assert callable(request.getfixturevalue("django_db_blocker").unblock)


# ---- the page and this module agree ---------------------------------------------------------------


def _documented_tests() -> set[str]:
    text = DOC_PATH.read_text(encoding="utf-8")
    section = text.split("## Django internals we lean on", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(test_\w+)`", section))


def test_every_internal_on_the_page_has_its_test_here_and_back() -> None:
    here = {name for name in globals() if name.startswith("test_")}
    documented = _documented_tests()
    assert documented - here == set(), "tests the page names that this module lacks"
    assert here - documented - {"test_every_internal_on_the_page_has_its_test_here_and_back"} == set(), (
        f"tests of this module that {DOC} does not name"
    )


#: A file the page cites, and what in it uses the API: ``path.py`` (``Name``, ``Class.method``: a remark).
_CITATION = re.compile(r"`(?P<path>[\w/]+\.py)`(?: \((?P<names>[^)]*)\))?")
#: A line number after a file name (``operations.py:158``, ``checks/models.py:74,104-107``): stale at the next edit.
_LINE_NUMBER = re.compile(r"[\w/]+\.(?:py|sql|html)`?:\d[\d,-]*")


def _table_rows(text: str) -> Iterator[dict[str, str]]:
    """Each body row of each Markdown table in ``text``, as {column heading: cell}."""
    lines = text.splitlines()
    for number, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[number + 1].startswith("|---"):
            headings = [cell.strip() for cell in line.strip("|").split("|")]
            for row in lines[number + 2 :]:
                if not row.startswith("|"):
                    break
                yield dict(zip(headings, (cell.strip() for cell in row.strip("|").split("|")), strict=True))


def _defined(path: Path) -> set[str]:
    """The names of the functions and classes ``path`` defines, at any depth (a method by its own name)."""
    return {
        node.name
        for node in ast.walk(parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


def test_the_page_cites_modules_that_exist_and_no_line_numbers() -> None:
    """Every ``path.py`` the page's tables cite is a module of the package, each function, class or
    method named in parentheses after it is defined there, and no citation carries a line number."""
    text = DOC_PATH.read_text(encoding="utf-8")
    numbered = sorted({match.group(0) for match in _LINE_NUMBER.finditer(text)})
    assert not numbered, f"cite the module and the function or class, not a line: {numbered}"
    cited = [
        (match["path"], match["names"] or "", cell)
        for row in _table_rows(text)
        for cell in row.values()
        for match in _CITATION.finditer(cell)
    ]
    assert len(cited) >= 40, f"the page's tables cite {len(cited)} files: is the parser reading them?"
    missing = sorted({path for path, _, _ in cited if not (PACKAGE / path).is_file()})
    assert not missing, f"{DOC} cites files that are not in pg_lease_django/: {missing}"
    undefined = []
    for path, names, _ in cited:
        # The names come before a remark: `(`Name`, `Class.method`: what it does with the API)`.
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", names.split(":", 1)[0]):
            if name.rpartition(".")[2] not in _defined(PACKAGE / path):
                undefined.append(f"{path}: {name}")
    assert not undefined, f"{DOC} names what these modules do not define: {undefined}"
