"""Pruning rows of leases free for long enough, without ever letting an epoch go back.

Rows are deleted only together with a raise of the epoch floor, so a key that comes back starts
above every epoch it had; the database refuses any other delete, whoever sends it.
"""

from __future__ import annotations

import threading
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from pg_lease_django import InvalidInputError, Lease
from tests.helpers import wait_until


def cycle(key: str, owner: str = "w1") -> int:
    """Acquire and release ``key``: it is left free, at the returned (post-release) epoch."""
    grant = Lease.objects.acquire(key, owner, ttl=30)
    assert grant is not None
    Lease.objects.release(key, owner, grant.epoch)
    return Lease.objects.inspect(key).epoch


@pytest.mark.django_db
def test_prune_deletes_only_leases_free_for_long_enough_and_a_returning_key_starts_above_its_past(key: str) -> None:
    free_epoch = cycle(f"{key}-free")
    lapsed = Lease.objects.acquire(f"{key}-lapsed", "w1", ttl=0.05)
    held = Lease.objects.acquire(f"{key}-held", "w1", ttl=30)
    assert lapsed is not None and held is not None
    wait_until(lambda: Lease.objects.inspect(f"{key}-lapsed").status == "lapsed", what="the lapse")
    assert Lease.objects.prune(free_for=3600) == []  # nothing has been free for an hour
    assert Lease.objects.prune(free_for=0, dry_run=True) == sorted([f"{key}-free", f"{key}-lapsed"])
    assert Lease.objects.filter(key__startswith=key).count() == 3, "a dry run deletes nothing"
    assert sorted(Lease.objects.prune(free_for=0)) == sorted([f"{key}-free", f"{key}-lapsed"])
    assert set(Lease.objects.filter(key__startswith=key).values_list("key", flat=True)) == {f"{key}-held"}
    # Gone, but its epoch did not go back: inspect reports the floor, the next grant is above it.
    assert Lease.objects.inspect(f"{key}-free").epoch >= free_epoch
    again = Lease.objects.acquire(f"{key}-free", "w2", ttl=30)
    assert again is not None and again.epoch > free_epoch
    back = Lease.objects.acquire(f"{key}-lapsed", "w2", ttl=30)
    assert back is not None and back.epoch > lapsed.epoch


@pytest.mark.django_db
def test_bad_free_for_is_invalid_input() -> None:
    for bad in (-1, float("nan"), "30d", None):
        with pytest.raises(InvalidInputError):
            Lease.objects.prune(free_for=bad)  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_the_database_refuses_any_other_delete_and_never_lowers_the_floor(key: str, raw_connect: Any) -> None:
    cycle(f"{key}-free")
    assert Lease.objects.acquire(f"{key}-held", "w1", ttl=30) is not None
    superuser = raw_connect()
    for victim in (f"{key}-free", f"{key}-held"):  # above the floor, or held
        with pytest.raises(psycopg.errors.RestrictViolation, match="deleted only when it is not held"):
            superuser.execute("DELETE FROM pg_lease_django_lease WHERE key = %s", [victim])
    superuser.execute("SET pg_lease.allow_truncate = off")  # as on any database but a test one
    with pytest.raises(psycopg.errors.CheckViolation, match="only grows"):
        superuser.execute("UPDATE pg_lease_django_epoch_floor SET floor = floor - 1")
    with pytest.raises(psycopg.errors.CheckViolation, match="never deleted"):
        superuser.execute("DELETE FROM pg_lease_django_epoch_floor")
    # Nor may a lease row be inserted at or below the floor, whoever inserts it.
    superuser.execute("UPDATE pg_lease_django_epoch_floor SET floor = 7")
    try:
        with pytest.raises(psycopg.errors.CheckViolation, match="floor is above it"):
            superuser.execute(
                "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
                "VALUES (%s, 'w1', 7, now(), now() + interval '1 minute')",
                [f"{key}-back"],
            )
        assert Lease.objects.acquire(f"{key}-new", "w1", ttl=30).epoch == 8  # type: ignore[union-attr]
    finally:
        superuser.execute("RESET pg_lease.allow_truncate")  # the test database allows lowering it again
        superuser.execute("UPDATE pg_lease_django_epoch_floor SET floor = 0")
    assert superuser.execute(
        "SELECT has_function_privilege('public', 'pg_lease_prune(interval, boolean)', 'EXECUTE')"
    ).fetchone() == (False,), "pruning is for operators: revoked from PUBLIC"


@pytest.fixture
def floor_reset(raw_connect: Any) -> Any:
    """Put the epoch floor back to 0 after a test that commits prunes: other tests expect a new
    key to start at epoch 1 (a test database may lower the floor; no other may)."""
    yield
    raw_connect().execute("UPDATE pg_lease_django_epoch_floor SET floor = 0")


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.usefixtures("floor_reset")
def test_pruning_while_the_same_keys_are_acquired_never_lets_an_epoch_go_back(key: str) -> None:
    """Two workers cycle the same keys (acquire, release) while a third prunes everything free, in a
    loop; every grant of a key has a higher epoch than every earlier grant of it."""
    keys = [f"{key}-{n}" for n in range(3)]
    grants: dict[str, list[tuple[Any, int]]] = {k: [] for k in keys}
    record = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    pruned: list[str] = []

    def worker(owner: str) -> None:
        try:
            while not stop.is_set():
                for k in keys:
                    grant = Lease.objects.acquire(k, owner, ttl=5)
                    if grant is None:
                        continue
                    with record:
                        grants[k].append((grant.server_time, grant.epoch))
                    Lease.objects.release(k, owner, grant.epoch)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def pruner() -> None:
        try:
            while not stop.is_set():
                pruned.extend(Lease.objects.prune(free_for=0))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(2)] + [threading.Thread(target=pruner)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(pruned) >= 60 and min(len(g) for g in grants.values()) >= 60, timeout=60, what="churn")
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    for k, history in grants.items():
        epochs = [epoch for _, epoch in sorted(history)]
        assert epochs == sorted(set(epochs)), f"{k}: an epoch was granted twice or went back: {epochs}"
    assert len(set(pruned)) == len(keys), "every key was pruned at least once"


@pytest.mark.django_db
def test_prune_command(key: str) -> None:
    cycle(f"{key}-a")
    out = StringIO()
    call_command("leases", "prune", "--free-for", "0s", "--dry-run", stdout=out)
    assert "Dry run: would prune" in out.getvalue() and f"{key}-a" in out.getvalue()
    assert Lease.objects.filter(key=f"{key}-a").exists()
    out = StringIO()
    call_command("leases", "prune", "--free-for", "0", "--json", stdout=out)
    assert f'"{key}-a"' in out.getvalue()
    assert not Lease.objects.filter(key=f"{key}-a").exists()
    out = StringIO()
    call_command("leases", "prune", "--free-for", "30d", stdout=out)
    assert "Pruned 0 lease(s) free for at least 30d." in out.getvalue()
    for bad in ("-1d", "30 days", "1y", "99999d"):
        with pytest.raises(CommandError) as info:
            call_command("leases", "prune", f"--free-for={bad}")
        assert info.value.returncode == 2
