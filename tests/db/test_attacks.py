"""The attack suite: every way 0.1.0's promise was broken, each forced to its worst interleaving.

The promise: a holder that lost its lease never writes (PostgreSQL refuses the write, whoever sends
it), and a lease once won is kept by its winner until it lapses or is released. Each test names the
attack; docs/FAILURE-MODEL.md lists them with what stops each one. Interleavings are forced with
a second real connection and ``pg_blocking_pids``; nothing sleeps in place of synchronisation.
Roles and lookalike functions are in tests/db/test_security.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import DatabaseError, connection, connections, transaction

from devkit.testapp.models import ArchivedReport, CreditNote, Entry, Invoice, Report
from pg_lease_django import (
    EpochMismatchError,
    Grant,
    InvalidInputError,
    LapsedError,
    Lease,
    NotOwnerError,
    UnfencedWriteError,
    hold,
    unfenced_writes,
)
from tests.helpers import Background, in_thread, refused, wait_until, wait_until_blocked


def grant(key: str, owner: str = "w1", ttl: float = 30) -> Grant:
    acquired = Lease.objects.acquire(key, owner, ttl=ttl)
    assert acquired is not None, f"{owner} could not acquire {key}"
    return acquired


def wait_lapsed(key: str) -> None:
    wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")


def pid_of(conn: psycopg.Connection[Any]) -> int:
    return int(conn.info.backend_pid)


@pytest.fixture
def during_statement() -> Iterator[Callable[[int, Callable[[], None]], None]]:
    """Run ``action`` right after the Nth statement Django's connection sends (an injection point
    between the statements of one ORM call)."""
    wrappers: list[Any] = []

    def inject(n: int, action: Callable[[], None]) -> None:
        sent = 0

        def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
            nonlocal sent
            result = execute(sql, params, many, context)
            sent += 1
            if sent == n:
                action()
            return result

        cm = connection.execute_wrapper(wrapper)
        cm.__enter__()
        wrappers.append(cm)

    yield inject
    for cm in reversed(wrappers):
        cm.__exit__(None, None, None)


# ---- 1. multi-table inheritance: a takeover between Django's statements ----------------------


@pytest.mark.django_db(transaction=True)
def test_mti_update_holds_off_a_takeover_injected_between_its_statements(
    key: str, raw_connect: Any, during_statement: Any
) -> None:
    old = grant(key, "old")
    note = CreditNote(account=key, reason="r0")
    note.save(fence=old)
    operator = raw_connect()
    takeover: list[Background] = []

    def force_takeover() -> None:
        # The SELECT of ids has run (and presented the fence); the UPDATEs have not.
        thread = Background(
            lambda: operator.execute("SELECT outcome, epoch FROM pg_lease_force_release(%s, NULL)", [key]).fetchone()
        )
        thread.start()
        takeover.append(thread)
        wait_until_blocked(raw_connect(), pid_of(operator))  # it waits for the fenced transaction

    during_statement(1, force_takeover)
    assert CreditNote.objects.fenced(old).filter(pk=note.pk).update(reason="r1", status="s1") == 1
    assert takeover[0].outcome() == ("ok", old.epoch + 1), "the release came after the fenced update committed"
    with refused(NotOwnerError):
        CreditNote.objects.fenced(old).filter(pk=note.pk).update(reason="stale")
    assert CreditNote.objects.values_list("reason", "status", "lease_epoch").get(pk=note.pk) == ("r1", "s1", old.epoch)


@pytest.mark.django_db(transaction=True)
def test_mti_statements_sent_one_by_one_are_each_refused_without_the_fence(key: str, raw_connect: Any) -> None:
    """0.1.0's path: the fenced SELECT of ids, then plain UPDATEs, each committing alone."""
    g = grant(key)
    note = CreditNote(account=key)
    note.save(fence=g)
    writer = raw_connect()
    writer.execute("SELECT pg_lease_check_fence(%s, %s, %s)", [key, g.owner, g.epoch])  # its own transaction
    with pytest.raises(psycopg.Error) as child:
        writer.execute("UPDATE testapp_creditnote SET reason = 'x' WHERE invoice_ptr_id = %s", [note.pk])
    with pytest.raises(psycopg.Error) as parent:
        writer.execute("UPDATE testapp_invoice SET status = 'x' WHERE id = %s", [note.pk])
    assert (child.value.sqlstate, parent.value.sqlstate) == ("PL004", "PL004")


