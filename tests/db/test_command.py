"""``manage.py leases`` on a real server: every subcommand and option, JSON, exit codes.

Most tests go through ``call_command``; the exit codes, one-line errors and absence of tracebacks
are checked once more in a real ``python -m django leases`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from pg_lease_django import (
    AlreadyFreeError,
    EpochMovedOnError,
    InvalidInputError,
    Lease,
    LeaseLostError,
    NeverAcquiredError,
    NotOwnerError,
    OperatorRefusalError,
    querysets,
)
from pg_lease_django.display import describe_expiry, format_duration
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.managers import NOTIFY_CHANNEL
from tests.helpers import conninfo, free, held, lapsed, row_snapshot, url_of_test_database, wait_until

pytestmark = pytest.mark.django_db

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Result:
    """What one ``leases`` invocation printed and how it ended."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> Any:
        return json.loads(self.out)

    def lines(self) -> list[str]:
        return self.out.splitlines()


def leases(*args: str) -> Result:
    """Run ``leases ARGS`` through call_command; a CommandError becomes its exit code and message."""
    out, err = StringIO(), StringIO()
    try:
        call_command("leases", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return Result(exc.returncode, out.getvalue(), str(exc))
    return Result(0, out.getvalue(), err.getvalue())


# -- list ---------------------------------------------------------------------------------------------


def test_list_is_a_sorted_table_with_state_owner_epoch_expiry_and_count(key: str, trio: dict[str, str]) -> None:
    result = leases("list", "--prefix", key)
    assert result.code == 0
    header, *rows, summary = result.lines()
    assert header.split() == ["KEY", "STATE", "OWNER", "EPOCH", "EXPIRES", "ACQUIRED", "AT"]
    assert [row.split()[0] for row in rows] == sorted(trio.values())
    by_key = {row.split()[0]: row.split() for row in rows}
    assert by_key[trio["held"]][1:4] == ["held", "worker-1", "1"]
    assert by_key[trio["held"]][4] == "in"
    assert by_key[trio["lapsed"]][1:5] == ["lapsed", "worker-2", "1", "lapsed"]
    assert by_key[trio["lapsed"]][6] == "ago"
    assert by_key[trio["free"]][1:5] == ["free", "-", "2", "-"]
    assert summary.startswith("3 leases (server time ")


def test_plain_leases_lists(key: str, trio: dict[str, str]) -> None:
    everything = leases()
    assert everything.code == 0
    for lease_key in trio.values():
        assert lease_key in everything.out


def _server_clock() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (instant,) = cursor.fetchone()
    return instant  # type: ignore[no-any-return]


def test_list_json_has_stable_fields_and_iso_times(key: str, trio: dict[str, str]) -> None:
    before = _server_clock()
    document = leases("list", "--prefix", key, "--json").json()
    after = _server_clock()
    assert set(document) == {"server_time", "count", "leases"}
    assert document["count"] == 3
    server_time = datetime.fromisoformat(document["server_time"])
    assert server_time.tzinfo is not None
    rows = {row["key"]: row for row in document["leases"]}
    assert [row["key"] for row in document["leases"]] == sorted(trio.values())
    fields = {"key", "state", "owner", "epoch", "acquired_at", "expires_at", "expires_in_seconds"}
    assert all(set(row) == fields for row in document["leases"])

    holder = rows[trio["held"]]
    assert (holder["state"], holder["owner"], holder["epoch"]) == ("held", "worker-1", 1)
    expires_at = datetime.fromisoformat(holder["expires_at"])
    assert datetime.fromisoformat(holder["acquired_at"]) < server_time < expires_at
    assert before <= server_time <= after
    # Counted from a reading of the server's clock of its own, microseconds from server_time's
    # (querysets.ServerNow): one taken during the statement, so bounded by the readings around it.
    assert (expires_at - after).total_seconds() <= holder["expires_in_seconds"] <= (expires_at - before).total_seconds()
    assert 0 < holder["expires_in_seconds"] <= 30

    former = rows[trio["lapsed"]]
    assert (former["state"], former["owner"]) == ("lapsed", "worker-2")
    assert former["expires_in_seconds"] < 0

    assert rows[trio["free"]] == {
        "key": trio["free"],
        "state": "free",
        "owner": None,
        "epoch": 2,
        "acquired_at": None,
        "expires_at": None,
        "expires_in_seconds": None,
    }


def test_list_json_of_nothing_still_has_the_server_time(key: str) -> None:
    document = leases("list", "--prefix", key, "--json").json()
    assert document["count"] == 0 and document["leases"] == []
    assert datetime.fromisoformat(document["server_time"]).tzinfo is not None
    (line,) = leases("list", "--prefix", key).lines()
    assert line.startswith("0 leases (server time ")


def states_of(*args: str) -> dict[str, str]:
    return {row["key"]: row["state"] for row in leases("list", *args, "--json").json()["leases"]}


def test_state_filter_is_computed_from_the_server_clock(key: str, trio: dict[str, str]) -> None:
    assert states_of("--prefix", key, "--state", "held") == {trio["held"]: "held"}
    assert states_of("--prefix", key, "--state", "lapsed") == {trio["lapsed"]: "lapsed"}
    assert states_of("--prefix", key, "--state", "free") == {trio["free"]: "free"}
    assert states_of("--prefix", key, "--state", "held", "--state", "lapsed") == {
        trio["held"]: "held",
        trio["lapsed"]: "lapsed",
    }
    # A short grant moves from held to lapsed with no write: only the clock decides. (Whether the
    # listing still sees it held depends on how soon it runs: the row's version says nothing wrote.)
    short = f"{key}/d-short"
    held(short, "quick", ttl=0.3)
    with psycopg.connect(conninfo(), autocommit=True) as raw:
        written = row_snapshot(raw, short)
        wait_until(lambda: states_of("--prefix", short) == {short: "lapsed"}, what="the listing to show the lapse")
        assert row_snapshot(raw, short) == written


def test_owner_filter_matches_holders_and_lapsed_holders(key: str, trio: dict[str, str]) -> None:
    assert states_of("--prefix", key, "--owner", "worker-1") == {trio["held"]: "held"}
    assert states_of("--prefix", key, "--owner", "worker-2") == {trio["lapsed"]: "lapsed"}
    assert states_of("--prefix", key, "--owner", "nobody") == {}


def test_prefix_and_glob_filters(key: str) -> None:
    names = ["jobs:a", "jobs:b", "jobs_x", "jobsX", "job", "reports:a", "jobs:%", "jobs:a\\b"]
    for name in names:
        held(f"{key}/{name}")
    p = f"{key}/"
    assert set(states_of("--prefix", p + "jobs:")) == {p + "jobs:a", p + "jobs:b", p + "jobs:%", p + "jobs:a\\b"}
    # LIKE metacharacters in a prefix are literal text.
    assert set(states_of("--prefix", p + "jobs_")) == {p + "jobs_x"}
    assert set(states_of("--prefix", p + "jobs:%")) == {p + "jobs:%"}
    assert set(states_of("--glob", p + "jobs?a*")) == {p + "jobs:a", p + "jobs:a\\b"}
    assert set(states_of("--glob", p + "*:a")) == {p + "jobs:a", p + "reports:a"}
    assert set(states_of("--glob", p + "jobs:a\\b")) == {p + "jobs:a\\b"}
    assert set(states_of("--prefix", p + "jobs", "--glob", "*X")) == {p + "jobsX"}


def test_limit_cuts_the_output_but_the_count_covers_everything(key: str) -> None:
    for i in range(5):
        held(f"{key}/{i}")
    document = leases("list", "--prefix", key, "--limit", "2", "--json").json()
    assert document["count"] == 5
    assert [row["key"] for row in document["leases"]] == [f"{key}/0", f"{key}/1"]
    assert leases("list", "--prefix", key, "--limit", "2").lines()[-1].startswith("showing 2 of 5 leases")


def test_prefix_walks_the_primary_key_index_on_a_bytewise_collation(key: str) -> None:
    collation = querysets.key_collation(connection, connection.ops.quote_name(Lease._meta.db_table))
    if not querysets.collation_is_bytewise(collation):
        pytest.skip(f"the key column's collation {collation} does not sort by code point: seq scan by design")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, epoch) SELECT %s || '/' || g, 1 FROM generate_series(1, 20000) g",
            [key],
        )
        cursor.execute("ANALYZE pg_lease_django_lease")
    with CaptureQueriesContext(connection) as queries:
        document = leases("list", "--prefix", f"{key}/1999", "--json").json()
    assert document["count"] == 11  # 1999 and 19990..19999
    listing = next(q["sql"] for q in queries.captured_queries if "pg_lease_status" in q["sql"])
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + listing)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Index Scan using pg_lease_django_lease_pkey" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_prefix_stays_correct_without_a_bytewise_collation(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "ab", "b", "a/c"):
        held(f"{key}/{name}")
    monkeypatch.setattr(querysets, "collation_is_bytewise", lambda settings: False)
    with CaptureQueriesContext(connection) as queries:
        assert set(states_of("--prefix", f"{key}/a")) == {f"{key}/a", f"{key}/ab", f"{key}/a/c"}
    listing = next(q["sql"] for q in queries.captured_queries if "pg_lease_status" in q["sql"])
    assert '"key" >=' not in listing


