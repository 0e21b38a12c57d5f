"""Advancing every epoch and the epoch floor by N: the remedy for an asynchronous failover.

After ``pg_lease_advance_epochs(N)`` every grant, of any key (one with a row, or one without: never
acquired or pruned), is above every epoch the database had before plus N. Holders keep their lease
until its expiry, at an epoch nobody was granted: their renewals, releases and fenced writes are
refused as ``epoch_mismatch``. A bad N, or one that would pass the limit, changes nothing. The
failover itself is tests/cluster/test_failover.py. Most tests here run in a transaction rolled back at
their end, so the floor and the other tests' epochs are left as they were.
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from devkit.testapp.models import Invoice
from pg_lease_django import EpochMismatchError, Grant, InvalidInputError, Lease, hold
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.validation import MAX_ADVANCE
from tests.helpers import free, held, lapsed, refused, wait_until


def floor() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT floor FROM pg_lease_django_epoch_floor")
        return int(cursor.fetchone()[0])


def epochs() -> dict[str, int]:
    return dict(Lease.objects.values_list("key", "epoch"))


def leases(command: str, *args: str) -> tuple[str, Any]:
    """``manage.py leases <command> ...``: its output, and its exit code (0 when it returned)."""
    out = StringIO()
    try:
        call_command("leases", command, *args, stdout=out)
    except CommandError as exc:
        return str(exc), exc.returncode
    return out.getvalue(), 0


@pytest.mark.django_db
def test_advance_raises_every_epoch_and_the_floor_and_fences_the_holders(key: str) -> None:
    holder = held(f"{key}-held", "w1")
    gone = lapsed(f"{key}-lapsed", "w2")
    freed = free(f"{key}-free")
    invoice = Invoice(account=f"{key}-held")
    grant = Lease.objects.inspect(f"{key}-held")
    assert grant.epoch == holder and grant.expires_at is not None
    fence = Grant(grant.key, "w1", holder, grant.expires_at, grant.server_time)
    invoice.save(fence=fence)
    before, floor_before = epochs(), floor()

    done = Lease.objects.advance_epochs(by=1000)

    assert (done.by, done.dry_run) == (1000, False)
    assert done.leases == len(before) and done.held >= 1
    assert done.epoch_floor == floor() == floor_before + 1000
    assert epochs() == {k: e + 1000 for k, e in before.items()}
    assert done.max_epoch == max([*before.values(), floor_before]) + 1000
    # The holder keeps its lease until its expiry (nobody else gets it), at an epoch nobody was granted.
    state = Lease.objects.inspect(f"{key}-held")
    assert (state.status, state.owner, state.epoch) == ("held", "w1", holder + 1000)
    assert Lease.objects.acquire(f"{key}-held", "rival", ttl=30) is None
    with pytest.raises(EpochMismatchError):
        Lease.objects.renew(f"{key}-held", "w1", holder, ttl=30)
    with pytest.raises(EpochMismatchError):
        Lease.objects.release(f"{key}-held", "w1", holder)
    invoice.status = "stale"
    with refused(EpochMismatchError):
        invoice.save(fence=fence)
    # It re-acquires (a self-takeover) to go on; its fenced writes move forward.
    again = Lease.objects.acquire(f"{key}-held", "w1", ttl=30)
    assert again is not None and again.epoch == holder + 1001
    invoice.status = "fresh"
    invoice.save(fence=again)
    assert Invoice.objects.filter(pk=invoice.pk).values_list("status", "lease_epoch").get() == ("fresh", again.epoch)
    # Every later grant is above the old epochs + N: lapsed and free keys, a new key (starts above the floor).
    taken = Lease.objects.acquire(f"{key}-lapsed", "w3", ttl=30)
    assert taken is not None and taken.epoch == gone + 1001
    back = Lease.objects.acquire(f"{key}-free", "w3", ttl=30)
    assert back is not None and back.epoch == freed + 1001
    new = Lease.objects.acquire(f"{key}-new", "w3", ttl=30)
    assert new is not None and new.epoch == floor_before + 1001
    assert Lease.objects.inspect(f"{key}-never").epoch == floor_before + 1000


@pytest.mark.django_db
def test_a_pruned_key_comes_back_above_its_past_plus_n(key: str) -> None:
    freed = free(f"{key}-pruned")
    assert f"{key}-pruned" in Lease.objects.prune(free_for=0)
    assert Lease.objects.inspect(f"{key}-pruned").epoch >= freed
    Lease.objects.advance_epochs(by=50)
    back = Lease.objects.acquire(f"{key}-pruned", "w1", ttl=30)
    assert back is not None and back.epoch > freed + 50


@pytest.mark.django_db
def test_dry_run_changes_nothing(key: str) -> None:
    held(key)
    before, floor_before = epochs(), floor()
    done = Lease.objects.advance_epochs(by=7, dry_run=True)
    assert done.dry_run and done.leases == len(before) and done.epoch_floor == floor_before + 7
    assert (epochs(), floor()) == (before, floor_before)


@pytest.mark.django_db
def test_bad_n_is_refused_and_changes_nothing(key: str) -> None:
    held(key)
    before, floor_before = epochs(), floor()
    for bad in (0, -1, MAX_ADVANCE + 1, 1.5, "10", True, None):
        with pytest.raises(InvalidInputError):
            Lease.objects.advance_epochs(by=bad)  # type: ignore[arg-type]
    # Within bounds, but it would raise an epoch (at least 1 here) past the limit: a typed error.
    with pytest.raises(InvalidInputError, match=r"epoch_overflow.*nothing was changed"), transaction.atomic():
        Lease.objects.advance_epochs(by=MAX_ADVANCE)
    assert (epochs(), floor()) == (before, floor_before)
    # The SQL function checks the same, whoever calls it.
    for bad_sql, sqlstate in ((0, "22023"), (MAX_ADVANCE + 1, "22023"), (MAX_ADVANCE, "22003")):
        with pytest.raises(Exception) as info, transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT * FROM public.pg_lease_advance_epochs(%s::bigint)", [bad_sql])
        assert getattr(info.value.__cause__, "sqlstate", None) == sqlstate, info.value
    assert (epochs(), floor()) == (before, floor_before)


@pytest.mark.django_db
def test_the_tables_guards_accept_it_and_public_cannot_run_it(key: str) -> None:
    """The lease table's guard (epochs only grow, owner kept) and the floor's (only grows) accept the advance;
    a role without the grant is refused (revoked from PUBLIC)."""
    held(key)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT has_function_privilege('public', 'public.pg_lease_advance_epochs(bigint, boolean)', 'EXECUTE')"
        )
        assert cursor.fetchone() == (False,)
        cursor.execute("CREATE ROLE pgl_advance_stranger NOLOGIN")  # rolled back with the test
        with pytest.raises(Exception) as info, transaction.atomic():
            cursor.execute("SET LOCAL ROLE pgl_advance_stranger")
            cursor.execute("SELECT * FROM public.pg_lease_advance_epochs(5::bigint)")
        assert getattr(info.value.__cause__, "sqlstate", None) == "42501", info.value
        cursor.execute("SELECT current_user = session_user")
        assert cursor.fetchone() == (True,)
    assert Lease.objects.advance_epochs(by=3).leases >= 1


@pytest.mark.django_db
def test_command_output_and_exit_codes(key: str) -> None:
    held(key)
    floor_before, top = floor(), max([*epochs().values(), floor()])
    out, code = leases("advance-epochs", "--by", "10", "--dry-run", "--json")
    assert code == 0
    document = json.loads(out)
    assert document["dry_run"] is True and document["by"] == 10
    assert (document["epoch_floor"], document["max_epoch"]) == (floor_before + 10, top + 10)
    assert set(document) == {"dry_run", "by", "leases", "held", "epoch_floor", "max_epoch", "server_time"}
    assert floor() == floor_before
    out, code = leases("advance-epochs", "--by", "10")
    assert code == 0 and out.startswith("Advanced the epochs of") and f"epoch floor {floor_before + 10}" in out
    assert floor() == floor_before + 10
    out, code = leases("advance-epochs", "--by", "5", "--dry-run")
    assert code == 0 and out.startswith("Dry run: would advance")
    for bad in ("0", "-3", "x", str(MAX_ADVANCE + 1)):
        out, code = leases("advance-epochs", "--by", bad)
        assert code == ExitCode.USAGE, (bad, out)
    with pytest.raises(CommandError) as info, transaction.atomic():  # a savepoint: the refusal aborts it
        call_command("leases", "advance-epochs", "--by", str(MAX_ADVANCE), stdout=StringIO())
    assert info.value.returncode == ExitCode.USAGE and "epoch_overflow" in str(info.value), info.value
    assert floor() == floor_before + 10
    with pytest.raises(CommandError):  # --by is required
        call_command("leases", "advance-epochs", stdout=StringIO(), stderr=StringIO())


@pytest.mark.django_db(transaction=True)
def test_calls_keep_one_notice_handler_per_connection() -> None:
    """The check for an unconfirmed commit (sql.confirmation.confirmed_commit) keeps one handler on the
    connection however many calls it makes (adding and removing one per call cost more than the
    call's own Python); a new connection gets its own (outside ``atomic()``; inside, the
    transaction's watch goes with it: tests/cluster/test_bounded_exit.py)."""
    for _ in range(3):
        Lease.objects.inspect("no-such-key-advance")
    raw = connection.connection
    assert raw is not None and len(raw._notice_handlers) == 1
    connection.close()
    Lease.objects.inspect("no-such-key-advance")
    assert connection.connection is not raw and len(connection.connection._notice_handlers) == 1


@pytest.fixture
def floor_reset(raw_connect: Any) -> Any:
    """Put the epoch floor back after a test that commits an advance: other tests expect a new key to
    start at epoch 1 (a test database may lower the floor; no other may)."""
    yield
    raw_connect().execute("UPDATE pg_lease_django_epoch_floor SET floor = 0")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("floor_reset")
def test_a_hold_learns_the_loss_at_its_next_renewal(key: str) -> None:
    """A ``hold()`` whose epoch was advanced under it: its next renewal is refused (epoch_mismatch) and
    it reports the loss; it never renews the advanced epoch as its own."""
    with hold(key, ttl=1.5, owner="holder") as lease:
        epoch = lease.epoch
        Lease.objects.advance_epochs(by=10)
        wait_until(lambda: lease.lost, timeout=10, what="the hold to report the loss")
        assert isinstance(lease.error, EpochMismatchError), lease.error
    state = Lease.objects.inspect(key)
    assert (state.owner, state.epoch) == ("holder", epoch + 10)  # left to lapse: the hold did not release it


def _pg_tool(name: str, server_version: int) -> str | None:
    """A ``pg_dump``/``pg_restore`` at least as new as the server (pg_dump refuses older servers only)."""
    import shutil
    import subprocess

    from devkit.pgcluster import find_bindir

    bindir = find_bindir()
    candidates = [str(bindir / name)] if bindir is not None else []
    candidates += [found] if (found := shutil.which(name)) else []
    for tool in candidates:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True)
        major = int(out.stdout.split()[-1].split(".")[0]) if out.returncode == 0 else 0
        if major * 10000 >= server_version // 10000 * 10000:
            return tool
    return None