# ---- 2. a lease per row: moving a row into your lease ------------------------------------------


@pytest.mark.django_db(transaction=True)  # each write its own transaction, as for two real workers
def test_a_holder_of_lease_b_cannot_take_a_row_of_lease_a(key: str) -> None:
    key_a, key_b = f"{key}-A", f"{key}-B"
    ga, gb = grant(key_a, "holder-a"), grant(key_b, "holder-b")
    row = Invoice(account=key_a, status="a's")
    row.save(fence=ga)
    stolen = Invoice.objects.get(pk=row.pk)
    stolen.account, stolen.status = key_b, "b's now"
    with refused(UnfencedWriteError, match=key_a) as info:
        stolen.save(fence=gb)
    assert info.value.key == key_a
    with refused(UnfencedWriteError, match=key_a):
        stolen.save(fence=gb, update_fields=["status"])  # the stored key is checked, not the instance's
    with refused(UnfencedWriteError, match=key_a):
        Invoice.objects.fenced(gb).filter(pk=row.pk).update(status="b's now")
    assert Invoice.objects.values_list("account", "status", "lease_id").get(pk=row.pk) == (key_a, "a's", key_a)
    # Holding both leases, in one transaction, the move is allowed.
    with transaction.atomic():
        Invoice.objects.fenced(ga).filter(pk=row.pk).update(status="handed over")
        stolen.save(fence=gb)
    assert Invoice.objects.values_list("account", "lease_id", "lease_epoch").get(pk=row.pk) == (key_b, key_b, gb.epoch)


@pytest.mark.django_db
def test_bulk_writes_cannot_smuggle_rows_of_another_lease(key: str) -> None:
    g = grant(key)
    other = f"{key}-other"
    with refused(UnfencedWriteError, match=other):
        Invoice.objects.fenced(g).bulk_create([Invoice(account=key), Invoice(account=other)])
    assert not Invoice.objects.filter(account__in=[key, other]).exists()


# ---- 3. the lease table itself -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "rewrite",
    [
        "UPDATE pg_lease_django_lease SET epoch = epoch - 1 WHERE key = %s",
        "UPDATE pg_lease_django_lease SET owner = 'intruder' WHERE key = %s",
        "UPDATE pg_lease_django_lease SET key = key || '-moved' WHERE key = %s",
    ],
    ids=["lower-epoch", "owner-without-epoch", "rename-key"],
)
def test_the_lease_table_refuses_rewrites_whoever_sends_them(key: str, raw_connect: Any, rewrite: str) -> None:
    stale = grant(key)
    grant(key)  # a self-takeover: the first grant is stale
    superuser = raw_connect()  # even the table's owner (the test server's superuser)
    with pytest.raises(psycopg.errors.CheckViolation, match="epoch only grows"):
        superuser.execute(rewrite, [key])
    with refused(EpochMismatchError):
        Invoice(account=key).save(fence=stale)