@pytest.mark.slow
def test_listing_100k_leases_is_one_statement(key: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at)"
            " SELECT %s || '/' || g, 'w' || (g %% 7), g, now(), now() + (g %% 3 - 1) * interval '1 hour'"
            " FROM generate_series(1, 100000) g",
            [key],
        )
    with CaptureQueriesContext(connection) as queries:
        document = leases("list", "--prefix", key, "--json").json()
    assert document["count"] == 100000
    assert sum("pg_lease_status" in q["sql"] for q in queries.captured_queries) == 1
    assert len(queries.captured_queries) <= 2  # the collation look-up and the listing
    assert {row["state"] for row in document["leases"]} == {"held", "lapsed"}
    table = leases("list", "--prefix", key, "--state", "held").lines()
    assert table[-1].startswith("33333 leases")


# -- show ---------------------------------------------------------------------------------------------


def test_show_lists_the_facts_of_one_lease(trio: dict[str, str]) -> None:
    result = leases("show", trio["held"])
    assert result.code == 0
    facts = dict(line.split(":", 1) for line in result.lines())
    assert {name: value.strip() for name, value in facts.items() if name in {"key", "state", "owner", "epoch"}} == {
        "key": trio["held"],
        "state": "held",
        "owner": "worker-1",
        "epoch": "1",
    }
    assert "(in " in facts["expires at"]
    assert set(facts) == {"key", "state", "owner", "epoch", "acquired at", "expires at", "server time"}


