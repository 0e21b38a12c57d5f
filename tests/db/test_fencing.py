"""FencedModel on a real server: stale writes never land, the check rides inside the write.

Races use a second client (a raw psycopg connection, or a thread with its own Django connection)
and ``pg_blocking_pids`` to see who waits; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, models, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext, isolate_apps

from devkit.testapp.models import ArchivedReport, CommitTicket, CreditNote, Entry, Invoice, Report
from pg_lease_django import (
    EpochMismatchError,
    Grant,
    InvalidInputError,
    LapsedError,
    Lease,
    LeaseLostError,
    NotOwnerError,
    UnfencedWriteError,
    hold,
    unfenced_writes,
)
from pg_lease_django.checks import (
    check_fenced_many_to_many,
    check_fenced_models_have_fenced_parents,
    check_fenced_models_share_the_lease_database,
)
from pg_lease_django.fencing import FencedModel, FenceTrigger
from tests.helpers import Background, in_thread, refused, wait_until, wait_until_blocked

pytestmark = pytest.mark.django_db


def grant(key: str, owner: str = "w1", ttl: float = 30) -> Grant:
    acquired = Lease.objects.acquire(key, owner, ttl=ttl)
    assert acquired is not None, f"{owner} could not acquire {key}"
    return acquired


def wait_lapsed(key: str) -> None:
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")


def stored(invoice: Invoice) -> tuple[str, int | None]:
    row = Invoice.objects.filter(pk=invoice.pk).values_list("status", "lease_epoch").get()
    return row[0], row[1]


@pytest.fixture
def invoice(key: str) -> Invoice:
    """An invoice saved under a first grant of ``key`` (epoch 1), which is then released."""
    first = grant(key, "setup")
    created = Invoice(account=key, status="draft")
    created.save(fence=first)
    Lease.objects.release(key, "setup", first.epoch)
    return created


# ---- the basic contract ----------------------------------------------------------------------


def test_insert_and_update_are_one_statement_each_and_record_the_epoch(
    key: str, django_assert_num_queries: Any
) -> None:
    g = grant(key)
    invoice = Invoice(account=key)
    with django_assert_num_queries(1) as ctx:
        invoice.save(fence=g)
    assert "pg_lease_check_fence" in ctx.captured_queries[0]["sql"]
    assert invoice.pk is not None and invoice.lease_epoch == g.epoch
    invoice.status = "sent"
    with django_assert_num_queries(1) as ctx:
        invoice.save(fence=g)
    assert "pg_lease_check_fence" in ctx.captured_queries[0]["sql"]
    assert stored(invoice) == ("sent", g.epoch)
    with django_assert_num_queries(1):
        assert Invoice.objects.fenced(g).filter(pk=invoice.pk).update(amount=5) == 1


def test_update_fields_also_records_the_epoch(invoice: Invoice, key: str) -> None:
    g = grant(key)
    invoice.status = "sent"
    invoice.save(fence=g, update_fields=["status"])
    assert stored(invoice) == ("sent", g.epoch)


def test_stale_save_after_takeover_is_refused_as_not_owner(invoice: Invoice, key: str) -> None:
    old = grant(key, "old", ttl=0.001)
    wait_lapsed(key)
    new = grant(key, "new")
    invoice.status = "stale"
    with refused(NotOwnerError) as info:
        invoice.save(fence=old)
    assert (info.value.code, info.value.key, info.value.owner, info.value.epoch) == ("not_owner", key, "old", old.epoch)
    assert stored(invoice) == ("draft", 1)
    assert invoice.lease_epoch == 1, "a refused save leaves the instance's epoch as it was"
    invoice.status = "fresh"
    invoice.save(fence=new)
    assert stored(invoice) == ("fresh", new.epoch)


def test_save_after_lapse_without_takeover_is_refused_as_lapsed(invoice: Invoice, key: str) -> None:
    g = grant(key, ttl=0.001)
    wait_lapsed(key)
    invoice.status = "late"
    with refused(LapsedError):
        invoice.save(fence=g)
    assert stored(invoice) == ("draft", 1)
    with refused(LapsedError):
        Invoice(account=key).save(fence=g)  # a fenced insert too
    assert Invoice.objects.filter(account=key).count() == 1


def test_save_after_release_is_refused_as_not_owner(invoice: Invoice, key: str) -> None:
    g = grant(key)
    Lease.objects.release(key, "w1", g.epoch)
    invoice.status = "after-release"
    with refused(NotOwnerError):
        invoice.save(fence=g)
    assert stored(invoice) == ("draft", 1)


def test_save_after_self_takeover_is_refused_as_epoch_mismatch(invoice: Invoice, key: str) -> None:
    first = grant(key)
    second = grant(key)  # same owner, restarted: a new epoch fences the old incarnation
    invoice.status = "old-incarnation"
    with refused(EpochMismatchError):
        invoice.save(fence=first)
    invoice.save(fence=second)
    assert stored(invoice) == ("old-incarnation", second.epoch)


def test_a_refused_write_inside_atomic_rolls_the_block_back_like_any_failed_write(invoice: Invoice, key: str) -> None:
    stale = grant(key)
    live = grant(key)
    for write in (
        lambda: invoice.save(fence=stale),
        lambda: Invoice(account=key).save(fence=stale),
        lambda: Invoice.objects.fenced(stale).filter(pk=invoice.pk).update(status="stale"),
        lambda: Invoice.objects.fenced(stale).filter(pk=invoice.pk).delete(),
        lambda: invoice.delete(fence=stale),
    ):
        with pytest.raises(EpochMismatchError), transaction.atomic():
            invoice.status = "live-before"
            invoice.save(fence=live)
            write()  # refused: the whole block, the live write too, rolls back
        assert stored(invoice) == ("draft", 1)
    with transaction.atomic():
        with refused(EpochMismatchError):  # a nested atomic() (savepoint) lets the outer block go on
            invoice.save(fence=stale)
        invoice.status = "live"
        invoice.save(fence=live)
    assert stored(invoice) == ("live", live.epoch)


def test_row_epochs_never_go_backwards(key: str) -> None:
    g = grant(key)
    a, b = Invoice(account=key), Invoice(account=key)
    a.save(fence=g)
    b.save(fence=g)
    # A row written at a higher epoch than the lease's (e.g. an epoch counter that was reset).
    Invoice.objects.unfenced().filter(pk=b.pk).update(lease_epoch=g.epoch + 10)
    b.status = "backwards"
    with refused(EpochMismatchError, match="never go backwards"):
        b.save(fence=g)
    # A queryset write is all or nothing: row a is not updated either.
    with refused(EpochMismatchError):
        Invoice.objects.fenced(g).filter(account=key).update(status="bulk")
    assert sorted(Invoice.objects.filter(account=key).values_list("status", "lease_epoch")) == [
        ("draft", g.epoch),
        ("draft", g.epoch + 10),
    ]
    with refused(EpochMismatchError):
        b.delete(fence=g)
    assert Invoice.objects.filter(pk=b.pk).exists()


def test_class_level_lease_key(key: str) -> None:
    report_key = Report.lease_key
    assert report_key is not None
    g = grant(report_key)
    report = Report(title="q1")
    report.save(fence=g)
    assert Report.objects.fenced(g).update(title="q1 final") == 1
    Lease.objects.release(report_key, "w1", g.epoch)
    with refused(NotOwnerError):
        Report.objects.fenced(g).update(title="late")
    assert Report.objects.get().title == "q1 final"


def test_a_declared_key_is_derived_as_written_whatever_its_characters(key: str) -> None:
    """The key's literal is compiled into the derive function's body, itself a literal: a quote, a
    ``%`` (the DDL runs without parameters), a backslash or a dollar quote in it changes nothing."""
    odd = f"{key} it's 100% $pg_lease$ \\ $$"
    [installed] = [c for c in Report._meta.constraints if isinstance(c, FenceTrigger)]
    with connection.schema_editor() as editor:  # inside the test's transaction: rolled back with it
        editor.remove_constraint(Report, installed)
        editor.add_constraint(Report, FenceTrigger(name=installed.name, key=models.Value(odd)))
    report = Report.objects.unfenced().create(title="odd")  # stores Report.lease_key; the trigger derives
    assert Report.objects.filter(pk=report.pk).values_list("lease_id", flat=True).get() == odd


def test_a_fence_for_another_key_is_refused_before_sending_anything(key: str, django_assert_num_queries: Any) -> None:
    other = grant(f"{key}-other")
    with django_assert_num_queries(0), pytest.raises(InvalidInputError, match="guarded by lease"):
        Invoice(account=key).save(fence=other)
    with django_assert_num_queries(0), pytest.raises(InvalidInputError):
        Report.objects.fenced(other)
    with pytest.raises(InvalidInputError, match="not both"):
        Invoice(account=key).save(fence=other, unfenced=True)


def test_any_object_with_owner_and_epoch_is_a_fence(key: str) -> None:
    g = grant(key)
    invoice = Invoice(account=key)
    invoice.save(fence=SimpleNamespace(owner=g.owner, epoch=g.epoch))
    assert invoice.lease_epoch == g.epoch
    with refused(EpochMismatchError):
        invoice.save(fence=SimpleNamespace(owner=g.owner, epoch=g.epoch + 1))


# ---- querysets and delete --------------------------------------------------------------------


def test_queryset_update_and_delete_are_fenced(key: str) -> None:
    g = grant(key)
    for amount in (1, 2, 3):
        Invoice(account=key, amount=amount).save(fence=g)
    assert Invoice.objects.fenced(g).filter(account=key, amount__gte=2).update(status="sent") == 2
    assert Invoice.objects.fenced(g).filter(account=key, amount=99).update(status="sent") == 0  # fence fine
    assert Invoice.objects.fenced(g).filter(account=key, amount=99).delete() == (0, {})
    assert Invoice.objects.fenced(g).filter(pk__in=[]).update(status="x") == 0  # no SQL at all
    newer = grant(key)
    with refused(EpochMismatchError):
        Invoice.objects.fenced(g).filter(account=key).update(status="stale")
    with refused(EpochMismatchError):
        Invoice.objects.fenced(g).filter(account=key).delete()
    assert sorted(Invoice.objects.filter(account=key).values_list("amount", "status", "lease_epoch")) == [
        (1, "draft", g.epoch),
        (2, "sent", g.epoch),
        (3, "sent", g.epoch),
    ]
    assert Invoice.objects.fenced(newer).filter(account=key, amount=1).delete() == (1, {"testapp.Invoice": 1})
    assert Invoice.objects.fenced(newer).filter(account=key).update(status="paid") == 2
    assert set(Invoice.objects.filter(account=key).values_list("status", "lease_epoch")) == {("paid", newer.epoch)}


def test_bulk_update_goes_through_the_fenced_update(key: str) -> None:
    g = grant(key)
    invoices = [Invoice(account=key, amount=n) for n in (1, 2)]
    for invoice in invoices:
        invoice.save(fence=g)
        invoice.status = "sent"
    assert Invoice.objects.fenced(g).bulk_update(invoices, ["status"]) == 2
    newer = grant(key)
    with refused(EpochMismatchError):
        Invoice.objects.fenced(g).bulk_update(invoices, ["amount"])
    with pytest.raises(UnfencedWriteError):
        Invoice.objects.bulk_update(invoices, ["status"])
    assert Invoice.objects.fenced(newer).bulk_update(invoices, ["status"]) == 2
    assert set(Invoice.objects.filter(account=key).values_list("status", "lease_epoch")) == {("sent", newer.epoch)}


def test_instance_delete_is_fenced(invoice: Invoice, key: str) -> None:
    g = grant(key, ttl=0.001)
    wait_lapsed(key)
    with refused(LapsedError):
        invoice.delete(fence=g)
    assert Invoice.objects.filter(pk=invoice.pk).exists()
    live = grant(key)
    pk = invoice.pk
    assert invoice.delete(fence=live) == (1, {"testapp.Invoice": 1})
    assert invoice.pk is None and not Invoice.objects.filter(pk=pk).exists()


# ---- unfenced writes -------------------------------------------------------------------------


def test_unfenced_writes_are_refused_without_sending_anything(
    invoice: Invoice, key: str, django_assert_num_queries: Any
) -> None:
    invoice.status = "unguarded"
    with django_assert_num_queries(0):
        with pytest.raises(UnfencedWriteError) as info:
            invoice.save()
        assert info.value.code == "unfenced"
        with pytest.raises(UnfencedWriteError):
            Invoice(account=key).save()
        with pytest.raises(UnfencedWriteError):
            invoice.delete()
        with pytest.raises(UnfencedWriteError):
            Invoice.objects.filter(pk=invoice.pk).update(status="x")
        with pytest.raises(UnfencedWriteError):
            Invoice.objects.filter(pk=invoice.pk).delete()
        with pytest.raises(UnfencedWriteError):
            Invoice.objects.bulk_create([Invoice(account=key)])
        with pytest.raises(UnfencedWriteError):
            Invoice.objects.create(account=key)
        with pytest.raises(UnfencedWriteError):
            invoice.save_base()  # what loaddata and raw saves call, bypassing save()
    assert stored(invoice) == ("draft", 1)


def test_explicit_opt_outs(invoice: Invoice, key: str) -> None:
    invoice.status = "admin-edit"
    invoice.save(unfenced=True)
    assert stored(invoice) == ("admin-edit", 1), "an unfenced write keeps the row's epoch"
    assert Invoice.objects.unfenced().filter(pk=invoice.pk).update(amount=7) == 1
    with unfenced_writes():
        Invoice.objects.create(account=key, status="created")
        Invoice.objects.bulk_create([Invoice(account=key, status="bulk")])
        Invoice.objects.filter(account=key, status="bulk").update(status="bulk2")
        Invoice.objects.filter(account=key, status="bulk2").delete()
    with pytest.raises(UnfencedWriteError):
        Invoice.objects.create(account=key)  # the opt-out ended with the block
    assert sorted(Invoice.objects.filter(account=key).values_list("status", flat=True)) == ["admin-edit", "created"]
    invoice.delete(unfenced=True)
    assert not Invoice.objects.filter(pk=invoice.pk).exists()


# ---- outside any transaction (autocommit): the cause is still precise ------------------------


@pytest.mark.django_db(transaction=True)
def test_rejections_in_autocommit_are_precise(key: str) -> None:
    assert not connection.in_atomic_block
    g = grant(key, ttl=0.001)
    invoice = Invoice(account=key)
    live = grant(key)
    invoice.save(fence=live)
    with refused(EpochMismatchError):
        invoice.save(fence=g)
    Lease.objects.release(key, "w1", live.epoch)
    with refused(NotOwnerError):
        Invoice.objects.fenced(live).update(status="x")
    short = grant(key, ttl=0.001)
    wait_lapsed(key)
    with refused(LapsedError):
        invoice.save(fence=short)
    with refused(LapsedError):
        Invoice(account=key).save(fence=short)
    assert stored(invoice) == ("draft", live.epoch)


# ---- races -----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_old_holder_first_the_takeover_waits_for_the_guarded_transaction(
    key: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    monitor, taker = raw_connect(), raw_connect()
    old = grant(key, "old", ttl=1)
    invoice = Invoice(account=key)
    invoice.save(fence=old)
    with transaction.atomic():
        invoice.status = "by-old"
        invoice.save(fence=old)  # accepted: the lease row is now locked FOR SHARE until commit
        wait_lapsed(key)
        takeover = Background(
            lambda: taker.execute(
                "SELECT granted, epoch FROM pg_lease_acquire(%s, 'new', '30 seconds')", [key]
            ).fetchone()
        )
        takeover.start()
        wait_until_blocked(monitor, taker.info.backend_pid)  # the takeover waits for this transaction
        assert Lease.objects.inspect(key).owner == "old"
    granted, new_epoch = takeover.outcome()
    assert granted and new_epoch == old.epoch + 1
    assert stored(invoice) == ("by-old", old.epoch)

    # The new holder writes in an open transaction; the old holder is refused at once (no wait).
    taker.execute("BEGIN")
    updated = taker.execute(
        "UPDATE testapp_invoice SET status = 'by-new', lease_epoch = %s"
        " WHERE id = %s AND (SELECT pg_lease_fence(%s, 'new', %s)) = 'ok'",
        [new_epoch, invoice.pk, key, new_epoch],
    ).rowcount
    assert updated == 1
    invoice.status = "stale"
    with refused(NotOwnerError):
        invoice.save(fence=old)
    taker.execute("COMMIT")
    assert stored(invoice) == ("by-new", new_epoch)


@pytest.mark.django_db(transaction=True)
def test_new_holder_first_the_stale_write_waits_then_is_refused(
    key: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    monitor, taker = raw_connect(), raw_connect(autocommit=False)
    old = grant(key, "w1")
    invoice = Invoice(account=key)
    invoice.save(fence=old)
    # A restarted w1 takes over (same identity, new epoch); its transaction is still open.
    [(new_epoch,)] = taker.execute("SELECT epoch FROM pg_lease_acquire(%s, 'w1', '30 seconds')", [key]).fetchall()
    assert new_epoch == old.epoch + 1
    pids: list[int] = []

    def stale_save() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pids.append(cursor.fetchone()[0])
        stale = Invoice.objects.get(pk=invoice.pk)
        stale.status = "stale"
        stale.save(fence=old)

    writer = Background(in_thread(stale_save))
    writer.start()
    wait_until(lambda: bool(pids), what="the stale writer to connect")
    wait_until_blocked(monitor, pids[0])  # its fence saw a live lease and waits for the takeover
    taker.execute(
        "UPDATE testapp_invoice SET status = 'by-new', lease_epoch = %s"
        " WHERE id = %s AND (SELECT pg_lease_fence(%s, 'w1', %s)) = 'ok'",
        [new_epoch, invoice.pk, key, new_epoch],
    )
    taker.commit()
    with refused(EpochMismatchError):
        writer.outcome()
    assert stored(invoice) == ("by-new", new_epoch)


@pytest.mark.django_db(transaction=True)
def test_a_takeover_racing_guarded_writes_leaves_a_fenced_history(key: str) -> None:
    """Accepted epochs never decrease in commit order.

    Every write transaction first bumps one counter row: its row lock is held to commit, so the
    tickets number the transactions in commit order.
    """
    CommitTicket.objects.create(pk=1)

    def write(fence: Grant, writer: str) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("UPDATE testapp_committicket SET value = value + 1 WHERE id = 1 RETURNING value")
            (ticket,) = cursor.fetchone()
            Entry(account=key, writer=writer, ticket=ticket).save(fence=fence)

    old = grant(key, "old", ttl=2)  # long enough for a loaded machine to write once before it lapses

    def old_holder() -> type[LeaseLostError]:
        while True:
            try:
                write(old, "old")
            except LeaseLostError as lost:
                return type(lost)

    writer = Background(in_thread(old_holder))
    writer.start()
    wait_until(lambda: Entry.objects.filter(account=key).exists(), what="the old holder to write")
    wait_lapsed(key)
    new = grant(key, "new")  # may wait for an old write transaction still holding the lease row
    for _ in range(5):
        write(new, "new")
    assert writer.outcome() in (LapsedError, NotOwnerError)

    history = list(Entry.objects.filter(account=key).order_by("ticket").values_list("writer", "lease_epoch"))
    epochs = [epoch for _, epoch in history if epoch is not None]
    assert len(epochs) == len(history)
    assert epochs == sorted(epochs), "an old-epoch write committed after a new-epoch one"
    assert {("old", old.epoch), ("new", new.epoch)} == set(history)
    assert history[-5:] == [("new", new.epoch)] * 5


# ---- the SQL functions, from a client that is not Django -------------------------------------


@pytest.mark.django_db(transaction=True)
def test_sql_level_fence_from_a_raw_connection(key: str, raw_connect: Callable[..., psycopg.Connection[Any]]) -> None:
    conn = raw_connect()
    g = grant(key, ttl=30)

    def verdict(owner: str, epoch: int) -> str:
        row = conn.execute("SELECT pg_lease_fence(%s, %s, %s)", [key, owner, epoch]).fetchone()
        assert row is not None
        return str(row[0])

    def sqlstate(owner: str | None, epoch: int | None) -> str | None:
        try:
            conn.execute("SELECT pg_lease_check_fence(%s, %s, %s)", [key, owner, epoch])
        except psycopg.Error as error:
            return error.sqlstate
        return None

    assert verdict("w1", g.epoch) == "ok"
    assert conn.execute("SELECT pg_lease_check_fence(%s, 'w1', %s)", [key, g.epoch]).fetchone() == (g.epoch,)
    assert verdict("w2", g.epoch) == "not_owner"
    assert sqlstate("w2", g.epoch) == "PL001"
    assert verdict("w1", g.epoch + 1) == "epoch_mismatch"
    assert sqlstate("w1", g.epoch + 1) == "PL003"
    assert sqlstate("w1", None) == "22023"
    assert sqlstate(None, g.epoch) == "22023"
    assert conn.execute("SELECT pg_lease_fence('never-acquired', 'w1', 1)").fetchone() == ("not_owner",)

    # The guarded-write pattern in plain SQL, and the outcome of a refused one in the same transaction.
    with conn.transaction():
        cur = conn.execute(
            "INSERT INTO testapp_invoice (account, status, amount, lease_epoch)"
            " SELECT %s, 'raw', 0, %s WHERE (SELECT pg_lease_fence(%s, 'w2', %s)) = 'ok'",
            [key, g.epoch, key, g.epoch],
        )
        assert cur.rowcount == 0
        assert conn.execute("SELECT pg_lease_fence_outcome(%s, 'w2', %s)", [key, g.epoch]).fetchone() == ("not_owner",)

    # From a trigger: the table refuses writes whose (owner, epoch) columns are not the live lease.
    conn.execute("CREATE TEMP TABLE guarded (id int PRIMARY KEY, owner text, epoch bigint)")
    conn.execute(
        """CREATE FUNCTION pg_temp.guard() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN PERFORM pg_lease_check_fence(TG_ARGV[0], NEW.owner, NEW.epoch); RETURN NEW; END $$"""
    )
    conn.execute(
        psycopg.sql.SQL(
            "CREATE TRIGGER guard BEFORE INSERT OR UPDATE ON guarded FOR EACH ROW EXECUTE FUNCTION pg_temp.guard({})"
        ).format(psycopg.sql.Literal(key))
    )
    conn.execute("INSERT INTO guarded VALUES (1, 'w1', %s)", [g.epoch])
    with pytest.raises(psycopg.Error) as info:
        conn.execute("UPDATE guarded SET owner = 'w2'")
    assert info.value.sqlstate == "PL001"
    Lease.objects.release(key, "w1", g.epoch)
    with pytest.raises(psycopg.Error) as info:
        conn.execute("UPDATE guarded SET epoch = epoch")
    assert info.value.sqlstate == "PL001"
    short = grant(key, ttl=0.001)
    wait_lapsed(key)
    with pytest.raises(psycopg.Error) as info:
        conn.execute("INSERT INTO guarded VALUES (2, 'w1', %s)", [short.epoch])
    assert info.value.sqlstate == "PL002"
    assert conn.execute("SELECT count(*) FROM guarded").fetchone() == (1,)


def test_the_fence_is_evaluated_once_per_statement_before_any_row(key: str) -> None:
    g = grant(key)
    Invoice(account=key).save(fence=g)
    with CaptureQueriesContext(connection) as ctx:
        Invoice.objects.fenced(g).filter(account=key).update(status="sent")
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (COSTS OFF) {ctx.captured_queries[0]['sql']}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    # An InitPlan gating the scan: one check per statement, not one per row.
    assert "InitPlan" in plan and "One-Time Filter" in plan, plan


# ---- configuration ---------------------------------------------------------------------------


def test_system_check_refuses_a_fenced_model_outside_the_lease_database() -> None:
    class RouteTestappElsewhere:
        def db_for_write(self, model: Any, **hints: Any) -> str | None:
            return "other" if model._meta.app_label == "testapp" else None

    assert check_fenced_models_share_the_lease_database() == []
    with override_settings(DATABASE_ROUTERS=[RouteTestappElsewhere()]):
        errors = check_fenced_models_share_the_lease_database()
    assert {error.obj for error in errors} == {Invoice, Report, Entry, CreditNote, ArchivedReport}
    assert {error.id for error in errors} == {"pg_lease_django.E002"}
    assert all(error.hint for error in errors)


@isolate_apps("devkit.testapp")
def test_system_check_refuses_a_fenced_child_of_an_unfenced_model() -> None:
    class Plain(models.Model):  # noqa: DJ008
        name = models.CharField(max_length=10)

        class Meta:
            app_label = "testapp"

    class FencedChild(Plain, FencedModel):  # noqa: DJ008
        lease_key = "child"

        class Meta:
            app_label = "testapp"

    class FencedParentOk(FencedModel):
        lease_key = "parent"

        class Meta:
            app_label = "testapp"

    class ChildOfFenced(FencedParentOk):
        class Meta:
            app_label = "testapp"

    app = SimpleNamespace(get_models=lambda: [Plain, FencedChild, FencedParentOk, ChildOfFenced])
    [error] = check_fenced_models_have_fenced_parents(app_configs=[app])
    assert (error.id, error.obj) == ("pg_lease_django.E003", FencedChild)
    assert error.hint
    assert check_fenced_models_have_fenced_parents() == []


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_lease_held_in_another_database_is_named_as_such(key: str) -> None:
    with hold(key, ttl=5, using="other"), pytest.raises(UnfencedWriteError) as info:
        Invoice(account=key).save()  # goes to "default"
    assert "held in database 'other'" in str(info.value) and "goes to database 'default'" in str(info.value)
    assert not Invoice.objects.filter(account=key).exists()


@isolate_apps("devkit.testapp")
def test_system_check_warns_about_unfenced_many_to_many_rows() -> None:
    class Tag(models.Model):  # noqa: DJ008
        name = models.CharField(max_length=10)

        class Meta:
            app_label = "testapp"

    class Tagged(FencedModel):
        lease_key = "tagged"
        tags = models.ManyToManyField(Tag)

        class Meta:
            app_label = "testapp"

    app = SimpleNamespace(get_models=lambda: [Tag, Tagged])
    [warning] = check_fenced_many_to_many(app_configs=[app])
    assert (warning.id, warning.obj) == ("pg_lease_django.W003", Tagged) and warning.hint
    assert check_fenced_many_to_many() == []


def test_testapp_migrations_are_in_sync() -> None:
    call_command("makemigrations", "testapp", "--check", "--dry-run", verbosity=0)


@pytest.fixture(autouse=True)
def _no_leftover_unfenced_opt_out() -> Iterator[None]:
    yield
    with pytest.raises(UnfencedWriteError):
        Invoice(account="opt-out-must-not-leak").save()
