"""A stale or lapsed fence is refused on every write path, at every isolation level.

Migration 0012 gave the fence check and the fenced tables' trigger a fast path (one locked read
each, the trigger's comparing ``pg_lease.fences`` with the live lease row's own fence). These
tests hold the guarantee to it: an ORM ``save()``, a fenced ``update()``, a raw ``UPDATE`` that
presents the fence, one that forges ``pg_lease.fences`` by hand, and one that presented a live
fence earlier in its transaction which has lapsed since, are refused under READ COMMITTED,
REPEATABLE READ and SERIALIZABLE, and the row keeps what it had. Lapses are waited for on the
server's clock; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from devkit.testapp.models import Invoice
from pg_lease_django import Grant, Lease, LeaseLostError
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LEVELS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]
#: The SQLSTATEs of a lost lease: not_owner, lapsed, epoch_mismatch.
LOST = {"PL001", "PL002", "PL003"}


def _lapsed(key: str) -> bool:
    return Lease.objects.inspect(key).status == "lapsed"


def _stale_grant(key: str, how: str) -> tuple[Invoice, Grant]:
    """An invoice written under a first grant of ``key``, and that grant made stale: lapsed, or
    lapsed and taken over by another owner (a new epoch)."""
    first = Lease.objects.acquire(key, "w1", ttl=30)
    assert first is not None
    invoice = Invoice(account=key, status="draft")
    invoice.save(fence=first)
    # Then it lapses: renewed, same epoch, for a millisecond (a short first TTL could lapse before
    # the save on a loaded machine).
    assert Lease.objects.renew(key, "w1", first.epoch, 0.001) is not None
    wait_until(lambda: _lapsed(key), what=f"{key} to lapse")
    if how == "taken over":
        assert Lease.objects.acquire(key, "w2", ttl=30) is not None
    return invoice, first


def _stored(invoice: Invoice) -> tuple[str, int | None]:
    return Invoice.objects.filter(pk=invoice.pk).values_list("status", "lease_epoch").get()


def _refused_raw(conn: psycopg.Connection[Any], level: str, statements: list[tuple[str, list[Any]]]) -> str:
    """Run ``statements`` in one transaction at ``level``; the SQLSTATE that refused them."""
    with pytest.raises(psycopg.Error) as caught, conn.transaction():
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        for statement, params in statements:
            conn.execute(statement, params)
    return caught.value.sqlstate or ""


@pytest.mark.parametrize("how", ["lapsed", "taken over"])
@pytest.mark.parametrize("level", LEVELS)
def test_orm_save_and_update_of_a_stale_fence_are_refused(key: str, level: str, how: str) -> None:
    invoice, stale = _stale_grant(key, how)
    before = _stored(invoice)
    writes: list[Callable[[], Any]] = [
        lambda: invoice.save(fence=stale),
        lambda: Invoice.objects.fenced(stale, key=key).filter(pk=invoice.pk).update(status="stolen"),
    ]
    for write in writes:
        invoice.status = "stolen"
        with pytest.raises(LeaseLostError), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            write()
    assert _stored(invoice) == before


@pytest.mark.parametrize("how", ["lapsed", "taken over"])
@pytest.mark.parametrize("level", LEVELS)
def test_raw_sql_with_a_stale_fence_presented_or_forged_is_refused(
    key: str, level: str, how: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    invoice, stale = _stale_grant(key, how)
    before = _stored(invoice)
    conn = raw_connect()
    presented = (
        "UPDATE testapp_invoice SET status = 'stolen', lease_epoch = public.pg_lease_check_fence(%s, %s, %s) "
        "WHERE id = %s",
        [key, stale.owner, stale.epoch, invoice.pk],
    )
    assert _refused_raw(conn, level, [presented]) in LOST
    # The fence written by hand exactly as pg_lease_check_fence writes it: the trigger's own read
    # of the lease row refuses it.
    forged: list[tuple[str, list[Any]]] = [
        ("SELECT set_config('pg_lease.fences', %s, true)", [json.dumps({key: [stale.owner, stale.epoch]})]),
        ("UPDATE testapp_invoice SET status = 'stolen', lease_epoch = %s WHERE id = %s", [stale.epoch, invoice.pk]),
    ]
    assert _refused_raw(conn, level, forged) in LOST
    assert _stored(invoice) == before


@pytest.mark.parametrize("level", LEVELS)
def test_a_fence_that_lapsed_since_it_was_presented_no_longer_covers_a_write(
    key: str, level: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    """Presented live in this transaction, then lapsed: the next write of the same transaction (no
    new presentation, the setting still as the check wrote it) is refused by the trigger."""
    first = Lease.objects.acquire(key, "w1", ttl=30)
    assert first is not None
    invoice = Invoice(account=key, status="draft")
    invoice.save(fence=first)
    live = Lease.objects.acquire(key, "w1", ttl=0.5)  # the same owner again: a short lease, a new epoch
    assert live is not None and live.epoch > first.epoch
    conn = raw_connect()
    with pytest.raises(psycopg.Error) as caught, conn.transaction():
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        conn.execute("SELECT public.pg_lease_check_fence(%s, %s, %s)", [key, live.owner, live.epoch])
        wait_until(lambda: _lapsed(key), what=f"{key} to lapse")
        conn.execute(
            "UPDATE testapp_invoice SET status = 'late', lease_epoch = %s WHERE id = %s", [live.epoch, invoice.pk]
        )
    assert caught.value.sqlstate == "PL002"
    assert _stored(invoice) == ("draft", first.epoch)


@pytest.mark.parametrize("level", LEVELS)
def test_the_live_fence_writes_at_every_level(
    key: str, level: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    """The fast path's other side: the holder's own writes land, saved, updated and raw."""
    live = Lease.objects.acquire(key, "w1", ttl=30)
    assert live is not None
    invoice = Invoice(account=key, status="draft")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        invoice.save(fence=live)
        assert Invoice.objects.fenced(live, key=key).filter(pk=invoice.pk).update(status="sent") == 1
    conn = raw_connect()
    with conn.transaction():
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        conn.execute(
            "UPDATE testapp_invoice SET status = 'paid', lease_epoch = public.pg_lease_check_fence(%s, %s, %s) "
            "WHERE id = %s",
            [key, live.owner, live.epoch, invoice.pk],
        )
    assert _stored(invoice) == ("paid", live.epoch)