# ---- 5. waiters never hold the winner's row --------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("waiter", ["sql", "python-in-atomic"])
def test_a_waiter_that_loses_the_race_after_locking_keeps_no_lock(key: str, raw_connect: Any, waiter: str) -> None:
    """Forced: the waiter looks (lapsed), the winner's takeover holds the row, the waiter blocks
    on it, the winner commits; the waiter then locks the new row version and is refused."""
    grant(key, "first", ttl=0.2)
    wait_lapsed(key)
    winner = raw_connect(autocommit=False)
    granted, epoch = winner.execute(
        "SELECT granted, epoch FROM pg_lease_acquire(%s, 'winner', '30 s')", [key]
    ).fetchone()
    assert granted
    loser = raw_connect()
    if waiter == "sql":
        attempt = Background(
            lambda: loser.execute("SELECT granted FROM pg_lease_acquire(%s, 'loser', '30 s', '3 s')", [key]).fetchone()
        )
    else:

        @in_thread
        def python_waiter() -> Any:
            with transaction.atomic():
                return Lease.objects.acquire(key, "loser", ttl=30, blocking=True, timeout=3)

        attempt = Background(python_waiter)
    attempt.start()
    probe = raw_connect()
    wait_until(
        lambda: (
            probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND cardinality(pg_blocking_pids(pid)) > 0 AND query LIKE %s",
                ["%pg_lease_acquire%"],
            ).fetchone()[0]
            > 0
        ),
        what="the waiter to block on the winner's row lock",
    )
    winner.commit()
    # The loser was refused and keeps waiting (3 s): the winner renews without waiting for it.
    renewer = raw_connect()
    renewer.execute("SET lock_timeout = '2s'")
    for _ in range(5):
        (outcome,) = renewer.execute(
            "SELECT outcome FROM pg_lease_renew(%s, 'winner', %s, '30 s')", [key, epoch]
        ).fetchone()
        assert outcome == "ok"
    probe.execute("SET lock_timeout = '100ms'")
    probe.execute("BEGIN")
    probe.execute("SELECT 1 FROM pg_lease_django_lease WHERE key = %s FOR UPDATE NOWAIT", [key])  # nobody holds it
    probe.execute("ROLLBACK")
    if waiter == "sql":
        with pytest.raises(psycopg.errors.QueryCanceled):
            attempt.outcome()
    else:
        with pytest.raises(Exception, match="still held"):
            attempt.outcome()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_eight_waiters_on_a_lapsing_key_never_slow_the_winners_renewals(key: str, raw_connect: Any) -> None:
    """4 SQL bounded waits and 4 Python blocking acquires (2 inside atomic()) on a key that lapses;
    whoever wins renews every 20 ms while the others keep trying, never blocked by them."""
    grant(key, "first", ttl=0.5)
    results: dict[str, Any] = {}
    threads: list[threading.Thread] = []

    def sql_waiter(name: str) -> None:
        conn = raw_connect()
        try:
            row = conn.execute(
                "SELECT granted, epoch FROM pg_lease_acquire(%s, %s, '30 s', '4 s')", [key, name]
            ).fetchone()
            results[name] = row
        except psycopg.errors.QueryCanceled:
            results[name] = "timeout"

    def python_waiter(name: str, in_atomic: bool) -> None:
        try:
            if in_atomic:
                with transaction.atomic():
                    g = Lease.objects.acquire(key, name, ttl=30, blocking=True, timeout=4)
            else:
                g = Lease.objects.acquire(key, name, ttl=30, blocking=True, timeout=4)
            results[name] = (True, g.epoch)
        except Exception as exc:
            results[name] = type(exc).__name__
        finally:
            connections.close_all()

    for i in range(4):
        threads.append(threading.Thread(target=sql_waiter, args=(f"sql{i}",)))
        threads.append(threading.Thread(target=python_waiter, args=(f"py{i}", i < 2)))
    for thread in threads:
        thread.start()
    wait_until(lambda: any(isinstance(r, tuple) and r[0] for r in results.values()), timeout=10, what="a winner")
    [(winner, (_, epoch))] = [(n, r) for n, r in results.items() if isinstance(r, tuple) and r[0]]
    renewer = raw_connect()
    # Blocked behind a loser, a renewal would wait out the loser's statement (seconds) for its lock:
    # lock_timeout counts only time spent waiting for a lock, never a stall of this machine's CPUs.
    renewer.execute("SET lock_timeout = '1s'")
    latencies: list[float] = []
    while len(latencies) < 100:
        started = time.monotonic()
        (outcome,) = renewer.execute(
            "SELECT outcome FROM pg_lease_renew(%s, %s, %s, '30 s')", [key, winner, epoch]
        ).fetchone()
        latencies.append(time.monotonic() - started)
        assert outcome == "ok"
        time.sleep(0.02)
    for thread in threads:
        thread.join(10)
    losers = {n: r for n, r in results.items() if n != winner}
    assert set(losers.values()) <= {"timeout", "LeaseTimeoutError"}, losers
    latencies.sort()
    print(f"\nworst renewal {latencies[-1]:.3f}s; p50 {latencies[len(latencies) // 2]:.4f}s")