@pytest.mark.django_db(transaction=True)
def test_a_restored_backup_grants_acknowledged_epochs_again_until_the_epochs_advance(key: str) -> None:
    """Issue 27, finding 10: restoring a dump taken before a grant makes the restored database
    grant that epoch again (to another owner); `advance-epochs` on the restored database, before
    anyone reconnects, fences it and puts every later grant above every acknowledged one."""
    import subprocess
    import uuid

    import psycopg

    from tests.helpers import conninfo

    admin = psycopg.connect(conninfo(), autocommit=True)
    pg_dump = _pg_tool("pg_dump", admin.info.server_version)
    pg_restore = _pg_tool("pg_restore", admin.info.server_version)
    if pg_dump is None or pg_restore is None:
        pytest.skip("no pg_dump/pg_restore as new as the server")
    restored_name = f"pgl_restored_{uuid.uuid4().hex[:8]}"
    try:
        before = Lease.objects.acquire(key, "alice", ttl=30)
        assert before is not None
        Lease.objects.release(key, "alice", before.epoch)
        dump = subprocess.run([pg_dump, "-Fc", "-d", conninfo()], capture_output=True, check=True).stdout
        bob = Lease.objects.acquire(key, "bob", ttl=30)  # acknowledged, then the database is "lost"
        assert bob is not None
        admin.execute(f'CREATE DATABASE "{restored_name}"')
        target = psycopg.conninfo.make_conninfo(conninfo(), dbname=restored_name)
        subprocess.run([pg_restore, "--exit-on-error", "-d", target], input=dump, capture_output=True, check=True)
        with psycopg.connect(target, autocommit=True) as restored:
            acquire = "SELECT granted, epoch FROM pg_lease_acquire(%s::text, %s::text, '30 seconds'::interval)"
            assert restored.execute(acquire, [key, "dave"]).fetchone() == (True, bob.epoch)  # the same epoch again
            restored.execute("SELECT * FROM pg_lease_advance_epochs(1000000::bigint, false)")
            renewed = restored.execute(
                "SELECT outcome FROM pg_lease_renew(%s::text, 'dave'::text, %s::bigint, '30 seconds'::interval)",
                [key, bob.epoch],
            ).fetchone()
            assert renewed == ("epoch_mismatch",)  # dave's reused epoch is fenced
            restored.execute("SELECT * FROM pg_lease_force_release(%s::text, NULL::bigint)", [key])
            row = restored.execute(acquire, [key, "eve"]).fetchone()
            assert row is not None and row[0] and row[1] > 1000000 > bob.epoch
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{restored_name}" WITH (FORCE)')
        admin.close()