def test_show_json(trio: dict[str, str]) -> None:
    document = leases("show", trio["lapsed"], "--json").json()
    assert (document["key"], document["state"], document["owner"], document["epoch"]) == (
        trio["lapsed"],
        "lapsed",
        "worker-2",
        1,
    )
    assert datetime.fromisoformat(document["server_time"]) > datetime.fromisoformat(document["expires_at"])
    assert leases("show", trio["free"], "--json").json()["state"] == "free"


def test_show_unknown_key_exits_3(key: str) -> None:
    result = leases("show", key)
    assert (result.code, result.err) == (ExitCode.NOT_FOUND, f"no lease with key {key!r} (never acquired, or pruned)")


# -- release ------------------------------------------------------------------------------------------


def test_release_refuses_without_force_and_changes_nothing(key: str) -> None:
    epoch = held(key, "w1")
    result = leases("release", key)
    assert result.code == ExitCode.NOT_FORCED
    assert "without --force" in result.err and "'w1'" in result.err
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "w1", epoch)


def test_release_force_frees_bumps_the_epoch_and_fences_the_holder(key: str) -> None:
    epoch = held(key, "w1")
    result = leases("release", key, "--force")
    assert result.code == 0
    assert result.out.strip() == f"Released {key!r} (held by 'w1' at epoch {epoch}). New epoch: {epoch + 1}"
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("free", None, epoch + 1)
    with pytest.raises(NotOwnerError):
        Lease.objects.renew(key, "w1", epoch, ttl=30)
    assert Lease.objects.acquire(key, "w2", ttl=30).epoch == epoch + 2  # type: ignore[union-attr]


def test_release_a_lapsed_lease(key: str) -> None:
    epoch = lapsed(key, "w-old")
    document = leases("release", key, "--force", "--json").json()
    assert document == {
        "key": key,
        "released": True,
        "dry_run": False,
        "previous_owner": "w-old",
        "previous_state": "lapsed",
        "previous_epoch": epoch,
        "epoch": epoch + 1,
    }
    assert Lease.objects.inspect(key).status == "free"


def test_release_with_the_current_epoch(key: str) -> None:
    epoch = held(key)
    assert leases("release", key, "--force", "--epoch", str(epoch)).code == 0
    assert Lease.objects.inspect(key).epoch == epoch + 1


