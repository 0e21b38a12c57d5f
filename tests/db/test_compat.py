"""Fenced writes inside django-pghistory's ``context()`` and django-pgtrigger's ``ignore()``.

Both libraries reach their triggers through an execute wrapper that prefixes every statement
Django sends with ``SELECT set_config(...);``. 0.1.0 rewrote Django's INSERT text and broke there;
fencing now rides in the ORM's expressions and in the database's triggers, so the prefixed
statements must present, check and write exactly as the plain ones do. Each test also asserts
that the statements really went through the wrappers (the prefix in the SQL that was sent).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pghistory
import pgtrigger
import psycopg
import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from pg_lease_django import (
    EpochMismatchError,
    Grant,
    LapsedError,
    Lease,
    LeaseError,
    NotOwnerError,
    unfenced_writes,
)
from tests.compatapp.models import VAULT_KEY, Ledger, Vault
from tests.helpers import refused, wait_until

pytestmark = pytest.mark.django_db

#: Vault's own pgtrigger trigger: it refuses every DELETE unless ignored.
PROTECT = "compatapp.Vault:protect_deletes"
#: The setting each library's prefix sets (the first one, for pghistory).
HISTORY = "pghistory.context_id"
IGNORE = "pgtrigger.ignore"

_PREFIX = re.compile(r"SELECT set_config\('(?P<name>[\w.]+)'[^;]*; ")
_WRITE = re.compile(r'(INSERT INTO|UPDATE|DELETE FROM) "?compatapp_(ledger|vault)\b')


def grant(key: str, owner: str = "w1", ttl: float = 30) -> Grant:
    acquired = Lease.objects.acquire(key, owner, ttl=ttl)
    assert acquired is not None, f"{owner} could not acquire {key}"
    return acquired


def stale_grant(key: str, how: str) -> Grant:
    """A grant of ``key`` that no longer holds, refused with the error ``how`` names."""
    if how == "epoch":  # the same owner acquired again: the old incarnation is fenced off
        stale = grant(key)
        grant(key)
    elif how == "owner":  # lapsed, then taken over by another owner
        stale = grant(key, "old", ttl=0.001)
        wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")
        grant(key, "new")
    else:  # lapsed, nobody took over
        stale = grant(key, ttl=0.001)
        wait_until(lambda: Lease.objects.inspect(key).status == "lapsed", what=f"{key} to lapse")
    return stale


STALE: dict[str, type[LeaseError]] = {"epoch": EpochMismatchError, "owner": NotOwnerError, "lapsed": LapsedError}


def writes(queries: CaptureQueriesContext) -> list[tuple[set[str], str]]:
    """The statements sent to write the compat tables: the settings their prefix set, and the write."""
    found = []
    for query in queries.captured_queries:
        statement, names, position = query["sql"], set(), 0
        while match := _PREFIX.match(statement, position):
            names.add(match["name"])
            position = match.end()
        if _WRITE.match(statement, position):
            found.append((names, statement[position:]))
    return found


_HISTORY_SQL = """
    SELECT e.pgh_label, e.balance, e.lease_epoch, c.metadata->>'user', c.id::text
    FROM compatapp_ledgerevent e LEFT JOIN pghistory_context c ON c.id = e.pgh_context_id
    WHERE e.account = %s ORDER BY e.pgh_id"""


def history(account: str, other: psycopg.Connection[Any] | None = None) -> list[tuple[Any, ...]]:
    """pghistory's events for ``account``: (label, balance, lease_epoch, context user, context id)."""
    if other is not None:
        return other.execute(_HISTORY_SQL, [account]).fetchall()
    with connection.cursor() as cursor:
        cursor.execute(_HISTORY_SQL, [account])
        return list(cursor.fetchall())


def stored(ledger: Ledger) -> tuple[int, int | None]:
    row = Ledger.objects.filter(pk=ledger.pk).values_list("balance", "lease_epoch").get()
    return row[0], row[1]


