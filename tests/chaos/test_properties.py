"""Bad input, generated (Hypothesis): every entry point answers with its typed error and changes nothing.

Entry points: the manager (acquire/renew/release/inspect), the SQL functions called from a raw
psycopg connection, and FencedModel saves. Inputs: arbitrary text, NUL bytes, lone surrogates,
over-long names, huge and negative numbers, wrong types. After every example the whole lease table
(row contents plus xmin/xmax/ctid: no write and no row lock) and the fenced table are byte-identical.
Deterministic (``derandomize``), a few hundred examples in all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devkit.testapp.models import Invoice
from pg_lease_django import EpochMismatchError, Grant, InvalidInputError, Lease, LeaseLostError, NotOwnerError
from pg_lease_django.fencing import unfenced_writes
from tests.chaos.test_stress import server_url

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

HELD_KEY, HOLDER = "properties-held", "holder"
MAX_EPOCH = 2**63 - 1

PROFILE = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---- strategies ---------------------------------------------------------------------------------

good_names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40)
bad_names = st.one_of(
    st.just(""),
    st.builds(lambda a, b: a + "\x00" + b, st.text(max_size=5), st.text(max_size=5)),
    st.text(alphabet="é", min_size=128, max_size=200),  # 256+ UTF-8 bytes
    st.text(alphabet="x", min_size=256, max_size=300),
    st.characters(categories=["Cs"]),  # a lone surrogate: not encodable as UTF-8
    st.none(),
    st.integers(),
    st.binary(max_size=8),
    st.floats(allow_nan=True),
    st.lists(st.text(max_size=2), max_size=2),
)
good_ttls = st.one_of(st.floats(0.01, 3600), st.integers(1, 3600), st.just(timedelta(seconds=5)))
bad_ttls = st.one_of(
    st.integers(max_value=0),
    st.floats(max_value=0.000999),
    st.just(math.nan),
    st.just(math.inf),
    st.integers(min_value=366 * 86400, max_value=2**80),
    st.floats(min_value=366 * 86400.0, allow_infinity=True),
    st.just(timedelta(microseconds=999)),
    st.just(timedelta(days=-1)),
    st.just(timedelta(days=366)),
    st.booleans(),
    st.text(max_size=5),
    st.none(),
)
good_epochs = st.integers(1, MAX_EPOCH)
bad_epochs = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=MAX_EPOCH + 1),
    st.booleans(),
    st.floats(),
    st.text(max_size=5),
    st.none(),
)

# Each operation's arguments, as (good, bad) strategy pairs.
SIGNATURES: dict[str, list[tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]] = {
    "acquire": [(good_names, bad_names), (good_names, bad_names), (good_ttls, bad_ttls)],
    "renew": [(good_names, bad_names), (good_names, bad_names), (good_epochs, bad_epochs), (good_ttls, bad_ttls)],
    "release": [(good_names, bad_names), (good_names, bad_names), (good_epochs, bad_epochs)],
    "inspect": [(good_names, bad_names)],
}


@st.composite
def bad_calls(draw: st.DrawFn) -> tuple[str, list[Any], dict[str, Any]]:
    """An operation with at least one bad argument (the others good or bad)."""
    op = draw(st.sampled_from(sorted(SIGNATURES)))
    signature = SIGNATURES[op]
    bad_at = draw(st.integers(0, len(signature) - 1))
    args = [
        draw(bad if i == bad_at or draw(st.integers(0, 4)) == 0 else good) for i, (good, bad) in enumerate(signature)
    ]
    return op, args, {}


@st.composite
def bad_acquire_options(draw: st.DrawFn) -> dict[str, Any]:
    """Valid key/owner/ttl, bad ``blocking`` / ``timeout`` combinations."""
    return draw(
        st.one_of(
            st.fixed_dictionaries({"blocking": st.one_of(st.integers(), st.text(max_size=3), st.none())}),
            st.fixed_dictionaries({"blocking": st.just(False), "timeout": st.floats(0, 10)}),
            st.fixed_dictionaries(
                {
                    "blocking": st.just(True),
                    "timeout": st.one_of(
                        st.floats(max_value=-0.001), st.just(math.nan), st.integers(min_value=366 * 86400), st.text()
                    ),
                }
            ),
        )
    )


# ---- fixtures -----------------------------------------------------------------------------------


def table_snapshot() -> tuple[Any, ...]:
    """Every lease row and invoice row with its tuple identity and lock marker (xmax)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT string_agg(l::text || xmin::text || '/' || xmax::text || ctid::text, '|' ORDER BY key)"
            "          FROM pg_lease_django_lease l),"
            "       (SELECT string_agg(i::text || xmin::text || '/' || xmax::text || ctid::text, '|' ORDER BY id)"
            "          FROM testapp_invoice i)"
        )
        row = cursor.fetchone()
    assert row is not None
    return tuple(row)


