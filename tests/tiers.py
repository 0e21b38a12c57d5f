"""Which tests run where: `make test`'s tier, CI's pooled leg and its server-version matrix.

`make test` runs what a contributor needs for any change; the tests it leaves out (`LEFT_OUT`:
long, soak, cluster and browser runs) run in `make test-all`, which CI runs on PostgreSQL 15 and on
the embedded 18. Each module that talks to the server is named below once per leg: in it (its tests
get the leg's marker, ``pooler`` or ``server_version``) or out of it, with the reason its behaviour
does not depend on what the leg varies. A module named out may still put single tests in the leg by
marking them (``@pytest.mark.server_version``): its costly tests run once per CI run, the few whose
behaviour does depend on the leg on every major too. tests/structure/test_tiers.py fails on a module that talks
to the server and is named in neither: a new test cannot silently fall out of a leg.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

import pytest

#: The tiers `make test` leaves out: `make test-all` runs them (and CI, which runs that).
LEFT_OUT = ("slow", "soak", "cluster", "browser")

#: Tiers that run once per CI run, on PostgreSQL 15 and the embedded 18, never in the pooled leg or
#: the matrix (their servers, clusters and many processes are the same whatever the pooler or major).
ONCE = ("slow", "soak", "cluster", "chaos", "browser", "acceptance")

_READS = "plain SELECTs rendered for people: the same statements whatever passes them on"
_SERVER_RULES = "rules the server enforces (triggers, schema, migrations): the pooler passes statements on unchanged"
_OWN_DATABASES = "databases and processes of its own, made directly on the server, never through the pooler"
_NO_SESSION = "one statement per call through Django's connection; no session state for a pooler to change"

#: Modules in the pooled leg (PgBouncer in transaction pooling in front of the server): the code
#: under test keeps or relies on session state (LISTEN, advisory locks, SET, backend pids,
#: transactions spanning statements, cancels, roles), or has a path of its own behind a pooler.
POOLER = {
    "test_async", "test_attacks", "test_blocking", "test_command_run", "test_concurrency", "test_cursor_path",
    "test_deployment", "test_fencing", "test_health", "test_hold_pool", "test_interrupts", "test_interrupts_jobs",
    "test_jobs", "test_judged_under_lock", "test_manager", "test_metrics", "test_notify", "test_security",
    "test_settling_pooled", "test_sigterm", "test_supervisor", "test_tenants", "test_validation", "test_first_hour",
    "test_admin_fenced", "test_durability", "test_async_calls", "test_tenants_off_path", "test_fence_isolation",
}  # fmt: skip

#: Modules that talk to the server but whose behaviour does not depend on a pooler, and why.
NOT_POOLER = {
    "test_admin": _READS,
    "test_history_display": _READS,
    "test_terminal_escapes": _READS,
    "test_querysets": _READS,
    "test_command": _READS,
    "test_watch": _READS,
    "test_history": _SERVER_RULES,
    "test_lease_table_triggers": _SERVER_RULES,
    "test_lease_table_writers": _SERVER_RULES,
    "test_fence_trigger_version": _SERVER_RULES,
    "test_schema": _SERVER_RULES,
    "test_advance_epochs": _SERVER_RULES,
    "test_prune": _SERVER_RULES,
    "test_compat": _SERVER_RULES,
    "test_sql_source": _OWN_DATABASES,
    "test_sqlchange": _OWN_DATABASES,
    "test_testing": _OWN_DATABASES,
    "test_django_internals": _NO_SESSION,
    "test_settling_unread": "direct sessions' server processes; behind a pooler the marker finds attempts",
}

#: Modules on every PostgreSQL major of the matrix (14, 16, 17): SQL whose meaning moved between
#: majors (privileges, roles and parameter grants, CREATE on public, triggers, catalogs) and the
#: operations every other path is built of.
SERVER_VERSION = {
    "test_manager", "test_concurrency", "test_schema", "test_validation", "test_fencing", "test_security",
    "test_sql_source", "test_lease_table_triggers", "test_lease_table_writers", "test_fence_trigger_version",
    "test_tenants", "test_health", "test_compat", "test_advance_epochs", "test_prune",
    "test_durability", "test_tenants_off_path", "test_fence_isolation",
}  # fmt: skip

_SAME_SQL = "Python paths over the operations the matrix runs on every major: the same statements"

#: Modules that talk to the server but whose behaviour does not depend on its major, and why.
NOT_SERVER_VERSION = {
    name: _SAME_SQL
    for name in (
        "test_admin", "test_admin_fenced", "test_async", "test_attacks", "test_blocking", "test_command",
        "test_command_run", "test_cursor_path", "test_deployment", "test_django_internals", "test_first_hour",
        "test_history", "test_history_display", "test_hold_pool", "test_interrupts", "test_interrupts_jobs",
        "test_jobs", "test_judged_under_lock", "test_metrics", "test_notify", "test_querysets",
        "test_settling_pooled", "test_sigterm", "test_sqlchange", "test_supervisor", "test_terminal_escapes",
        "test_testing", "test_watch", "test_async_calls", "test_settling_unread",
    )
} | {
    "test_deployment_whole": "Django processes over the docs' set-up; its tests that see the major (the"
    " set-up's grants, CREATEROLE before 16, the checks from every seat) carry the marker themselves",
}  # fmt: skip

#: Each leg's marker, its modules and the modules named out of it.
LEGS: dict[str, tuple[set[str], dict[str, str]]] = {
    "pooler": (POOLER, NOT_POOLER),
    "server_version": (SERVER_VERSION, NOT_SERVER_VERSION),
}


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


def talks_to_server(item: pytest.Item) -> bool:
    """The test uses the test database (pytest-django's database fixtures, directly or by marker)."""
    return item.get_closest_marker("django_db") is not None or "django_db_setup" in getattr(item, "fixturenames", ())


class Legs:
    """Gives each test of a leg's modules the leg's marker, before ``-m`` selects by it."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            for marker, (modules, _) in LEGS.items():
                if module_of(item) in modules and item.get_closest_marker(marker) is None:
                    item.add_marker(marker)


class LeftOut:
    """Counts the tests the marker selection left out and says so on the run's last line, with the
    command that runs them (``PG_LEASE_TEST_LEFT_OUT``, set by `make test`).

    Under pytest-xdist the workers collect and deselect; each reports its count to the controller
    (``workeroutput``), which prints after pytest's own summary line (``pytest_unconfigure``).
    """

    def __init__(self, command: str) -> None:
        self.command = command
        self.count = 0

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.count += len(items)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        output = getattr(session.config, "workeroutput", None)
        if output is not None:
            output["left_out"] = self.count

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        self.count = max(self.count, getattr(node, "workeroutput", {}).get("left_out", 0))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if not hasattr(config, "workerinput"):
            selection = config.option.markexpr
            print(f"{self.count} tests left out by -m {selection!r}: `{self.command}` runs them all", flush=True)


class Dump:
    """Writes each collected test's module, markers and whether it talks to the server, as JSON lines
    (``PG_LEASE_TIERS_DUMP``: a path; tests/structure/test_tiers.py collects the suite with it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        with open(self.path, "w", encoding="utf-8") as out:
            for item in items:
                markers = sorted({marker.name for marker in item.iter_markers()})
                row = {"id": item.nodeid, "module": module_of(item), "markers": markers}
                out.write(json.dumps({**row, "server": talks_to_server(item)}) + "\n")


def refuse_lost_groups(config: pytest.Config) -> None:
    """Stops a run whose tests would lose their ``xdist_group``.

    Tests that must not overlap (roles, parameter grants: the server's, not a test database's) share
    a group, and ``--dist loadgroup`` sends a group to one worker by a suffix pytest-xdist 3.8 writes
    into each test's node id. pytest 9.2 keeps node ids where that write no longer lands
    (pytest-dev/pytest-xdist#1386): the groups are dropped without a word, and such tests run side
    by side and fail once in a while. The test extra pins pytest below 9.2; this says so when an
    environment holds another.
    """
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    xdist = tuple(int(part) for part in importlib.metadata.version("pytest-xdist").split(".")[:2])
    if pytest.version_tuple[:2] >= (9, 2) and xdist <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {'.'.join(map(str, xdist))} drops xdist_group "
            "(pytest-dev/pytest-xdist#1386): tests that must not overlap would run side by side. "
            "Install the test extra's pins: pip install -e '.[test]'"
        )


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(Legs(), "tests-legs")
    refuse_lost_groups(config)
    if dump := os.environ.get("PG_LEASE_TIERS_DUMP"):
        config.pluginmanager.register(Dump(dump), "tests-tiers-dump")
    command = os.environ.get("PG_LEASE_TEST_LEFT_OUT")
    if command:
        config.pluginmanager.register(LeftOut(command), "tests-left-out")