@contextmanager
def refused_by_the_triggers() -> Iterator[None]:
    """Expect a raw statement (no fence of its own) refused by the fence triggers themselves.

    Which refusal depends on what the test's transaction presented before: no fence for the key
    (PL004), or a fence a fixture presented and then released (PL001).
    """
    with pytest.raises(DatabaseError) as info, transaction.atomic():
        yield
    assert getattr(info.value.__cause__, "sqlstate", None) in {"PL001", "PL004"}, info.value


@contextmanager
def within(which: str) -> Iterator[set[str]]:
    """Enter ``pghistory.context(user="x")``, ``pgtrigger.ignore(PROTECT)`` or both; yield the
    settings their wrappers prefix every statement with."""
    with ExitStack() as stack:
        prefixes = set()
        if which in ("pghistory", "both"):
            stack.enter_context(pghistory.context(user="x"))
            prefixes.add(HISTORY)
        if which in ("pgtrigger", "both"):
            stack.enter_context(pgtrigger.ignore(PROTECT))
            prefixes.add(IGNORE)
        yield prefixes


@pytest.fixture
def ledger(key: str) -> Ledger:
    """A ledger row saved under a first grant of ``key`` (epoch 1), which is then released."""
    first = grant(key, "setup")
    created = Ledger(account=key, balance=1)
    created.save(fence=first)
    Lease.objects.release(key, "setup", first.epoch)
    return created


@pytest.fixture
def vault() -> Vault:
    """A vault row saved under a grant of the class-level key, which is then released."""
    first = grant(VAULT_KEY, "setup")
    created = Vault(label="gold")
    created.save(fence=first)
    Lease.objects.release(first.key, "setup", first.epoch)
    return created


# ---- pghistory.context() ----------------------------------------------------------------------


def test_fenced_writes_inside_pghistory_context_are_recorded_with_it(key: str) -> None:
    g = grant(key)
    with pghistory.context(user="x") as context, CaptureQueriesContext(connection) as queries:
        ledger = Ledger(account=key)
        ledger.save(fence=g)  # INSERT
        ledger.balance = 5
        ledger.save(fence=g)  # UPDATE
        assert Ledger.objects.fenced(g).filter(pk=ledger.pk).update(balance=7) == 1
        [bulk] = Ledger.objects.fenced(g).bulk_create([Ledger(account=key, balance=2)])
        created = Ledger.objects.fenced(g).create(account=key, balance=3)
        assert Ledger.objects.fenced(g).filter(pk=ledger.pk).delete() == (1, {"compatapp.Ledger": 1})
        created.delete(fence=g)
    sent = writes(queries)
    assert all(names == {HISTORY} for names, _ in sent), sent
    # The fence rides in the write itself, except where Django writes in several statements
    # (bulk_create, instance delete): there a first SELECT of the same transaction presents it.
    assert [(statement.split()[0], "pg_lease_check_fence" in statement) for _, statement in sent] == [
        ("INSERT", True),
        ("UPDATE", True),
        ("UPDATE", True),
        ("INSERT", False),
        ("INSERT", True),
        ("DELETE", True),
        ("DELETE", False),
    ]
    assert stored(bulk) == (2, g.epoch)
    context_id = str(context.id)
    assert history(key) == [
        ("insert", 0, g.epoch, "x", context_id),
        ("update", 5, g.epoch, "x", context_id),
        ("update", 7, g.epoch, "x", context_id),
        ("insert", 2, g.epoch, "x", context_id),
        ("insert", 3, g.epoch, "x", context_id),
        ("delete", 7, g.epoch, "x", context_id),
        ("delete", 3, g.epoch, "x", context_id),
    ]


def test_the_fence_rides_in_the_prefixed_statement_itself(key: str) -> None:
    """save() presents its fence in the very INSERT/UPDATE the wrapper prefixed: one statement each."""
    g = grant(key)
    with pghistory.context(user="x"), CaptureQueriesContext(connection) as queries:
        ledger = Ledger(account=key)
        ledger.save(fence=g)
        ledger.balance = 1
        ledger.save(fence=g)
    assert len(queries.captured_queries) == 2
    assert [(names, "pg_lease_check_fence" in statement) for names, statement in writes(queries)] == [
        ({HISTORY}, True),
        ({HISTORY}, True),
    ]