@pytest.fixture
def held() -> Grant:
    """A live lease (so a mistaken write would have something to change) and a guarded row."""
    grant = Lease.objects.acquire(HELD_KEY, HOLDER, ttl=3600)
    assert grant is not None
    with unfenced_writes():
        Invoice.objects.create(account=HELD_KEY, amount=7)
    return grant


# ---- the manager --------------------------------------------------------------------------------


@settings(PROFILE, max_examples=120)
@given(call=bad_calls())
def test_manager_rejects_bad_arguments_before_sending_anything(held: Grant, call: tuple[str, list[Any], Any]) -> None:
    op, args, _ = call
    before = table_snapshot()
    with CaptureQueriesContext(connection) as queries, pytest.raises(InvalidInputError) as raised:
        getattr(Lease.objects, op)(*args)
    assert len(queries) == 0, queries.captured_queries
    assert raised.value.code == "invalid_input"
    assert table_snapshot() == before


@settings(PROFILE, max_examples=30)
@given(options=bad_acquire_options())
def test_acquire_rejects_bad_wait_options(held: Grant, options: dict[str, Any]) -> None:
    before = table_snapshot()
    with CaptureQueriesContext(connection) as queries, pytest.raises(InvalidInputError):
        Lease.objects.acquire("properties-free", "someone", 10, **options)
    assert len(queries) == 0
    assert table_snapshot() == before


@settings(PROFILE, max_examples=40)
@given(key=good_names, owner=good_names.filter(lambda o: o != HOLDER), epoch=good_epochs, ttl=good_ttls)
def test_renew_and_release_of_a_lease_one_does_not_hold_refuse_and_change_nothing(
    held: Grant, key: str, owner: str, epoch: int, ttl: Any
) -> None:
    """Valid but wrong arguments (any text, any epoch): a refusal (``not_owner`` ...), no write, no lock."""
    before = table_snapshot()
    for candidate in (key, HELD_KEY):
        with pytest.raises(LeaseLostError):
            Lease.objects.renew(candidate, owner, epoch, ttl)
        with pytest.raises(LeaseLostError):
            Lease.objects.release(candidate, owner, epoch)
    assert table_snapshot() == before


# ---- the SQL functions from a raw connection ----------------------------------------------------

sql_bad_names = st.one_of(st.just(""), st.none(), st.text(alphabet="é", min_size=128, max_size=200))
sql_good_names = good_names
sql_bad_ttls = st.one_of(
    st.none(),
    st.just(timedelta(0)),
    st.timedeltas(max_value=timedelta(microseconds=999)),
    st.timedeltas(min_value=timedelta(days=365, microseconds=1)),
)
sql_good_ttls = st.timedeltas(min_value=timedelta(milliseconds=1), max_value=timedelta(days=365))
sql_bad_epochs = st.one_of(st.none(), st.integers(-(2**63), 0))

SQL_CALLS: dict[str, tuple[str, list[tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]]] = {
    "acquire": (
        "SELECT * FROM pg_lease_acquire(%s::text, %s::text, %s::interval)",
        [(sql_good_names, sql_bad_names), (sql_good_names, sql_bad_names), (sql_good_ttls, sql_bad_ttls)],
    ),
    "acquire_wait": (
        "SELECT * FROM pg_lease_acquire(%s::text, %s::text, %s::interval, %s::interval)",
        [
            (sql_good_names, sql_bad_names),
            (sql_good_names, sql_bad_names),
            (sql_good_ttls, sql_bad_ttls),
            (st.just(timedelta(0)), st.timedeltas(max_value=timedelta(microseconds=-1))),
        ],
    ),
    "renew": (
        "SELECT * FROM pg_lease_renew(%s::text, %s::text, %s::bigint, %s::interval)",
        [
            (sql_good_names, sql_bad_names),
            (sql_good_names, sql_bad_names),
            (good_epochs, sql_bad_epochs),
            (sql_good_ttls, sql_bad_ttls),
        ],
    ),
    "release": (
        "SELECT * FROM pg_lease_release(%s::text, %s::text, %s::bigint)",
        [(sql_good_names, sql_bad_names), (sql_good_names, sql_bad_names), (good_epochs, sql_bad_epochs)],
    ),
    "inspect": ("SELECT * FROM pg_lease_inspect(%s::text)", [(sql_good_names, sql_bad_names)]),
    "fence": (
        "SELECT pg_lease_fence(%s::text, %s::text, %s::bigint)",
        [(sql_good_names, sql_bad_names), (sql_good_names, sql_bad_names), (good_epochs, sql_bad_epochs)],
    ),
    "check_fence": (
        "SELECT pg_lease_check_fence(%s::text, %s::text, %s::bigint)",
        [(sql_good_names, sql_bad_names), (sql_good_names, sql_bad_names), (good_epochs, sql_bad_epochs)],
    ),
}