# ---- 6. a long fenced transaction keeps its own lease ------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_long_fenced_transaction_does_not_starve_its_heartbeat(key: str) -> None:
    losses: list[Any] = []
    rivals: list[Any] = []
    with hold(key, ttl=1.5, on_lost=losses.append) as lease:
        started = time.monotonic()
        with transaction.atomic():
            n = 0
            while time.monotonic() - started < 4:
                Entry(account=key, writer="job", ticket=n).save(fence=lease)
                n += 1
                rival = Background(in_thread(lambda: Lease.objects.acquire(key, "rival", ttl=5)))
                rival.start()
                rivals.append(rival.outcome())
                time.sleep(0.2)
        lease.check()  # raises if the lease was lost
    assert losses == [], "the hold was told its lease was lost"
    assert rivals and all(r is None for r in rivals), "nobody else got the lease meanwhile"
    assert Entry.objects.filter(account=key).count() == n
    assert set(Entry.objects.filter(account=key).values_list("lease_epoch", flat=True)) == {lease.epoch}


# ---- 7. the smaller holes ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_fence_outcome_is_about_the_fence_it_is_asked_about(key: str, raw_connect: Any) -> None:
    live = grant(f"{key}-1")
    grant(f"{key}-2")
    stale_epoch = grant(f"{key}-2").epoch - 1
    conn = raw_connect(autocommit=False)
    assert conn.execute("SELECT pg_lease_fence(%s, %s, %s)", [live.key, "w1", live.epoch]).fetchone() == ("ok",)
    assert conn.execute("SELECT pg_lease_fence_outcome(%s, %s, %s)", [f"{key}-2", "w1", stale_epoch]).fetchone() == (
        "epoch_mismatch",
    )
    conn.rollback()


@pytest.mark.django_db(transaction=True)
def test_a_fence_waits_for_a_renewal_decided_before_expiry_instead_of_answering_lapsed(
    key: str, raw_connect: Any
) -> None:
    g = grant(key, ttl=0.3)
    renewal = raw_connect(autocommit=False)
    (outcome,) = renewal.execute("SELECT outcome FROM pg_lease_renew(%s, 'w1', %s, '30 s')", [key, g.epoch]).fetchone()
    assert outcome == "ok"  # decided before expiry, not yet committed
    wait_lapsed(key)  # the committed row says lapsed now
    checker = raw_connect()
    verdict = Background(lambda: checker.execute("SELECT pg_lease_fence(%s, 'w1', %s)", [key, g.epoch]).fetchone())
    verdict.start()
    wait_until_blocked(raw_connect(), pid_of(checker))
    renewal.commit()
    assert verdict.outcome() == ("ok",), "never 'lapsed' and then 'ok' for the same fence"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ttl", ["-1 month 30 days 1 second", "12 months 5 days", "1 month", "1 day -23:59:59.9995"])
def test_ttls_with_months_or_below_a_millisecond_are_refused_in_sql(key: str, raw_connect: Any, ttl: str) -> None:
    conn = raw_connect()
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT * FROM pg_lease_acquire(%s, 'w1', %s::interval)", [key, ttl])
    assert Lease.objects.inspect(key).epoch == 0


@pytest.mark.django_db(transaction=True)
def test_a_day_long_ttl_is_exact_seconds_whatever_the_time_zone(key: str, raw_connect: Any) -> None:
    conn = raw_connect()
    conn.execute("SET TIME ZONE 'Europe/Paris'")  # 2026-03-29: a 23-hour day there
    granted, ttl = conn.execute(
        "SELECT granted, expires_at - server_time FROM pg_lease_acquire(%s, 'w1', '1 day')", [key]
    ).fetchone()
    assert granted and ttl.total_seconds() == 86400


