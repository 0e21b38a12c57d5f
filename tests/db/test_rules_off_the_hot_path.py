"""The rules migration 0014 tests later, or in fewer expressions, hold as before.

Every expression a PL/pgSQL function reaches is compiled again in each transaction, each function
in it looked up and its EXECUTE privilege checked, so 0014 tests less on the way to a grant, a
renewal or a release: release and renew test a key, owner or epoch only after their UPDATE matched
no row (none can match one that breaks an input rule), acquire tests the key only where no row has
it, and ``pg_lease_guard_update`` takes a grant and a release by the shortest way. These tests name
a lease that exists, so that the late tests are what refuses: a bad input must still be
``invalid_input`` (not a verdict such as ``epoch_mismatch``), in the same precedence, with nothing
written; and every rewrite the trigger refused is still refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.helpers import held, lapsed, row_snapshot

pytestmark = pytest.mark.django_db(transaction=True)

Connect = Callable[..., psycopg.Connection[Any]]

RENEW = "SELECT * FROM pg_lease_renew(%s, %s, %s, %s)"
HEARTBEAT = "SELECT * FROM pg_lease_heartbeat(%s, %s, %s, %s)"
RELEASE = "SELECT * FROM pg_lease_release(%s, %s, %s)"
ACQUIRE = "SELECT * FROM pg_lease_acquire(%s, %s, %s)"


def refused_as_invalid(conn: psycopg.Connection[Any], key: str, sql: str, params: list[Any]) -> str:
    """The 22023 message of ``sql``, checking that the lease row was left as it was."""
    before = row_snapshot(conn, key)
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        conn.execute(sql, params)
    assert info.value.sqlstate == "22023"
    assert row_snapshot(conn, key) == before
    return str(info.value)


@pytest.mark.parametrize("sql", [RENEW, HEARTBEAT], ids=["renew", "heartbeat"])
@pytest.mark.parametrize(
    ("owner", "epoch", "message"),
    [
        ("", 1, "owner must not be empty"),
        (None, 1, "owner must not be empty"),
        ("o" * 256, 1, "owner is 256 bytes long"),
        ("w1", 0, "epoch must be a positive integer"),
        ("w1", -1, "epoch must be a positive integer"),
        ("w1", None, "epoch must be a positive integer"),
    ],
    ids=["empty-owner", "null-owner", "long-owner", "epoch-0", "epoch-negative", "null-epoch"],
)
def test_a_renewal_naming_a_live_lease_with_a_bad_input_is_invalid_input(
    raw_connect: Connect, key: str, sql: str, owner: Any, epoch: Any, message: str
) -> None:
    assert held(key) == 1
    assert message in refused_as_invalid(raw_connect(), key, sql, [key, owner, epoch, "30 seconds"])


@pytest.mark.parametrize(
    ("owner", "epoch", "message"),
    [
        ("", 1, "owner must not be empty"),
        ("o" * 256, 1, "owner is 256 bytes long"),
        ("w1", 0, "epoch must be a positive integer"),
        ("w1", None, "epoch must be a positive integer"),
    ],
    ids=["empty-owner", "long-owner", "epoch-0", "null-epoch"],
)
def test_a_release_naming_a_live_lease_with_a_bad_input_is_invalid_input(
    raw_connect: Connect, key: str, owner: Any, epoch: Any, message: str
) -> None:
    assert held(key) == 1
    assert message in refused_as_invalid(raw_connect(), key, RELEASE, [key, owner, epoch])


@pytest.mark.parametrize(
    ("sql", "params", "message"),
    [
        # Every rule broken at once: the key's is named, then the owner's, then the epoch's, then the TTL's.
        (RENEW, ["", "", 0, "0 seconds"], "key must not be empty"),
        (RENEW, ["{key}", "", 0, "0 seconds"], "owner must not be empty"),
        (RENEW, ["{key}", "w1", 0, "0 seconds"], "epoch must be a positive integer"),
        (RENEW, ["{key}", "w1", 1, "1 month"], "must not have a month or year part"),
        (RELEASE, ["k" * 256, "", 0], "key is 256 bytes long"),
        (RELEASE, ["{key}", "", 0], "owner must not be empty"),
        (ACQUIRE, ["k" * 256, "", "0 seconds"], "key is 256 bytes long"),
        (ACQUIRE, ["{key}", "", "0 seconds"], "owner must not be empty"),
        (ACQUIRE, ["{key}", "w2", "0 seconds"], "ttl must be between"),
    ],
    ids=[
        "renew-key",
        "renew-owner",
        "renew-epoch",
        "renew-ttl",
        "release-key",
        "release-owner",
        "acquire-key",
        "acquire-owner",
        "acquire-ttl",
    ],
)
def test_the_first_rule_broken_is_the_one_named(
    raw_connect: Connect, key: str, sql: str, params: list[Any], message: str
) -> None:
    assert held(key) == 1
    values = [key if value == "{key}" else value for value in params]
    assert message in refused_as_invalid(raw_connect(), key, sql, values)


def test_a_new_key_that_breaks_the_key_rules_is_invalid_input(raw_connect: Connect) -> None:
    conn = raw_connect()
    for bad, message in (("", "key must not be empty"), (None, "key must not be empty"), ("k" * 256, "256 bytes")):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute(ACQUIRE, [bad, "w1", "30 seconds"])


def test_a_rewrite_that_raises_the_epoch_still_keeps_the_key(raw_connect: Connect, key: str) -> None:
    """The trigger's short way is for a new epoch of the same key: moving the key refuses, whatever
    the epoch does."""
    held(key)
    conn = raw_connect()
    before = row_snapshot(conn, key)
    assert before is not None
    with pytest.raises(psycopg.errors.CheckViolation, match="keep their key"):
        conn.execute("UPDATE pg_lease_django_lease SET key = key || '/moved', epoch = epoch + 1 WHERE key = %s", [key])
    after = row_snapshot(conn, key)
    assert after is not None and after[0] == before[0], "unchanged (xmax shows the trigger's row lock)"


def test_a_release_marker_on_the_same_epoch_is_judged_and_stamped(raw_connect: Connect, key: str) -> None:
    """Only pg_lease_release sends the marker with a new epoch; a writer that sends it alone has it
    replaced by the clock (never stored) on a live lease, and refused on a lapsed one."""
    conn = raw_connect()
    held(key)
    updated = conn.execute(
        "UPDATE pg_lease_django_lease SET released_at = '-infinity' WHERE key = %s "
        "RETURNING released_at > clock_timestamp() - interval '1 minute', owner, expires_at IS NOT NULL",
        [key],
    ).fetchall()
    assert updated == [(True, "w1", True)]

    old = f"{key}:lapsed"
    lapsed(old)
    before = row_snapshot(conn, old)
    assert before is not None
    assert (
        conn.execute("UPDATE pg_lease_django_lease SET released_at = '-infinity' WHERE key = %s", [old]).rowcount == 0
    )
    after = row_snapshot(conn, old)
    assert after is not None and after[0] == before[0], "unchanged (xmax shows the trigger's row lock)"
