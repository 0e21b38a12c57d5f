# ruff: noqa: E501  (the pinned signatures are kept one per line, as inspect prints them)
"""The public API, pinned: what users import, call and record in their migrations.

A move between modules (issue 25's rooms) or a refactor must not change any of it unnoticed. When a
change is meant (a new argument, a new name), update the pin here in the same commit and say so in
CHANGELOG.md. No database: these tests read the code only.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from django.db import OperationalError
from django.utils.module_loading import import_string

import pg_lease_django

PUBLIC_NAMES = {
    "AlreadyFreeError",
    "AlreadyLapsedError",
    "Election",
    "EndReason",
    "EpochAdvance",
    "EpochMismatchError",
    "EpochMovedOnError",
    "Fence",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "Grant",
    "HandoffRequest",
    "HeartbeatFailedError",
    "HeldLease",
    "Holding",
    "InvalidInputError",
    "LapsedError",
    "Lease",
    "LeaseError",
    "LeaseLostError",
    "LeaseManager",
    "LeaseState",
    "LeaseStatus",
    "LeaseTenure",
    "LeaseTimeoutError",
    "MissingRowError",
    "NeverAcquiredError",
    "NotAcquirableError",
    "NotOwnerError",
    "OnBusy",
    "OnLost",
    "OperatorRefusalError",
    "OutcomeUnknownError",
    "QuotaExceededError",
    "RaisingDecorator",
    "Seconds",
    "SkippingDecorator",
    "UnconfirmedCommitError",
    "UnfencedWriteError",
    "aelect",
    "current_election",
    "current_lease",
    "elect",
    "exit_on_signals",
    "hold",
    "lease_acquired",
    "lease_handoff_requested",
    "lease_lost",
    "lease_released",
    "lease_skipped",
    "leased",
    "unfenced_writes",
}


# str(inspect.signature(...)) of every public callable, and of each public class's public methods
# (properties as "property"). Constructors of HeldLease and Holding are not public: the library
# builds them.
SIGNATURES: dict[str, str] = {
    "Election.__enter__": "(self) -> 'Election'",
    "Election.__exit__": "(self, exc_type: 'type[BaseException] | None', exc: 'BaseException | None', tb: 'TracebackType | None') -> 'None'",
    "Election.__init__": "(self, key: 'str', *, ttl: 'Seconds', on_started_leading: 'Callable[[HeldLease], Any]', on_stopped_leading: 'Callable[[], Any]', on_new_leader: 'Callable[[str], Any] | None' = None, owner: 'str | None' = None, using: 'str | None' = None) -> 'None'",
    "Election.join": "(self, timeout: 'float | None' = None) -> 'bool'",
    "Election.leader": "property",
    "Election.leading": "property",
    "Election.lease": "property",
    "Election.stop": "(self) -> 'None'",
    "Election.stopping": "property",
    "Election.wait_stop": "(self, timeout: 'float | None' = None) -> 'bool'",
    "FencedManager.fenced": "(self, fence: 'Fence', *, key: 'str | None' = None) -> 'FencedQuerySet[_M]'",
    "FencedManager.get_queryset": "(self) -> 'FencedQuerySet[_M]'",
    "FencedManager.unfenced": "(self) -> 'FencedQuerySet[_M]'",
    "FencedModel.adelete": "(self, *args: 'Any', fence: 'Fence | None' = None, unfenced: 'bool' = False, **kwargs: 'Any') -> 'Any'",
    "FencedModel.asave": "(self, *args: 'Any', fence: 'Fence | None' = None, unfenced: 'bool' = False, **kwargs: 'Any') -> 'None'",
    "FencedModel.delete": "(self, *args: 'Any', fence: 'Fence | None' = None, unfenced: 'bool' = False, **kwargs: 'Any') -> 'Any'",
    "FencedModel.get_lease_key": "(self) -> 'str'",
    "FencedModel.save": "(self, *args: 'Any', fence: 'Fence | None' = None, unfenced: 'bool' = False, **kwargs: 'Any') -> 'None'",
    "FencedQuerySet.bulk_create": "(self, objs: 'Any', *args: 'Any', **kwargs: 'Any') -> 'list[_M]'",
    "FencedQuerySet.bulk_update": "(self, objs: 'Any', fields: 'Iterable[str]', batch_size: 'int | None' = None) -> 'int'",
    "FencedQuerySet.create": "(self, **kwargs: 'Any') -> '_M'",
    "FencedQuerySet.delete": "(self) -> 'tuple[int, dict[str, int]]'",
    "FencedQuerySet.fenced": "(self, fence: 'Fence', *, key: 'str | None' = None) -> 'Self'",
    "FencedQuerySet.get_or_create": "(self, defaults: 'Any' = None, **kwargs: 'Any') -> 'tuple[_M, bool]'",
    "FencedQuerySet.unfenced": "(self) -> 'Self'",
    "FencedQuerySet.update": "(self, **kwargs: 'Any') -> 'int'",
    "FencedQuerySet.update_or_create": "(self, defaults: 'Any' = None, create_defaults: 'Any' = None, **kwargs: 'Any') -> 'tuple[_M, bool]'",
    "Grant.__init__": "(self, key: 'str', owner: 'str', epoch: 'int', expires_at: 'datetime', server_time: 'datetime') -> None",
    "HandoffRequest.__init__": "(self, key: 'str', owner: 'str', epoch: 'int', expires_at: 'datetime', requested_at: 'datetime', server_time: 'datetime') -> None",
    "HeldLease.check": "(self) -> 'None'",
    "HeldLease.error": "property",
    "HeldLease.handoff_requested": "property",
    "HeldLease.lost": "property",
    "HeldLease.released": "property",
    "HeldLease.trust_remaining": "property",
    "HeldLease.wait_lost": "(self, timeout: 'float | None' = None) -> 'bool'",
    "HeldLease.wait_stop": "(self, timeout: 'float | None' = None) -> 'bool'",
    "Holding.__aenter__": "(self) -> 'HeldLease'",
    "Holding.__aexit__": "(self, exc_type: 'type[BaseException] | None', exc: 'BaseException | None', tb: 'TracebackType | None') -> 'None'",
    "Holding.__enter__": "(self) -> 'HeldLease'",
    "Holding.__exit__": "(self, exc_type: 'type[BaseException] | None', exc: 'BaseException | None', tb: 'TracebackType | None') -> 'None'",
    "EpochAdvance.__init__": "(self, by: 'int', leases: 'int', held: 'int', epoch_floor: 'int', max_epoch: 'int', server_time: 'datetime', dry_run: 'bool') -> None",
    "Fence.epoch": "property",
    "Fence.owner": "property",
    "LeaseError.__init__": "(self, message: 'str', *, key: 'str | None' = None, owner: 'str | None' = None, epoch: 'int | None' = None, holder: 'str | None' = None, current_epoch: 'int | None' = None) -> 'None'",
    "LeaseManager.aacquire": "(self, key: 'str', owner: 'str', ttl: 'Seconds', *, blocking: 'bool' = False, timeout: 'Seconds | None' = None) -> 'Grant | None'",
    "LeaseManager.acquire": "(self, key: 'str', owner: 'str', ttl: 'Seconds', *, blocking: 'bool' = False, timeout: 'Seconds | None' = None) -> 'Grant | None'",
    "LeaseManager.advance_epochs": "(self, *, by: 'int', dry_run: 'bool' = False) -> 'EpochAdvance'",
    "LeaseManager.aforce_release": "(self, key: 'str', *, epoch: 'int | None' = None, operator: 'str | None' = None) -> 'int'",
    "LeaseManager.ainspect": "(self, key: 'str') -> 'LeaseState'",
    "LeaseManager.arelease": "(self, key: 'str', owner: 'str', epoch: 'int') -> 'None'",
    "LeaseManager.arenew": "(self, key: 'str', owner: 'str', epoch: 'int', ttl: 'Seconds') -> 'datetime'",
    "LeaseManager.arequest_handoff": "(self, key: 'str', *, epoch: 'int | None' = None) -> 'HandoffRequest'",
    "LeaseManager.force_release": "(self, key: 'str', *, epoch: 'int | None' = None, operator: 'str | None' = None) -> 'int'",
    "LeaseManager.inspect": "(self, key: 'str') -> 'LeaseState'",
    "LeaseManager.prune": "(self, *, free_for: 'Seconds', dry_run: 'bool' = False) -> 'list[str]'",
    "LeaseManager.release": "(self, key: 'str', owner: 'str', epoch: 'int') -> 'None'",
    "LeaseManager.renew": "(self, key: 'str', owner: 'str', epoch: 'int', ttl: 'Seconds') -> 'datetime'",
    "LeaseManager.request_handoff": "(self, key: 'str', *, epoch: 'int | None' = None) -> 'HandoffRequest'",
    "LeaseState.__init__": "(self, key: 'str', status: \"Literal['free', 'held', 'lapsed']\", owner: 'str | None', epoch: 'int', expires_at: 'datetime | None', server_time: 'datetime') -> None",
    "LeaseState.held": "property",
    "NotAcquirableError.__init__": "(self, message: 'str', *, key: 'str | None' = None, owner: 'str | None' = None, epoch: 'int | None' = None, holder: 'str | None' = None, current_epoch: 'int | None' = None, expires_at: 'datetime | None' = None) -> 'None'",
    "NotAcquirableError.holder_epoch": "property",
    "OutcomeUnknownError.__init__": "(self, message: 'str', *, key: 'str | None' = None) -> 'None'",
    "UnconfirmedCommitError.__init__": "(self, message: 'str', *, severity: 'str | None', notice: 'str | None', detail: 'str | None') -> 'None'",
    "aelect": "(key: 'str', *, ttl: 'Seconds', on_started_leading: 'Callable[[HeldLease], Awaitable[Any]]', on_stopped_leading: 'Callable[[], Any]', on_new_leader: 'Callable[[str], Any] | None' = None, owner: 'str | None' = None, using: 'str | None' = None) -> 'None'",
    "current_election": "() -> 'Election | None'",
    "current_lease": "(key: 'str | None' = None) -> 'HeldLease | None'",
    "elect": "(key: 'str', *, ttl: 'Seconds', on_started_leading: 'Callable[[HeldLease], Any]', on_stopped_leading: 'Callable[[], Any]', on_new_leader: 'Callable[[str], Any] | None' = None, owner: 'str | None' = None, using: 'str | None' = None) -> 'Election'",
    "exit_on_signals": "(signals: 'Iterable[int]' = (<Signals.SIGTERM: 15>,)) -> 'None'",
    "hold": "(key: 'str', ttl: 'Seconds', *, owner: 'str | None' = None, blocking: 'bool' = False, timeout: 'Seconds | None' = None, renew_every: 'Seconds | None' = None, hold_at_least: 'Seconds | None' = None, on_lost: 'OnLost | None' = None, using: 'str | None' = None, on_handoff: 'OnLost | None' = None) -> 'Holding'",
    "leased": "(key: 'str | Callable[..., str]', ttl: 'Seconds', *, owner: 'str | None' = None, blocking: 'bool' = False, timeout: 'Seconds | None' = None, renew_every: 'Seconds | None' = None, hold_at_least: 'Seconds | None' = None, on_lost: 'OnLost | None' = None, using: 'str | None' = None, on_busy: 'OnBusy' = 'skip') -> 'SkippingDecorator | RaisingDecorator'",
    "unfenced_writes": "() -> 'Iterator[None]'",
}

# Every error class: its base among the package's errors (or the outside class it extends) and its
# code. Frozen for 1.0 (CHANGELOG.md maps the names before it): catching a base must keep meaning
# what it says. `LeaseLostError` means "stop acting on the holder's behalf"; an operator's call that
# found nothing to act on is an `OperatorRefusalError`, never a lost lease.
ERROR_TREE: dict[str, tuple[str, str]] = {
    "LeaseError": ("Exception", "lease_error"),
    "NotAcquirableError": ("LeaseError", "not_acquirable"),
    "LeaseTimeoutError": ("LeaseError", "timeout"),
    "LeaseLostError": ("LeaseError", "lease_error"),
    "NotOwnerError": ("LeaseLostError", "not_owner"),
    "LapsedError": ("LeaseLostError", "lapsed"),
    "EpochMismatchError": ("LeaseLostError", "epoch_mismatch"),
    "HeartbeatFailedError": ("LeaseLostError", "heartbeat_failed"),
    "OperatorRefusalError": ("LeaseError", "operator_refused"),
    "NeverAcquiredError": ("OperatorRefusalError", "not_found"),
    "AlreadyFreeError": ("OperatorRefusalError", "already_free"),
    "AlreadyLapsedError": ("OperatorRefusalError", "lapsed"),
    "EpochMovedOnError": ("OperatorRefusalError", "epoch_mismatch"),
    "InvalidInputError": ("LeaseError+ValueError", "invalid_input"),
    "UnfencedWriteError": ("LeaseError", "unfenced"),
    "QuotaExceededError": ("LeaseError", "quota"),
    "MissingRowError": ("LeaseError", "missing_row"),
    "OutcomeUnknownError": ("django.db.OperationalError", "outcome_unknown"),
    "UnconfirmedCommitError": ("OutcomeUnknownError", "unconfirmed_commit"),
}
#: Attributes every `LeaseError` has: the caller's side (key, owner, epoch), the key's (holder, current_epoch).
ERROR_FIELDS = ("code", "key", "owner", "epoch", "holder", "current_epoch")

# Paths that users' migrations record (makemigrations writes them): they must import forever.
MIGRATION_PATHS = {
    "pg_lease_django.fencing.FenceTrigger": "constraint",
    "pg_lease_django.fencing.LeaseKeyField": "field",
}

# What `pg_lease_django.fencing` exports (users' models and migrations import from it): each name, and
# the same object as the package's when the package exports it too.
FENCING_NAMES = {
    "Fence",
    "FenceTrigger",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "LeaseKeyField",
    "resolve_fence",
    "unfenced_writes",
}

# Paths the documentation and settings name (TEST_RUNNER, pytest plugins, URLconfs, admin classes).
DOCUMENTED_PATHS = [
    "pg_lease_django.testing.LeaseTestRunner",
    "pg_lease_django.testing.allow_truncate_on_test_databases",
    "pg_lease_django.views.health",
    "pg_lease_django.views.ready",
    "pg_lease_django.views.live",
    "pg_lease_django.admin.FencedModelAdmin",
    "pg_lease_django.admin.LeaseAdmin",
    "pg_lease_django.metrics.whole_key",
    "pg_lease_django.metrics.database_view.register",
    "pg_lease_django.metrics.push.push",
    "pg_lease_django.provisioning.history.sync_scope",
    "pg_lease_django.managers.EpochAdvance",
    "pg_lease_django.timeline.read_history",
    "pg_lease_django.timeline.draw_timeline",
    "pg_lease_django.signals.lease_acquired",
    "pg_lease_django.apps.PgLeaseConfig",
]
DOCUMENTED_MODULES = ["pg_lease_django.pytest_plugin", "pg_lease_django.sql.files"]

# The election's hooks for ``leases run --campaign`` (`pg_lease_django.management.supervision.campaign`): not public API, but
# the contract between the two modules that docs/architecture.md names.
ELECTION_HOOKS = {
    "pg_lease_django.election.start": "(election: 'Election', *, wake: 'Callable[[], None]') -> 'Election'",
    "pg_lease_django.election.fail_term": "(election: 'Election') -> 'None'",
}

_NOT_PINNED = {
    "Fence.__init__",  # protocols: typed, never constructed
    "RaisingDecorator.__init__",
    "SkippingDecorator.__init__",
    "HeldLease.__init__",
    "Holding.__init__",
    "FencedModel.save_base",
    "FencedModel.Meta",
    "FencedQuerySet.__init__",
}
_DUNDERS = {"__init__", "__enter__", "__exit__", "__aenter__", "__aexit__"}


def _signatures() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in sorted(pg_lease_django.__all__):
        obj = getattr(pg_lease_django, name)
        if inspect.isclass(obj):
            for attr, value in sorted(vars(obj).items()):
                if (attr.startswith("_") and attr not in _DUNDERS) or f"{name}.{attr}" in _NOT_PINNED:
                    continue
                if isinstance(value, property):
                    found[f"{name}.{attr}"] = "property"
                    continue
                function: Any = getattr(value, "__func__", value)
                if callable(function):
                    try:
                        found[f"{name}.{attr}"] = str(inspect.signature(function))
                    except (TypeError, ValueError):
                        continue
        elif inspect.isfunction(obj):  # signals and type aliases are pinned by name only
            found[name] = str(inspect.signature(obj))
    return found


def test_the_package_exports_exactly_the_pinned_names() -> None:
    assert sorted(pg_lease_django.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(pg_lease_django, name) is not None, name


def test_public_signatures_are_the_pinned_ones() -> None:
    found = _signatures()
    changed = {
        k: (SIGNATURES.get(k), found.get(k))
        for k in SIGNATURES.keys() | found.keys()
        if SIGNATURES.get(k) != found.get(k)
    }
    assert not changed, "public API changed (pinned, found): " + repr(changed)


def _base_name(cls: type) -> str:
    names = []
    for base in cls.__bases__:
        if base.__module__ == "django.db.utils":
            names.append(f"django.db.{base.__name__}")
        else:
            names.append(base.__name__)
    return "+".join(names)


def test_the_error_tree_is_the_pinned_one() -> None:
    errors = {name: getattr(pg_lease_django, name) for name in pg_lease_django.__all__ if name.endswith("Error")}
    found = {name: (_base_name(cls), cls.code) for name, cls in errors.items()}
    assert found == ERROR_TREE
    assert issubclass(pg_lease_django.OutcomeUnknownError, OperationalError)
    for name in ERROR_TREE:
        if issubclass(errors[name], pg_lease_django.OperatorRefusalError):
            assert not issubclass(errors[name], pg_lease_django.LeaseLostError), name


def test_every_lease_error_carries_both_sides() -> None:
    """``owner``/``epoch`` the caller's, ``holder``/``current_epoch`` the key's, on every error."""
    error = pg_lease_django.EpochMovedOnError("moved", key="k", epoch=3, holder="them", current_epoch=4)
    assert [getattr(error, field) for field in ERROR_FIELDS] == ["epoch_mismatch", "k", None, 3, "them", 4]
    denied = pg_lease_django.NotAcquirableError("held", key="k", owner="me", holder="them", current_epoch=4)
    assert (denied.owner, denied.holder, denied.current_epoch, denied.holder_epoch) == ("me", "them", 4, 4)
    for name in ERROR_TREE:
        cls = getattr(pg_lease_django, name)
        if issubclass(cls, pg_lease_django.LeaseError):
            assert all(hasattr(cls("m"), field) for field in ERROR_FIELDS), name


@pytest.mark.parametrize("path", sorted(MIGRATION_PATHS))
def test_paths_recorded_in_users_migrations_import_and_deconstruct_to_themselves(path: str) -> None:
    kind = MIGRATION_PATHS[path]
    cls = import_string(path)
    if kind == "constraint":
        assert cls(name="pg_lease_fence_x").deconstruct()[0] == path
    else:
        assert cls().deconstruct()[1] == path


def test_the_fencing_package_exports_exactly_the_pinned_names() -> None:
    fencing = importlib.import_module("pg_lease_django.fencing")
    assert sorted(fencing.__all__) == sorted(FENCING_NAMES)
    for name in FENCING_NAMES:
        exported = import_string(f"pg_lease_django.fencing.{name}")
        assert exported is getattr(pg_lease_django, name, exported), name


@pytest.mark.parametrize("path", DOCUMENTED_PATHS)
def test_documented_paths_import(path: str) -> None:
    assert import_string(path) is not None


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_documented_modules_import(module: str) -> None:
    assert importlib.import_module(module) is not None


@pytest.mark.parametrize("path", sorted(ELECTION_HOOKS))
def test_the_election_hooks_of_the_supervisor_keep_their_paths_and_signatures(path: str) -> None:
    assert str(inspect.signature(import_string(path))) == ELECTION_HOOKS[path]


def test_an_election_handle_before_it_starts() -> None:
    """The documented members of `Election` (docs/leader-election.md), read on a handle never started:
    nothing is held, nothing seen, ``wait_stop`` does not block, and ``with`` stops it and joins."""
    election = pg_lease_django.Election(
        "api-pin", ttl=30, owner="me", on_started_leading=lambda lease: None, on_stopped_leading=lambda: None
    )
    assert (election.key, election.owner) == ("api-pin", "me")
    assert (election.leading, election.leader, election.lease, election.stopping) == (False, None, None, False)
    assert election.wait_stop(timeout=0) is True  # not leading: there is no term to wait for
    assert repr(election) == "<Election key='api-pin' owner='me' leading=False leader=None>"
    with election as entered:
        assert entered is election
    assert election.stopping and election.join(timeout=0)
    assert pg_lease_django.current_election() is None  # not inside a leader callback
    default = pg_lease_django.Election("api-pin", ttl=30, on_started_leading=print, on_stopped_leading=print)
    assert default.owner.count(":") >= 2  # host:pid:random