def test_release_refuses_when_the_epoch_moved_on(key: str) -> None:
    old = held(key, "w1")
    new = held(key, "w1")  # self-takeover: the operator's epoch is stale
    result = leases("release", key, "--force", "--epoch", str(old))
    assert result.code == ExitCode.MOVED_ON
    assert f"its epoch is {new}" in result.err and f"not {old}" in result.err
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("held", new)


def test_release_refuses_when_the_lease_changes_hands_while_releasing(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held(key, "w1")
    real = type(Lease.objects).force_release

    def takeover_first(self: Any, lease_key: str, *, epoch: int | None = None, operator: str | None = None) -> int:
        # Between the command's look and its release, the lease is freed and taken by w2.
        Lease.objects.release(lease_key, "w1", Lease.objects.inspect(lease_key).epoch)
        held(lease_key, "w2")
        return real(self, lease_key, epoch=epoch, operator=operator)

    monkeypatch.setattr(type(Lease.objects), "force_release", takeover_first)
    result = leases("release", key, "--force")
    assert result.code == ExitCode.MOVED_ON and "nothing released" in result.err
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner) == ("held", "w2")


def test_release_dry_run_changes_nothing(key: str) -> None:
    epoch = held(key, "w1")
    result = leases("release", key, "--dry-run")
    assert result.code == 0
    assert result.out.strip() == (
        f"Dry run: would release {key!r} (held by 'w1' at epoch {epoch}); its epoch would become {epoch + 1}."
    )
    document = leases("release", key, "--force", "--dry-run", "--json").json()
    assert (document["released"], document["dry_run"], document["epoch"]) == (False, True, epoch + 1)
    assert leases("release", key, "--dry-run", "--epoch", str(epoch + 5)).code == ExitCode.MOVED_ON
    state = Lease.objects.inspect(key)
    assert (state.status, state.owner, state.epoch) == ("held", "w1", epoch)


def test_release_of_a_free_or_unknown_key(key: str) -> None:
    epoch = free(key)
    result = leases("release", key, "--force")
    assert (result.code, result.err) == (
        ExitCode.ALREADY_FREE,
        f"lease {key!r} is already free (epoch {epoch}): nothing to release",
    )
    assert Lease.objects.inspect(key).epoch == epoch
    assert leases("release", key + "-unknown", "--force").code == ExitCode.NOT_FOUND


# -- arguments, databases, colours -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", ""], "key must not be empty"),
        (["show", "k\x00"], "key must not contain NUL characters"),
        (["show", "é" * 200], "key is 400 bytes long; the limit is 255 (UTF-8)"),
        (["release", "", "--force"], "key must not be empty"),
        (["release", "k", "--force", "--epoch", "abc"], "--epoch must be a whole number, got 'abc'"),
        (["release", "k", "--force", "--epoch", "0"], "--epoch must be between 1 and 9223372036854775807, got 0"),
        (["release", "k", "--force", "--epoch", "-3"], "--epoch must be between 1 and 9223372036854775807, got -3"),
        (["release", "k", "--force", "--epoch", str(2**63)], "--epoch must be between 1 and"),
        (["list", "--limit", "0"], "--limit must be between 1 and"),
        (["list", "--owner", ""], "owner must not be empty"),
        (["list", "--prefix", ""], "--prefix must be non-empty text without NUL characters"),
        (["list", "--glob", ""], "--glob must be non-empty text without NUL characters"),
        (["list", "--database", "nope"], "unknown database alias 'nope'"),
        (["--database", "nope", "list"], "unknown database alias 'nope'"),
        (["show", "k", "--database", "sqlite"], "database 'sqlite' is sqlite, not PostgreSQL"),
    ],
)
def test_bad_arguments_get_a_one_line_error_and_exit_2(args: list[str], message: str) -> None:
    result = leases(*args)
    assert result.code == ExitCode.USAGE
    assert result.err.startswith(message)
    assert "\n" not in result.err