@pytest.mark.django_db
@pytest.mark.parametrize("fence", [("w1", 1), {"owner": "w1", "epoch": 1}, "w1", 1, object()])
def test_a_malformed_fence_is_invalid_input(key: str, fence: Any) -> None:
    with pytest.raises(InvalidInputError):
        Invoice(account=key).save(fence=fence)
    with pytest.raises(InvalidInputError):
        Invoice.objects.fenced(fence, key=key)


@pytest.mark.django_db
def test_queryset_creates_use_the_querysets_fence(key: str) -> None:
    g = grant(key)
    created = Invoice.objects.fenced(g).create(account=key, status="created")
    got, made = Invoice.objects.fenced(g).get_or_create(account=key, status="got")
    updated, _ = Invoice.objects.fenced(g).update_or_create(pk=created.pk, defaults={"status": "updated"})
    report = Report.objects.unfenced().create(title="unfenced")
    assert made and (created.lease_epoch, got.lease_epoch, updated.lease_epoch) == (g.epoch, g.epoch, g.epoch)
    assert Report.objects.filter(pk=report.pk).exists()
    stale = g
    grant(key)
    with refused(EpochMismatchError):
        Invoice.objects.fenced(stale).create(account=key)
    with refused(EpochMismatchError):
        Invoice.objects.fenced(stale).update_or_create(pk=created.pk, defaults={"status": "stale"})


@pytest.mark.django_db(transaction=True)
def test_async_save_and_delete_take_a_fence(key: str) -> None:
    g = grant(key)

    async def scenario() -> tuple[int | None, bool]:
        invoice = Invoice(account=key)
        await invoice.asave(fence=g)
        epoch = invoice.lease_epoch
        await invoice.adelete(fence=g)
        return epoch, await Invoice.objects.filter(account=key).aexists()

    # async_to_sync, not asyncio.run: the ORM's sync_to_async calls then run in this thread, on the
    # test's connection; under asyncio.run they would run in asgiref's executor thread, whose
    # connection nobody closes (a session left on the test database).
    assert async_to_sync(scenario)() == (g.epoch, False)


# ---- every other writer: raw SQL, psql, forged fences ------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_raw_writers_are_refused_without_a_live_fence(key: str, raw_connect: Any) -> None:
    g = grant(key)
    Invoice(account=key, status="ok").save(fence=g)
    stale = g
    live = grant(key)
    psql = raw_connect()
    for statement in (
        "UPDATE testapp_invoice SET status = 'psql' WHERE account = %s",
        "DELETE FROM testapp_invoice WHERE account = %s",
        "INSERT INTO testapp_invoice (account, status, amount, lease_key, lease_epoch) VALUES (%s, 'x', 0, %s, 1)",
    ):
        params = [key, key] if statement.startswith("INSERT") else [key]
        with pytest.raises(psycopg.Error) as info:
            psql.execute(statement, params)
        assert info.value.sqlstate == "PL004", statement
    # A forged fence (the setting, not the function) is checked like a presented one.
    psql.execute("BEGIN")
    psql.execute("SELECT set_config('pg_lease.fences', %s, true)", [f'{{"{key}": ["w1", {stale.epoch}]}}'])
    with pytest.raises(psycopg.Error) as forged:
        psql.execute(
            "UPDATE testapp_invoice SET status = 'forged', lease_epoch = %s WHERE account = %s", [stale.epoch, key]
        )
    psql.execute("ROLLBACK")
    assert forged.value.sqlstate == "PL003"
    # Presenting the live fence but not recording its epoch in the row is refused too.
    psql.execute("BEGIN")
    psql.execute("SELECT pg_lease_check_fence(%s, 'w1', %s)", [key, live.epoch])
    with pytest.raises(psycopg.Error) as unrecorded:
        psql.execute("UPDATE testapp_invoice SET status = 'x' WHERE account = %s", [key])
    psql.execute("ROLLBACK")
    assert unrecorded.value.sqlstate == "PL003"
    # Django's cursor is just another raw writer.
    with pytest.raises(DatabaseError) as through_django, connection.cursor() as cursor:
        cursor.execute("UPDATE testapp_invoice SET status = 'cursor' WHERE account = %s", [key])
    assert getattr(through_django.value.__cause__, "sqlstate", None) == "PL004"
    assert set(Invoice.objects.filter(account=key).values_list("status", flat=True)) == {"ok"}