# ---- pgtrigger.ignore() -----------------------------------------------------------------------


def test_fenced_writes_inside_pgtrigger_ignore(vault: Vault) -> None:
    g = grant(VAULT_KEY)
    with pytest.raises(DatabaseError, match="Cannot delete rows"), transaction.atomic():
        vault.delete(fence=g)  # the fence holds; Vault's own trigger refuses the DELETE
    with pgtrigger.ignore(PROTECT), CaptureQueriesContext(connection) as queries:
        spare = Vault(label="silver")
        spare.save(fence=g)  # INSERT
        spare.label = "bronze"
        spare.save(fence=g)  # UPDATE
        assert Vault.objects.fenced(g).filter(pk=vault.pk).update(label="platinum") == 1
        assert Vault.objects.fenced(g).filter(pk=vault.pk).delete() == (1, {"compatapp.Vault": 1})
        spare.delete(fence=g)
    sent = writes(queries)
    assert [statement.split()[0] for _, statement in sent] == ["INSERT", "UPDATE", "UPDATE", "DELETE", "DELETE"]
    for names, statement in sent:
        assert names == {IGNORE}, statement
    assert not Vault.objects.exists()
    with pytest.raises(DatabaseError, match="Cannot delete rows"), transaction.atomic():
        Vault(label="again").save(fence=g)
        Vault.objects.fenced(g).delete()  # the trigger is back once the block ends


def test_ignoring_every_pgtrigger_trigger_does_not_switch_the_fence_off(ledger: Ledger, key: str) -> None:
    """The fence triggers are not pgtrigger's: ``pgtrigger.ignore()`` (all of them) leaves them on."""
    stale = grant(key)
    live = grant(key)
    before = history(key)
    with pgtrigger.ignore(), CaptureQueriesContext(connection) as queries:
        ledger.balance = 9
        with refused(EpochMismatchError):
            ledger.save(fence=stale)
        with refused_by_the_triggers(), connection.cursor() as cursor:
            cursor.execute("UPDATE compatapp_ledger SET balance = 0 WHERE id = %s", [ledger.pk])
        ledger.save(fence=live)
    assert all(names == {IGNORE} for names, _ in writes(queries))
    assert stored(ledger) == (9, live.epoch)
    assert history(key) == before, "pghistory's triggers are pgtrigger triggers: ignored too"


# ---- both, and what they must not change -------------------------------------------------------


@pytest.mark.parametrize("how", list(STALE))
@pytest.mark.parametrize("which", ["pghistory", "pgtrigger", "both"])
def test_a_stale_grant_is_refused_inside_the_contexts(
    ledger: Ledger, vault: Vault, key: str, which: str, how: str
) -> None:
    error = STALE[how]
    stale, stale_vault = stale_grant(key, how), stale_grant(VAULT_KEY, how)
    before = history(key)
    with within(which) as prefixes, CaptureQueriesContext(connection) as queries:
        ledger.balance = 99
        with refused(error):
            ledger.save(fence=stale)
        with refused(error):
            Ledger(account=key).save(fence=stale)
        with refused(error):
            Ledger.objects.fenced(stale).filter(pk=ledger.pk).update(balance=99)
        with refused(error):
            Ledger.objects.fenced(stale).filter(pk=ledger.pk).delete()
        with refused(error):
            ledger.delete(fence=stale)
        with refused(error):
            Vault.objects.fenced(stale_vault).filter(pk=vault.pk).update(label="stolen")
        with refused(error):  # ignoring Vault's own trigger does not ignore the fence
            vault.delete(fence=stale_vault)
        with refused_by_the_triggers(), connection.cursor() as cursor:
            cursor.execute("UPDATE compatapp_ledger SET balance = 0 WHERE id = %s", [ledger.pk])
    sent = writes(queries)
    # Instance deletes were refused by their presenting SELECT; every write sent was prefixed.
    assert [statement.split()[0] for _, statement in sent] == [
        "UPDATE",
        "INSERT",
        "UPDATE",
        "DELETE",
        "UPDATE",
        "UPDATE",
    ]
    for names, statement in sent:
        assert names == prefixes, statement
    assert stored(ledger) == (1, 1)
    assert Vault.objects.filter(pk=vault.pk, label="gold").exists()
    assert history(key) == before