@pytest.mark.django_db(databases=["default", "other"])
def test_database_option_on_every_subcommand(key: str) -> None:
    grant = Lease.objects.db_manager("other").acquire(key, "w-other", ttl=30)
    assert grant is not None
    assert leases("list", "--prefix", key, "--json").json()["count"] == 0
    assert leases("list", "--prefix", key, "--json", "--database", "other").json()["count"] == 1
    assert leases("--database", "other", "list", "--prefix", key, "--json").json()["count"] == 1
    assert leases("show", key).code == ExitCode.NOT_FOUND
    assert leases("show", key, "--database", "other", "--json").json()["owner"] == "w-other"
    assert leases("release", key, "--force").code == ExitCode.NOT_FOUND
    assert leases("release", key, "--force", "--database", "other").code == 0
    assert Lease.objects.db_manager("other").inspect(key).epoch == grant.epoch + 1


@pytest.mark.django_db(databases=["default", "other"])
def test_the_default_database_is_where_the_router_sends_lease_writes(key: str) -> None:
    class LeasesElsewhere:
        def db_for_write(self, model: Any, **hints: Any) -> str | None:
            return "other" if model._meta.app_label == "pg_lease_django" else None

    assert Lease.objects.db_manager("other").acquire(key, "w-other", ttl=30) is not None
    with override_settings(DATABASE_ROUTERS=[LeasesElsewhere()]):
        assert leases("show", key, "--json").json()["owner"] == "w-other"