@st.composite
def bad_sql_calls(draw: st.DrawFn) -> tuple[str, list[Any]]:
    """A SQL function call with at least one invalid argument of the right SQL type."""
    name = draw(st.sampled_from(sorted(SQL_CALLS)))
    statement, signature = SQL_CALLS[name]
    bad_at = draw(st.integers(0, len(signature) - 1))
    args = [
        draw(bad if i == bad_at or draw(st.integers(0, 4)) == 0 else good) for i, (good, bad) in enumerate(signature)
    ]
    return statement, args


@pytest.fixture
def raw() -> Iterator[psycopg.Connection[Any]]:
    """A raw psycopg connection to the test database: another client, in autocommit."""
    with psycopg.connect(server_url(), autocommit=True) as conn:
        yield conn


@settings(PROFILE, max_examples=120)
@given(call=bad_sql_calls())
def test_sql_functions_reject_invalid_arguments_with_22023(
    held: Grant, raw: psycopg.Connection[Any], call: tuple[str, list[Any]]
) -> None:
    statement, args = call
    before = table_snapshot()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        raw.execute(statement, args)
    assert raised.value.sqlstate == "22023"
    assert str(raised.value).startswith("invalid_input")
    assert table_snapshot() == before


@settings(PROFILE, max_examples=20)
@given(before_nul=st.text(max_size=5), after_nul=st.text(max_size=5))
def test_nul_bytes_cannot_reach_the_sql_functions(
    held: Grant, raw: psycopg.Connection[Any], before_nul: str, after_nul: str
) -> None:
    """PostgreSQL text cannot hold NUL: the driver refuses to send it (``psycopg.DataError``)."""
    snapshot = table_snapshot()
    with pytest.raises(psycopg.DataError):
        raw.execute("SELECT * FROM pg_lease_acquire(%s, 'o', '1 s')", [before_nul + "\x00" + after_nul])
    assert table_snapshot() == snapshot


# ---- fenced writes ------------------------------------------------------------------------------


class Fence:
    """Any object with owner/epoch (and optionally key) is a fence: here with arbitrary values."""

    def __init__(self, owner: Any, epoch: Any, key: Any = None) -> None:
        self.owner = owner
        self.epoch = epoch
        if key is not None:
            self.key = key


@settings(PROFILE, max_examples=60)
@given(
    owner=st.one_of(good_names, bad_names),
    epoch=st.one_of(good_epochs, bad_epochs),
    key=st.one_of(st.none(), good_names, bad_names),
    status=st.text(st.characters(blacklist_characters="\x00"), max_size=20),  # a NUL is psycopg's DataError
)
def test_fenced_save_with_arbitrary_fences(held: Grant, owner: Any, epoch: Any, key: Any, status: str) -> None:
    """A malformed fence: InvalidInputError before anything is sent. A well-formed fence that is not
    the live lease: NotOwnerError / EpochMismatchError. Either way nothing is written."""
    invoice = Invoice.objects.get(account=HELD_KEY)
    invoice.status = status
    invoice.amount += 1
    before = table_snapshot()
    well_formed = (
        isinstance(owner, str)
        and owner
        and "\x00" not in owner
        and _encodable(owner)
        and len(owner.encode()) <= 255
        and type(epoch) is int
        and 1 <= epoch <= MAX_EPOCH
        and (key is None or key == HELD_KEY)
    )
    live = well_formed and owner == HOLDER and epoch == held.epoch
    if live:
        return
    with CaptureQueriesContext(connection) as queries:
        if well_formed:
            with pytest.raises((NotOwnerError, EpochMismatchError)):
                invoice.save(fence=Fence(owner, epoch, key))
        else:
            with pytest.raises(InvalidInputError):
                invoice.save(fence=Fence(owner, epoch, key))
            assert len(queries) == 0
    assert table_snapshot() == before
    assert invoice.lease_epoch is None  # the instance keeps its previous epoch


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@settings(PROFILE, max_examples=30)
@given(amount=st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31) - 1)))
def test_a_value_the_column_cannot_hold_fails_in_the_database_and_writes_nothing(held: Grant, amount: int) -> None:
    """Out-of-range data under a live fence: the database error (22003), no partial write, lease untouched."""
    from django.db import DataError, transaction

    invoice = Invoice.objects.get(account=HELD_KEY)
    invoice.amount = amount
    before = table_snapshot()
    with pytest.raises(DataError), transaction.atomic():
        invoice.save(fence=held)
    assert table_snapshot() == before


@settings(PROFILE, max_examples=30)
@given(owner=good_names, epoch=good_epochs, status=st.text(max_size=20))
def test_fenced_save_with_a_well_formed_fence_that_is_not_the_lease(
    held: Grant, owner: str, epoch: int, status: str
) -> None:
    """Any owner text and any epoch but the live pair: refused by the fence, nothing written."""
    if (owner, epoch) == (HOLDER, held.epoch):
        return
    invoice = Invoice.objects.get(account=HELD_KEY)
    invoice.status = status
    before = table_snapshot()
    with pytest.raises((NotOwnerError, EpochMismatchError)):
        invoice.save(fence=Fence(owner, epoch))
    assert table_snapshot() == before
