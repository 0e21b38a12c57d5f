"""Bad input: a typed error before any SQL is sent, and nothing changes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pg_lease_django import InvalidInputError, Lease
from pg_lease_django.validation import (
    MAX_ADVANCE,
    MAX_EPOCH,
    MAX_NAME_BYTES,
    MAX_TTL,
    MAX_WAIT,
    MIN_TTL,
    check_advance,
    check_epoch,
    check_name,
    check_ttl,
    check_wait,
)

pytestmark = pytest.mark.django_db

BAD_NAMES: list[Any] = ["", "x" * 256, "é" * 128, "nul\x00byte", "\ud800", None, 7, b"bytes", ["k"]]
BAD_TTLS: list[Any] = [
    0,
    -1,
    0.0001,
    float("nan"),
    float("inf"),
    1e300,
    timedelta(days=366),
    timedelta(0),
    True,
    "30",
    None,
]
BAD_EPOCHS: list[Any] = [0, -1, 1.5, "1", None, True, 2**63]


def table_contents() -> list[tuple[Any, ...]]:
    return list(Lease.objects.order_by("key").values_list("key", "owner", "epoch", "expires_at"))


@pytest.fixture
def held(key: str) -> str:
    assert Lease.objects.acquire(key, "w1", ttl=30) is not None
    return key


def assert_rejected(call: Any, django_assert_num_queries: Any) -> None:
    before = table_contents()
    with django_assert_num_queries(0), pytest.raises(InvalidInputError) as info:
        call()
    assert info.value.code == "invalid_input"
    assert isinstance(info.value, ValueError)
    assert table_contents() == before


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_keys_and_owners(bad: Any, held: str, django_assert_num_queries: Any) -> None:
    assert_rejected(lambda: Lease.objects.acquire(bad, "w1", 30), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.acquire(held, bad, 30), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.renew(bad, "w1", 1, 30), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.renew(held, bad, 1, 30), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.release(bad, "w1", 1), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.release(held, bad, 1), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.inspect(bad), django_assert_num_queries)


@pytest.mark.parametrize("bad", BAD_TTLS)
def test_bad_ttls(bad: Any, held: str, django_assert_num_queries: Any) -> None:
    assert_rejected(lambda: Lease.objects.acquire(held, "w2", bad), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.renew(held, "w1", 1, bad), django_assert_num_queries)


@pytest.mark.parametrize("bad", BAD_EPOCHS)
def test_bad_epochs(bad: Any, held: str, django_assert_num_queries: Any) -> None:
    assert_rejected(lambda: Lease.objects.renew(held, "w1", bad, 30), django_assert_num_queries)
    assert_rejected(lambda: Lease.objects.release(held, "w1", bad), django_assert_num_queries)


def test_limits_are_inclusive(key: str) -> None:
    longest = "k" * 255
    assert Lease.objects.acquire(longest, "o" * 255, ttl=timedelta(days=365)) is not None
    assert Lease.objects.acquire(key, "w1", ttl=0.001) is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("sql", "params"),
    [
        ("SELECT pg_lease_acquire(%s, 'w', '30 s')", [""]),
        ("SELECT pg_lease_acquire(%s, 'w', '30 s')", ["x" * 256]),
        ("SELECT pg_lease_acquire('k', %s, '30 s')", [None]),
        ("SELECT pg_lease_acquire('k', 'w', %s)", [timedelta(0)]),
        ("SELECT pg_lease_acquire('k', 'w', %s)", [timedelta(days=400)]),
        ("SELECT pg_lease_acquire('k', 'w', '30 s', %s)", [timedelta(seconds=-1)]),
        ("SELECT pg_lease_renew('k', 'w', %s, '30 s')", [0]),
        ("SELECT pg_lease_release('k', 'w', %s)", [-3]),
        ("SELECT pg_lease_inspect(%s)", [""]),
    ],
)
def test_sql_functions_reject_bad_input_with_22023(sql: str, params: list[Any], raw_connect: Any) -> None:
    conn = raw_connect()
    before = conn.execute("SELECT count(*), coalesce(sum(epoch), 0) FROM pg_lease_django_lease").fetchone()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        conn.execute(sql, params)
    assert info.value.sqlstate == "22023"
    assert "invalid_input" in str(info.value)
    assert conn.execute("SELECT count(*), coalesce(sum(epoch), 0) FROM pg_lease_django_lease").fetchone() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_ttl(0), "ttl must be between 0.001 s and 365 days, got 0 s"),
        (lambda: check_ttl(timedelta(days=400)), "ttl must be between 0.001 s and 365 days, got 400 days"),
        (lambda: check_ttl(0.0005), "got 0.0005 s"),
    ],
)
def test_durations_in_errors_read_as_seconds_or_days(call: Any, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        call()
    assert message in str(info.value)


def test_python_limits_are_the_sql_functions_limits(key: str, raw_connect: Any) -> None:
    """Just inside and just outside each limit in validation.py, the SQL functions agree with Python.

    The SQL blocking acquire bounds its wait from below only: there, Python's MAX_WAIT must pass.
    """
    conn = raw_connect()
    waiter = f"{key}:wait"  # only ever acquired by "w": a blocking attempt on it is granted at once

    def sql_accepts(statement: str, params: list[Any]) -> bool:
        try:
            conn.execute(statement, params)
        except (psycopg.errors.InvalidParameterValue, psycopg.errors.NumericValueOutOfRange):
            return False
        return True

    def python_accepts(check: Callable[[], object]) -> bool:
        try:
            check()
        except InvalidInputError:
            return False
        return True

    inspect = "SELECT * FROM pg_lease_inspect(%s::text)"
    acquire = "SELECT * FROM pg_lease_acquire(%s::text, %s::text, %s::interval)"
    blocking = "SELECT * FROM pg_lease_acquire(%s::text, 'w', '30 s', %s::interval)"
    renew = "SELECT * FROM pg_lease_renew(%s::text, 'w', %s::bigint, '30 s')"
    advance = "SELECT * FROM pg_lease_advance_epochs(%s::bigint, true)"  # a dry run
    name, wide = "k" * MAX_NAME_BYTES, "é" * (MAX_NAME_BYTES // 2) + "k"  # both MAX_NAME_BYTES long in UTF-8
    us = timedelta(microseconds=1)
    # (what, whether it is within the limit, Python's check, the SQL statement and its arguments)
    cases: list[tuple[str, bool, Callable[[], object], str, list[Any]]] = [
        ("key of MAX_NAME_BYTES", True, lambda: check_name("key", name), inspect, [name]),
        ("key one byte longer", False, lambda: check_name("key", name + "k"), inspect, [name + "k"]),
        ("2-byte key of MAX_NAME_BYTES", True, lambda: check_name("key", wide), inspect, [wide]),
        ("2-byte key one char longer", False, lambda: check_name("key", "é" + wide), inspect, ["é" + wide]),
        ("owner of MAX_NAME_BYTES", True, lambda: check_name("owner", name), acquire, [key, name, "30 s"]),
        ("owner one byte longer", False, lambda: check_name("owner", name + "o"), acquire, [key, name + "o", "30 s"]),
        ("MIN_TTL", True, lambda: check_ttl(MIN_TTL), acquire, [waiter, "w", MIN_TTL]),
        ("MIN_TTL - 1 us", False, lambda: check_ttl(MIN_TTL - us), acquire, [waiter, "w", MIN_TTL - us]),
        ("MAX_TTL", True, lambda: check_ttl(MAX_TTL), acquire, [waiter, "w", MAX_TTL]),
        ("MAX_TTL + 1 us", False, lambda: check_ttl(MAX_TTL + us), acquire, [waiter, "w", MAX_TTL + us]),
        ("wait 0", True, lambda: check_wait(True, 0), blocking, [waiter, timedelta(0)]),
        ("wait -1 us", False, lambda: check_wait(True, -us), blocking, [waiter, -us]),
        ("MAX_WAIT", True, lambda: check_wait(True, MAX_WAIT), blocking, [waiter, MAX_WAIT]),
        ("epoch 1", True, lambda: check_epoch(1), renew, [key, 1]),
        ("epoch 0", False, lambda: check_epoch(0), renew, [key, 0]),
        ("MAX_EPOCH", True, lambda: check_epoch(MAX_EPOCH), renew, [key, MAX_EPOCH]),
        ("MAX_EPOCH + 1", False, lambda: check_epoch(MAX_EPOCH + 1), renew, [key, MAX_EPOCH + 1]),
        ("advance 1", True, lambda: check_advance(1), advance, [1]),
        ("advance 0", False, lambda: check_advance(0), advance, [0]),
        ("MAX_ADVANCE + 1", False, lambda: check_advance(MAX_ADVANCE + 1), advance, [MAX_ADVANCE + 1]),
    ]
    verdicts = [
        (what, within, python_accepts(check), sql_accepts(statement, params))
        for what, within, check, statement, params in cases
    ]
    wrong = [
        f"{what}: Python {python}, SQL {sql}" for what, within, python, sql in verdicts if not within == python == sql
    ]
    assert not wrong, "accepted? " + "; ".join(wrong)