@pytest.mark.django_db(transaction=True)
def test_a_fence_presented_earlier_in_a_transaction_is_rechecked_after_lapse(key: str) -> None:
    g = grant(key, ttl=0.5)
    with pytest.raises(LapsedError), transaction.atomic():
        Entry(account=key, writer="a").save(fence=g)
        wait_lapsed(key)
        Entry(account=key, writer="b").save(fence=g)
    assert not Entry.objects.filter(account=key).exists()


@pytest.mark.django_db(transaction=True)
def test_an_opt_out_ends_with_its_write(key: str) -> None:
    g = grant(key)
    with transaction.atomic():
        Invoice(account=key, status="unfenced").save(unfenced=True)
        with pytest.raises(DatabaseError) as info, connection.cursor() as cursor:
            cursor.execute("UPDATE testapp_invoice SET status = 'leak' WHERE account = %s", [key])
        assert getattr(info.value.__cause__, "sqlstate", None) == "PL004"
        transaction.set_rollback(True)
    Invoice(account=key, status="fenced").save(fence=g)
    assert list(Invoice.objects.filter(account=key).values_list("status", flat=True)) == ["fenced"]


@pytest.mark.django_db(transaction=True)
def test_truncate_of_a_fenced_table_is_refused(raw_connect: Any) -> None:
    conn = raw_connect()
    conn.execute("SET pg_lease.allow_truncate = off")  # as on any database but a test one
    with pytest.raises(psycopg.Error) as info:
        conn.execute("TRUNCATE testapp_report")
    assert info.value.sqlstate == "PL004"


@pytest.mark.django_db
def test_proxy_models_share_the_fence(key: str) -> None:
    report_key = Report.lease_key
    assert report_key is not None
    g = grant(report_key)
    ArchivedReport(title="proxied").save(fence=g)
    Lease.objects.release(report_key, "w1", g.epoch)
    with refused(NotOwnerError):
        ArchivedReport.objects.fenced(g).update(title="stale")
    with unfenced_writes():
        assert ArchivedReport.objects.filter(title="proxied").update(title="repaired") == 1


@pytest.mark.django_db(transaction=True)
def test_an_opt_out_ends_with_its_write_with_autocommit_off(key: str) -> None:
    """Review finding: with autocommit off, atomic() commits nothing at its end, so an opt-out that
    ended only inside an enclosing atomic() outlived its write."""
    g = grant(key)
    Invoice(account=key, status="fenced").save(fence=g)
    Lease.objects.release(key, "w1", g.epoch)
    transaction.set_autocommit(False)
    try:
        Invoice(account=f"{key}-other").save(unfenced=True)
        with pytest.raises(DatabaseError) as info, connection.cursor() as cursor:
            cursor.execute("UPDATE testapp_invoice SET status = 'after-release' WHERE account = %s", [key])
        assert getattr(info.value.__cause__, "sqlstate", None) == "PL004"
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert Invoice.objects.get(account=key).status == "fenced"


@pytest.mark.django_db(transaction=True)
def test_a_querysets_opt_out_covers_its_own_save_not_the_saves_its_signal_handlers_make(key: str) -> None:
    """Review finding: .unfenced().create() let a post_save handler's unfenced save of another
    fenced model through; save(unfenced=True) did not. Both now cover only their own write."""
    from django.db.models.signals import post_save

    def handler(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        if created:
            Entry(account=key, writer="handler").save()  # names no fence: must be refused

    post_save.connect(handler, sender=Report)
    try:
        for write in (
            lambda: Report.objects.unfenced().create(title="q"),
            lambda: Report(title="q").save(unfenced=True),
        ):
            with pytest.raises(UnfencedWriteError):
                write()
    finally:
        post_save.disconnect(handler, sender=Report)
    assert not Entry.objects.filter(account=key).exists()