def test_unfenced_opt_outs_work_inside_both_contexts(ledger: Ledger, vault: Vault, key: str) -> None:
    with within("both") as prefixes, CaptureQueriesContext(connection) as queries:
        ledger.balance = 2
        ledger.save(unfenced=True)
        assert Ledger.objects.unfenced().filter(pk=ledger.pk).update(balance=3) == 1
        with unfenced_writes():
            Ledger(account=key, balance=4).save()
        assert Vault.objects.unfenced().filter(pk=vault.pk).delete() == (1, {"compatapp.Vault": 1})
        # Each opt-out ended with its block: the test's transaction is fenced again.
        with refused_by_the_triggers(), connection.cursor() as cursor:
            cursor.execute("UPDATE compatapp_ledger SET balance = 0 WHERE id = %s", [ledger.pk])
    sent = writes(queries)
    assert len(sent) == 5
    for names, statement in sent:
        assert names == prefixes, statement
        assert "pg_lease_check_fence" not in statement
    assert stored(ledger) == (3, 1), "an unfenced write keeps the epoch of the last fenced one"
    assert not Vault.objects.exists()
    assert [(label, balance, epoch, user) for label, balance, epoch, user, _ in history(key)] == [
        ("insert", 1, 1, None),  # the fixture's, outside any context
        ("update", 2, 1, "x"),
        ("update", 3, 1, "x"),
        ("insert", 4, None, "x"),
    ]


# ---- committed for real ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_writes_inside_both_contexts_commit_with_their_history(
    key: str, raw_connect: Callable[..., psycopg.Connection[Any]]
) -> None:
    """In autocommit each prefixed statement is its own transaction: the transaction-local settings
    (pghistory's context, pgtrigger's ignore, the presented fence) must all land in it."""
    other = raw_connect()
    g = grant(key)
    v = grant(VAULT_KEY)
    with (
        pghistory.context(user="x") as context,
        pgtrigger.ignore(PROTECT),
        CaptureQueriesContext(connection) as queries,
    ):
        ledger = Ledger(account=key)
        ledger.save(fence=g)
        ledger.balance = 2
        ledger.save(fence=g)
        assert Ledger.objects.fenced(g).filter(pk=ledger.pk).update(balance=3) == 1
        grant(key)  # the same owner restarts: ``g`` is stale now
        with pytest.raises(EpochMismatchError):
            ledger.save(fence=g)  # refused in autocommit; the next statement is prefixed again
        vault = Vault(label="gold")
        vault.save(fence=v)
        vault.delete(fence=v)
    sent = writes(queries)
    assert len(sent) == 6
    for names, statement in sent:
        assert names == {HISTORY, IGNORE}, statement
    context_id = str(context.id)
    assert history(key, other) == [
        ("insert", 0, g.epoch, "x", context_id),
        ("update", 2, g.epoch, "x", context_id),
        ("update", 3, g.epoch, "x", context_id),
    ]
    assert other.execute("SELECT balance, lease_epoch FROM compatapp_ledger WHERE id = %s", [ledger.pk]).fetchone() == (
        3,
        g.epoch,
    )
    assert other.execute("SELECT count(*) FROM compatapp_vault").fetchone() == (0,)


@pytest.mark.django_db(transaction=True)
def test_flush_empties_fenced_tracked_and_protected_tables(key: str) -> None:
    """What transactional tests run between tests: TRUNCATE of every table, triggers and all."""
    with pghistory.context(user="x"):
        Ledger(account=key).save(fence=grant(key))
        Vault(label="gold").save(fence=grant(VAULT_KEY))
    call_command("flush", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        for table in ("compatapp_ledger", "compatapp_ledgerevent", "compatapp_vault", "pghistory_context"):
            cursor.execute(f"SELECT count(*) FROM {table}")
            assert cursor.fetchone() == (0,), table