def test_colour_follows_no_color(trio: dict[str, str], key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("django.core.management.color.supports_color", lambda: True)
    coloured = leases("list", "--prefix", key)
    assert "\x1b[" in coloured.out
    for args in (["list", "--prefix", key, "--no-color"], ["--no-color", "list", "--prefix", key]):
        plain = leases(*args)
        assert plain.code == 0 and "\x1b[" not in plain.out
    assert "\x1b[" in leases("show", trio["held"]).out
    assert "\x1b[" not in leases("show", trio["held"], "--no-color").out
    assert "\x1b[" in leases("--force-color", "show", trio["held"]).out


def test_database_errors_are_one_line(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(querysets.ServerNow, "template", "(SELECT no_such_function())")
    result = leases("show", key)
    assert result.code == ExitCode.DATABASE_ERROR
    assert result.err.startswith("database error: function no_such_function(")
    assert "\n" not in result.err


# -- helpers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "upper"),
    [("a", "b"), ("job:", "job;"), ("a\U0010ffff", "b"), ("\U0010ffff", None), ("x\ud7ff", "x\ue000")],
)
def test_prefix_upper_bound(prefix: str, upper: str | None) -> None:
    assert querysets.prefix_upper_bound(prefix) == upper


@pytest.mark.parametrize(
    ("glob", "like", "literal"),
    [
        ("jobs:*", "jobs:%", "jobs:"),
        ("a?b*", "a_b%", "a"),
        ("100%_done\\", "100\\%\\_done\\\\", "100%_done\\"),
        ("*x", "%x", ""),
    ],
)
def test_glob_to_like(glob: str, like: str, literal: str) -> None:
    assert querysets.glob_to_like(glob) == (like, literal)


@pytest.mark.parametrize(
    ("settings", "bytewise"),
    [
        ({"provider": "c", "collate": "C"}, True),
        ({"provider": "c", "collate": "POSIX"}, True),
        ({"provider": "c", "collate": "C.UTF-8"}, True),
        ({"provider": "c", "collate": "C.utf8"}, True),
        ({"provider": "b", "collate": "C"}, True),
        ({"provider": "c", "collate": "en_US.UTF-8"}, False),
        ({"provider": "i", "collate": "C"}, False),
        ({"provider": "d", "collate": None}, False),
        ({}, False),
    ],
)
def test_collation_is_bytewise(settings: dict[str, Any], bytewise: bool) -> None:
    assert querysets.collation_is_bytewise(settings) is bytewise


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.44, "0.4s"), (29.9, "29s"), (245, "4m 05s"), (7380, "2h 03m"), (273600, "3d 04h"), (-3.2, "3.2s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(timedelta(seconds=seconds)) == text


def test_describe_expiry() -> None:
    assert describe_expiry("held", timedelta(seconds=29.5)) == "in 29s"
    assert describe_expiry("held", timedelta(seconds=-0.001)) == "in 0.0s"  # state and clock read together
    assert describe_expiry("lapsed", timedelta(seconds=-185)) == "lapsed 3m 05s ago"
    assert describe_expiry("free", None) == "-"


# -- the manager method behind it ---------------------------------------------------------------------


def test_force_release_returns_the_new_epoch(key: str) -> None:
    epoch = held(key)
    assert Lease.objects.force_release(key) == epoch + 1
    with pytest.raises(AlreadyFreeError, match="already free") as free:
        Lease.objects.force_release(key)
    assert free.value.current_epoch == epoch + 1 and free.value.code == "already_free"
    with pytest.raises(NeverAcquiredError, match="never acquired") as unknown:
        Lease.objects.force_release(key + "-unknown")
    assert unknown.value.code == "not_found"
    # An operator's refusal, not a lost lease: the operator never held it, and has nothing to stop.
    assert isinstance(free.value, OperatorRefusalError) and isinstance(unknown.value, OperatorRefusalError)
    assert not isinstance(free.value, LeaseLostError) and not isinstance(unknown.value, LeaseLostError)
    assert (unknown.value.owner, unknown.value.epoch, unknown.value.holder) == (None, None, None)


def test_force_release_with_a_stale_epoch_names_the_current_holder(key: str) -> None:
    old = held(key, "w1")
    Lease.objects.force_release(key)
    held(key, "w2")
    with pytest.raises(EpochMovedOnError) as caught:
        Lease.objects.force_release(key, epoch=old)
    # The caller's side (no owner: an operator; the epoch it named), then the key's.
    assert (caught.value.key, caught.value.owner, caught.value.epoch) == (key, None, old)
    assert (caught.value.holder, caught.value.current_epoch) == ("w2", old + 2)
    assert Lease.objects.inspect(key).owner == "w2"


@pytest.mark.parametrize(("bad_key", "epoch"), [("", None), ("k", 0), ("k", True), ("k", "1")])
def test_force_release_checks_its_input(bad_key: str, epoch: Any) -> None:
    with pytest.raises(InvalidInputError):
        Lease.objects.force_release(bad_key, epoch=epoch)


@pytest.mark.django_db(transaction=True)
def test_force_release_wakes_listeners(key: str, raw_connect: Callable[..., psycopg.Connection[Any]]) -> None:
    listener, waiter = raw_connect(), raw_connect()
    listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
    held(key)
    # Releases notify only when a waiter registered (tests/db/test_notify.py): one does.
    registered = waiter.execute(
        "SELECT granted FROM pg_lease_acquire_or_register(%s, 'waiter', '60 s', '1 minute')", [key]
    ).fetchone()
    assert registered == (False,)
    Lease.objects.force_release(key)
    payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert payloads == [key]


# -- a real process -----------------------------------------------------------------------------------


@pytest.fixture
def cli(transactional_db: None) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m django leases ...`` in a child process against the test database."""
    env = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "django", "leases", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


@pytest.mark.django_db(transaction=True)
def test_exit_codes_from_a_real_process(key: str, cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """Each way out of a process: success, argparse's usage error, the command's own refusal of an
    argument, and a refusal raised with its code (the tests above, in-process, give every code
    its cause; here one process per kind of exit, the rest of the table by value)."""
    # Held for longer than the processes below can take on a loaded machine (each starts Python and
    # Django): the forced release must find it held, not lapsed.
    epoch = held(key, "w1", ttl=3600)
    outcomes = {
        "ok": cli("show", key),
        "usage": cli("list", "--state", "bogus"),
        "bad key": cli("show", ""),
        "moved on": cli("release", key, "--force", "--epoch", str(epoch + 1)),
    }
    released = cli("release", key, "--force", "--no-color")
    already_free = cli("release", key, "--force")
    codes = {name: proc.returncode for name, proc in outcomes.items()}
    assert codes == {"ok": 0, "usage": 2, "bad key": 2, "moved on": 5}
    assert (ExitCode.NOT_FOUND, ExitCode.NOT_FORCED, ExitCode.MOVED_ON, ExitCode.ALREADY_FREE) == (3, 4, 5, 6)
    assert (released.returncode, released.stdout.strip()) == (
        0,
        f"Released {key!r} (held by 'w1' at epoch {epoch}). New epoch: {epoch + 1}",
    )
    assert already_free.returncode == 6
    for proc in [*outcomes.values(), released, already_free]:
        assert "Traceback" not in proc.stderr
    for name in ("bad key", "moved on"):
        assert outcomes[name].stderr.count("\n") == 1, outcomes[name].stderr  # one line
        assert outcomes[name].stdout == ""
    assert "invalid choice: 'bogus'" in outcomes["usage"].stderr
