"""Tenants apart for real (issue 42), on a real server with real roles.

Each tenant is a NOLOGIN group role with a login member, as docs/security.md's multi-tenant set-up
makes them; an operator declared for every key ("*"); a role granted nothing. Every attack of the
issue is made as that seat would make it, through raw SQL as much as through Django: a login role in
a scoped group, a role with no scope, an opt-out minted for another role or passed on with a grant
option, replica mode from a parameter grant, a pg_read_all_data member forging an opt-out, a row
planted under another tenant's account, a table filled, waiters flooded with notifications, and bad
input that used to meet the scope first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from psycopg import sql as pgsql

from devkit.testapp.models import Invoice
from pg_lease_django import InvalidInputError, Lease, QuotaExceededError, UnfencedWriteError, conf
from pg_lease_django.provisioning import history, privileges
from pg_lease_django.wait.plan import WAKE_BURST, WAKE_RATE
from tests.helpers import (
    PUBLIC_PARAMETER,
    Background,
    Tenants,
    conninfo,
    fails_with,
    refused,
    wait_until,
    wait_until_blocked,
)

# Cluster-wide roles: tests that make a role a bypass (pg_read_all_data, a parameter grant) and tests
# that expect check W008 to be silent run one after another, on one worker.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.xdist_group("cluster-roles")]

ACQUIRE = "SELECT granted, epoch FROM public.pg_lease_acquire(%s::text, %s::text, %s::interval)"
RELEASE = "SELECT outcome FROM public.pg_lease_release(%s::text, %s::text, %s::bigint)"
INSPECT = "SELECT status, owner, epoch FROM public.pg_lease_inspect(%s::text)"
FENCE = "(SELECT public.pg_lease_check_fence(%s::text, %s::text, %s::bigint))"
INSERT_FENCED = (
    "INSERT INTO testapp_invoice (account, status, amount, lease_key, lease_epoch) "
    f"VALUES (%s, 'draft', 0, %s, {FENCE}) RETURNING id"
)


def until_blocked(
    tenants: Tenants, conn: psycopg.Connection[Any], call: Callable[[], Any]
) -> tuple[threading.Thread, list[Any]]:
    """``call`` (a statement on ``conn``) on a thread, returned once ``conn``'s backend waits on a lock:
    the thread, and a list that gets the call's result or the SQLSTATE it failed with."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except psycopg.Error as exc:
            outcome.append(exc.sqlstate)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until_blocked(tenants.admin, conn.info.backend_pid)
    return thread, outcome


def invoice(conn: psycopg.Connection[Any], account: str, owner: str, epoch: int) -> int:
    """A fenced invoice written as a raw-SQL writer: present the fence, record its epoch."""
    with conn.transaction():
        row = conn.execute(INSERT_FENCED, [account, account, account, owner, epoch]).fetchone()
    assert row is not None
    return int(row[0])


def amount(admin: psycopg.Connection[Any], invoice_id: int) -> Any:
    row = admin.execute("SELECT amount, lease_key, lease_epoch FROM testapp_invoice WHERE id = %s", [invoice_id])
    return row.fetchone()


# ---- 1. key scopes follow role membership, and fail closed ----------------------------------------


def test_a_login_member_of_a_scoped_group_role_is_held_to_the_groups_scope(tenants: Tenants) -> None:
    """Finding 1: the scope was looked up by the login role's name; a login member of a group scoped
    to c/ had no scope at all, read A's holder and epoch, wrote A's fenced rows with that fence,
    released A's lease and took the key."""
    a, c = tenants.connect("a_login"), tenants.connect("c_login")
    a_key = tenants.prefix("a") + "inv"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    invoice_id = invoice(a, a_key, "a1", 1)
    for statement, params in (
        (INSPECT, [a_key]),
        (RELEASE, [a_key, "a1", 1]),
        (ACQUIRE, [a_key, "c1", "60 seconds"]),
        ("SELECT public.pg_lease_check_fence(%s::text, %s::text, %s::bigint)", [a_key, "a1", 1]),
        (f"UPDATE testapp_invoice SET amount = 5, lease_epoch = {FENCE} WHERE id = %s", [a_key, "a1", 1, invoice_id]),
    ):
        with fails_with("42501"):
            c.execute(statement, params)
    with fails_with("42501"), c.transaction():  # A's fence forged in the setting: the trigger's scope check
        c.execute("SELECT set_config('pg_lease.fences', %s, true)", [f'{{"{a_key}": ["a1", 1]}}'])
        c.execute("UPDATE testapp_invoice SET amount = 5, lease_epoch = 1 WHERE id = %s", [invoice_id])
    assert amount(tenants.admin, invoice_id) == (0, a_key, 1)
    assert a.execute(INSPECT, [a_key]).fetchone() == ("held", "a1", 1)
    # C works in its own scope, which it has through its group; the operator spans every key.
    assert c.execute(ACQUIRE, [tenants.prefix("c") + "x", "c1", "60 seconds"]).fetchone() == (True, 1)
    assert c.execute("SELECT public.pg_lease_session_scope()").fetchone() == ([tenants.prefix("c")],)
    ops = tenants.connect("ops")
    assert ops.execute(INSPECT, [a_key]).fetchone() == ("held", "a1", 1)
    assert ops.execute("SELECT public.pg_lease_session_scope()").fetchone() == (None,)
    # A membership granted now counts at once (no migrate): C's login joins A's group.
    tenants.create("GRANT {} TO {}", "a", "c_login")
    assert c.execute(INSPECT, [a_key]).fetchone() == ("held", "a1", 1)
    tenants.create("REVOKE {} FROM {}", "a", "c_login")
    with fails_with("42501"):
        c.execute(INSPECT, [a_key])
    # The declaration is silent: the login members hold their groups' grants and scopes.
    assert tenants.findings() == []


def test_a_scope_change_reaches_a_session_whose_plans_inlined_the_old_scope(tenants: Tenants) -> None:
    """The scope is an SQL predicate inlined into each lease function's cached plans (a constant
    `true` when no scope is configured). Changing the scope table replaces it, and every session's
    plans that inlined it are made again before their next call: no session keeps an old scope, in
    either direction, whether it had no scope at all or a narrower one."""
    a = tenants.connect("a_login")
    elsewhere = tenants.prefix("b") + "x"
    with override_settings(PG_LEASE_KEY_SCOPES={}):
        privileges.sync_key_scopes()
        for _ in range(3):  # plans cached with the scope inlined as `true`
            assert a.execute(INSPECT, [elsewhere]).fetchone() == ("free", None, 0)
    privileges.sync_key_scopes()  # the tenants' scopes again (the fixture's settings)
    for statement, params in ((INSPECT, [elsewhere]), (ACQUIRE, [elsewhere, "a1", "60 seconds"])):
        with fails_with("42501"):
            a.execute(statement, params)
    mine = tenants.prefix("a") + "x"
    assert a.execute(ACQUIRE, [mine, "a1", "60 seconds"]).fetchone() == (True, 1)
    widened = {**tenants.settings["PG_LEASE_KEY_SCOPES"], tenants.role("a"): [tenants.prefix("a"), tenants.prefix("b")]}
    with override_settings(PG_LEASE_KEY_SCOPES=widened):
        privileges.sync_key_scopes()
        assert a.execute(INSPECT, [elsewhere]).fetchone() == ("free", None, 0)
    privileges.sync_key_scopes()
    with fails_with("42501"):
        a.execute(INSPECT, [elsewhere])
    assert a.execute(RELEASE, [mine, "a1", 1]).fetchone() == ("ok",)


SCOPE_ROW_ADD = "INSERT INTO public.pg_lease_django_key_scope (role, prefix) VALUES (%s, %s)"
SCOPE_ROW_DELETE = "DELETE FROM public.pg_lease_django_key_scope WHERE role = %s AND prefix = %s"


def _a_widened_to_b(tenants: Tenants) -> str:
    """Tenant A's scope widened to B's prefix too (as a deploy would make it); B's key A may now use."""
    tenants.admin.execute(SCOPE_ROW_ADD, [tenants.role("a"), tenants.prefix("b")])
    elsewhere = tenants.prefix("b") + "x"
    assert tenants.connect("a_login").execute(INSPECT, [elsewhere]).fetchone() == ("free", None, 0)
    return elsewhere


def test_two_scope_changes_at_once_compile_the_scope_as_committed(tenants: Tenants) -> None:
    """Two writers of the scope table at once (two deploys syncing PG_LEASE_KEY_SCOPES): each change
    recompiles the predicate, and the last one compiled must be the table as both left it. The
    second waits for the first and then compiles what the first committed, rather than failing with
    PostgreSQL's "tuple concurrently updated" on the function it replaces (or, had the first
    committed a moment earlier, compiling from rows the first had removed)."""
    elsewhere = _a_widened_to_b(tenants)
    narrowing = psycopg.connect(conninfo())
    widening = psycopg.connect(conninfo())
    tenants.opened += [narrowing, widening]
    narrowing.execute(SCOPE_ROW_DELETE, [tenants.role("a"), tenants.prefix("b")])  # A narrowed back, not committed

    def widen_c() -> str:
        widening.execute(SCOPE_ROW_ADD, [tenants.role("c"), tenants.prefix("b")])
        widening.commit()
        return "committed"

    thread, outcome = until_blocked(tenants, widening, widen_c)
    narrowing.commit()
    thread.join()
    assert outcome == ["committed"]
    with fails_with("42501"):
        tenants.connect("a_login").execute(INSPECT, [elsewhere])
    assert tenants.connect("c_login").execute(INSPECT, [elsewhere]).fetchone() == ("free", None, 0)


def test_a_scope_change_from_an_older_snapshot_is_refused_rather_than_undo_a_narrowing(tenants: Tenants) -> None:
    """A scope change in a REPEATABLE READ (or SERIALIZABLE) transaction reads the scope table as it
    was when the transaction began: a narrowing committed since would be undone by the predicate it
    compiles, silently widening a tenant again. The change is refused (0A000) and nothing is undone;
    `sync_key_scopes` reads in READ COMMITTED whatever isolation Django's connection is set to."""
    elsewhere = _a_widened_to_b(tenants)
    late = psycopg.connect(conninfo())
    tenants.opened.append(late)
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    late.execute("SELECT 1")  # its snapshot: A still widened
    tenants.admin.execute(SCOPE_ROW_DELETE, [tenants.role("a"), tenants.prefix("b")])  # A narrowed, committed
    with fails_with("0A000"):
        late.execute(SCOPE_ROW_ADD, [tenants.role("c"), tenants.prefix("c") + "more/"])
    late.rollback()
    with fails_with("42501"):
        tenants.connect("a_login").execute(INSPECT, [elsewhere])

    connection.ensure_connection()
    assert connection.connection is not None
    connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with override_settings(PG_LEASE_KEY_SCOPES={**tenants.settings["PG_LEASE_KEY_SCOPES"], tenants.role("c"): "*"}):
            assert privileges.sync_key_scopes()
        assert tenants.connect("c_login").execute(INSPECT, [elsewhere]).fetchone() == ("free", None, 0)
    finally:
        connection.connection.isolation_level = None


@pytest.mark.parametrize("table", ["key_scope", "role_limit"])
def test_two_deploys_syncing_the_same_new_settings_at_once_both_succeed(tenants: Tenants, table: str) -> None:
    """Two pods run `migrate` (or `leases grant`) at once after a settings change: each syncs the
    scope and limit tables from the same new settings. The second must wait for the first and
    then replace what the first committed, not insert the same rows again beside them (a
    primary-key violation that failed its `migrate`). Both are held at their first write by a
    third session's row locks, so they go on together."""
    sync = privileges.sync_key_scopes if table == "key_scope" else privileges.sync_role_limits
    new = (
        {"PG_LEASE_KEY_SCOPES": {**tenants.settings["PG_LEASE_KEY_SCOPES"], tenants.role("c"): "*"}}
        if table == "key_scope"
        else {"PG_LEASE_ROLE_LIMITS": {tenants.role("b"): {"leases": 5}}}
    )
    if table == "role_limit":
        with override_settings(PG_LEASE_ROLE_LIMITS={tenants.role("a"): {"leases": 3}}):
            privileges.sync_role_limits()  # a row for the held lock below
    holder = psycopg.connect(conninfo())
    tenants.opened.append(holder)
    holder.execute(f"SELECT FROM public.pg_lease_django_{table} FOR UPDATE")
    waiting = (  # by their statements: behind PgBouncer the pid Django's connection knows is the pooler's
        "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE %s"
    )

    with override_settings(**new):
        pods = [Background(sync), Background(sync)]
        for pod in pods:
            pod.start()
        wait_until(
            lambda: tenants.admin.execute(waiting, [f"%pg_lease_django_{table}%"]).fetchone() == (2,),
            what="both pods waiting for a lock on the table",
        )
        holder.commit()
        changed = sorted(pod.outcome() for pod in pods)
        assert changed[-1] is True
        stored = privileges.stored_key_scopes() if table == "key_scope" else privileges.stored_role_limits()
        wanted = conf.key_scopes() if table == "key_scope" else conf.role_limits()
        assert stored == wanted


def test_a_role_reaching_the_lease_functions_without_a_scope_is_refused_and_reported(tenants: Tenants) -> None:
    """Fail closed: once any scope is configured, a role that may call the lease functions but that
    no scope applies to (a declared worker group without one, and its login member) is refused for
    every key, and check E006 names both; declared for every key ("*"), it may use any."""
    tenants.create("CREATE ROLE {} NOLOGIN", "w")
    tenants.create("CREATE ROLE {} LOGIN IN ROLE {}", "w_login", "w")
    tenants.made[:0] = ["w_login", "w"]
    workers = [*tenants.settings["PG_LEASE_WORKER_ROLES"], tenants.role("w")]
    scoped = {**tenants.settings, "PG_LEASE_WORKER_ROLES": workers}
    with override_settings(**scoped):
        call_command("leases", "grant", stdout=StringIO())
        stray = tenants.connect("w_login")
        for key in (tenants.prefix("a") + "x", "anything", tenants.prefix("w") + "x"):
            with fails_with("42501"):
                stray.execute(ACQUIRE, [key, "w1", "60 seconds"])
        assert stray.execute("SELECT public.pg_lease_session_scope()").fetchone() == ([],)
        found = tenants.findings()
        errors = sorted(m.msg.split("'")[3] for m in found if m.id == "pg_lease_django.E006")
        assert errors == sorted([tenants.role("w"), tenants.role("w_login")]), [m.msg for m in found]
        assert all(m.level >= 40 for m in found if m.id == "pg_lease_django.E006")  # errors, not warnings
    spanning = {**scoped, "PG_LEASE_KEY_SCOPES": {**scoped["PG_LEASE_KEY_SCOPES"], tenants.role("w"): "*"}}
    with override_settings(**spanning):
        call_command("leases", "grant", stdout=StringIO())
        assert stray.execute(ACQUIRE, [tenants.prefix("a") + "y", "w1", "60 seconds"]).fetchone() == (True, 1)
        assert tenants.findings() == []


# ---- 2. an opt-out is minted for the caller alone -----------------------------------------------


def test_an_opt_out_is_minted_for_the_caller_alone(tenants: Tenants) -> None:
    """Finding 2: pg_lease_opt_out_token(name) accepted any role name (the operator minted the
    owner's token), and a grant option let the operator pass the opt-out to tenant B, whose opt-out
    then skipped key scopes: B wrote A's rows unfenced."""
    a, b, ops = tenants.connect("a_login"), tenants.connect("b_login"), tenants.connect("ops")
    a_key = tenants.prefix("a") + "inv"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    invoice_id = invoice(a, a_key, "a1", 1)
    owner = tenants.admin.execute("SELECT current_user").fetchone()
    assert owner is not None
    with fails_with("42501"):  # the owner's token, minted by the operator
        ops.execute("SELECT public.pg_lease_opt_out_token(%s::name)", [owner[0]])
    with fails_with("42501"):  # tenant B's token, minted by the operator
        ops.execute("SELECT public.pg_lease_opt_out_token(%s::name)", [tenants.role("b_login")])
    # The operator's own opt-out works for its own writes (data repair).
    with ops.transaction():
        ops.execute("SELECT public.pg_lease_allow_unfenced()")
        ops.execute("UPDATE testapp_invoice SET amount = 1 WHERE id = %s", [invoice_id])
    assert amount(tenants.admin, invoice_id)[0] == 1
    # The owner granted the operator its opt-out WITH GRANT OPTION; the operator passes it on to B.
    for function in ("public.pg_lease_allow_unfenced()", "public.pg_lease_opt_out_token(name)"):
        tenants.create(f"GRANT EXECUTE ON FUNCTION {function} TO {{}} WITH GRANT OPTION", "ops")
        ops.execute(
            pgsql.SQL(f"GRANT EXECUTE ON FUNCTION {function} TO {{}}").format(pgsql.Identifier(tenants.role("b")))
        )
    with fails_with("42501"):
        b.execute("SELECT public.pg_lease_allow_unfenced()")
    with fails_with("42501"):
        b.execute("SELECT public.pg_lease_opt_out_token(%s::name)", [tenants.role("b_login")])
    with fails_with("PL004"), b.transaction():
        b.execute("UPDATE testapp_invoice SET amount = 2 WHERE id = %s", [invoice_id])
    assert amount(tenants.admin, invoice_id)[0] == 1
    # Check W008 reports the grant option, and the grants the declaration does not give B.
    found = tenants.findings()
    reported = {m.msg.split("'")[1]: m.msg for m in found if m.id == "pg_lease_django.W008"}
    assert "WITH GRANT OPTION" in reported[tenants.role("ops")]
    assert "pg_lease_allow_unfenced" in reported[tenants.role("b")]


def test_an_opted_out_write_stays_within_the_writers_key_scope(tenants: Tenants) -> None:
    """An operator scoped to B's keys may opt out (data repair) of B's rows only: the opt-out no
    longer skips the key scope."""
    scoped_ops = {**tenants.settings, "PG_LEASE_KEY_SCOPES": {**tenants.settings["PG_LEASE_KEY_SCOPES"]}}
    scoped_ops["PG_LEASE_KEY_SCOPES"][tenants.role("ops")] = [tenants.prefix("b")]
    a, b = tenants.connect("a_login"), tenants.connect("b_login")
    a_key, b_key = tenants.prefix("a") + "inv", tenants.prefix("b") + "inv"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    assert b.execute(ACQUIRE, [b_key, "b1", "60 seconds"]).fetchone() == (True, 1)
    a_row, b_row = invoice(a, a_key, "a1", 1), invoice(b, b_key, "b1", 1)
    with override_settings(**scoped_ops):
        privileges.sync_key_scopes()
        ops = tenants.connect("ops")
        with ops.transaction():
            ops.execute("SELECT public.pg_lease_allow_unfenced()")
            ops.execute("UPDATE testapp_invoice SET amount = 3 WHERE id = %s", [b_row])
        with fails_with("42501"), ops.transaction():
            ops.execute("SELECT public.pg_lease_allow_unfenced()")
            ops.execute("UPDATE testapp_invoice SET amount = 3 WHERE id = %s", [a_row])
        tenants.create("GRANT TRUNCATE ON testapp_invoice, testapp_creditnote TO {}", "ops")
        with fails_with("PL004"), ops.transaction():  # all keys at once: only for a role spanning every key
            ops.execute("SELECT public.pg_lease_allow_unfenced()")
            ops.execute("SET LOCAL pg_lease.allow_truncate = on")
            ops.execute("TRUNCATE testapp_invoice CASCADE")
    assert amount(tenants.admin, b_row)[0] == 3 and amount(tenants.admin, a_row)[0] == 0


# ---- 3. what PostgreSQL offers around the fence ------------------------------------------------


def test_replica_mode_from_a_parameter_grant_turns_no_lease_trigger_off(tenants: Tenants) -> None:
    """Finding 3: with GRANT SET ON PARAMETER session_replication_role (PostgreSQL 15+), a worker set
    replica mode locally and rewrote a fenced row with no fence, its epoch lowered to 0. The fence
    and lease triggers fire ALWAYS now; W008 reports the grant with a remedy that works."""
    if tenants.admin.info.server_version < 150000:
        pytest.skip("parameter privileges arrived in PostgreSQL 15")
    a = tenants.connect("a_login")
    a_key = tenants.prefix("a") + "inv"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    invoice_id = invoice(a, a_key, "a1", 1)
    tenants.create("GRANT SET ON PARAMETER session_replication_role TO {}", "a_login")
    try:
        with fails_with("PL004"), a.transaction():
            a.execute("SET LOCAL session_replication_role = replica")
            a.execute("UPDATE testapp_invoice SET amount = 9, lease_epoch = 0 WHERE id = %s", [invoice_id])
        assert amount(tenants.admin, invoice_id) == (0, a_key, 1)
        # The lease functions' own triggers still judge and stamp under replica mode: a grant of an
        # existing row is stamped by pg_lease_guard_update with the server clock (else it would
        # store its markers: acquired at -infinity, expiring in 1970).
        again = tenants.prefix("a") + "replica"
        assert a.execute(ACQUIRE, [again, "a2", "60 seconds"]).fetchone() == (True, 1)
        assert a.execute(RELEASE, [again, "a2", 1]).fetchone() == ("ok",)
        with a.transaction():
            a.execute("SET LOCAL session_replication_role = replica")
            row = a.execute(
                "SELECT granted, expires_at > server_time FROM public.pg_lease_acquire(%s::text, 'a2'::text, "
                "'60 seconds'::interval)",
                [again],
            ).fetchone()
        assert row == (True, True)
        stored = tenants.admin.execute(
            "SELECT acquired_at > '-infinity', expires_at > clock_timestamp() "
            "FROM pg_lease_django_lease WHERE key = %s",
            [again],
        ).fetchone()
        assert stored == (True, True)
        found = tenants.findings()
        [warning] = [m for m in found if tenants.role("a_login") in m.msg]
        assert "session_replication_role" in warning.msg and warning.hint is not None
        assert "REVOKE SET, ALTER SYSTEM ON PARAMETER session_replication_role" in warning.hint
    finally:
        tenants.create("REVOKE SET ON PARAMETER session_replication_role FROM {}", "a_login")


def test_a_parameter_granted_to_public_is_reported_once_with_the_revoke_that_works(tenants: Tenants) -> None:
    """Issue 51, item 8: ``GRANT SET ON PARAMETER session_replication_role TO PUBLIC`` lets every role
    turn triggers off. W008 reports it once, as PUBLIC's (not in each role), with the REVOKE that
    removes it. The grant is the server's: this test runs in the group of the tests that assert a
    worker cannot set replica mode (cluster-roles), never beside them."""
    from pg_lease_django.checks import check_declared_roles_are_granted

    if tenants.admin.info.server_version < 150000:
        pytest.skip("parameter privileges arrived in PostgreSQL 15")

    def public() -> list[str]:
        found = check_declared_roles_are_granted(databases=["default"])
        return [f"{m.id} {m.hint}" for m in found if PUBLIC_PARAMETER in m.msg]

    assert public() == []
    tenants.admin.execute("GRANT SET ON PARAMETER session_replication_role TO PUBLIC")
    try:
        said = public()
    finally:
        tenants.admin.execute("REVOKE SET ON PARAMETER session_replication_role FROM PUBLIC")
    assert said == ["pg_lease_django.W008 REVOKE SET, ALTER SYSTEM ON PARAMETER session_replication_role FROM PUBLIC"]
    assert public() == []


def test_a_pg_read_all_data_member_reads_no_secret_and_forges_no_opt_out(tenants: Tenants) -> None:
    """Finding 3: a pg_read_all_data member read the secret and forged its own token; W008 advised
    a REVOKE on the secret table that changes nothing. Row-level security keeps the secret from it,
    and W008 names the membership."""
    a, b = tenants.connect("a_login"), tenants.connect("b_login")
    a_key = tenants.prefix("a") + "inv"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    invoice_id = invoice(a, a_key, "a1", 1)
    tenants.admin.execute(pgsql.SQL("GRANT pg_read_all_data TO {}").format(pgsql.Identifier(tenants.role("b"))))
    assert b.execute("SELECT count(*) FROM public.pg_lease_django_secret").fetchone() == (0,)
    assert b.execute("SELECT owner FROM public.pg_lease_django_lease WHERE key = %s", [a_key]).fetchone() == ("a1",)
    forge = (
        "SELECT set_config('pg_lease.unfenced', encode(sha256(convert_to(coalesce((SELECT s.secret FROM "
        "public.pg_lease_django_secret s), '') || '/' || current_user || '/' || pg_backend_pid()::text || '/' "
        "|| extract(epoch FROM now())::text, 'UTF8')), 'hex'), true)"
    )
    with fails_with("PL004"), b.transaction():
        b.execute(forge)
        b.execute("UPDATE testapp_invoice SET amount = 4 WHERE id = %s", [invoice_id])
    assert amount(tenants.admin, invoice_id)[0] == 0
    found = tenants.findings()
    [warning] = [m for m in found if "pg_read_all_data" in m.msg]
    assert tenants.role("b") in warning.msg and warning.hint == f'REVOKE "pg_read_all_data" FROM "{tenants.role("b")}"'
    assert not [m for m in found if "pg_lease_django_secret" in m.msg]  # the wrong remedy is gone


# ---- 4. the database derives the lease key -------------------------------------------------------


def test_a_row_planted_under_another_tenants_account_gets_its_true_key(tenants: Tenants) -> None:
    """Finding 4: under its own lease, B inserted a row with account A's and its own key: A's queries
    included it and A could never write it. The database derives lease_key from account now, so
    the row asks for A's fence, which B cannot present."""
    a, b = tenants.connect("a_login"), tenants.connect("b_login")
    a_key, b_key = tenants.prefix("a") + "inv", tenants.prefix("b") + "x"
    assert a.execute(ACQUIRE, [a_key, "a1", "60 seconds"]).fetchone() == (True, 1)
    assert b.execute(ACQUIRE, [b_key, "b1", "60 seconds"]).fetchone() == (True, 1)
    with fails_with("PL004"), b.transaction():  # A's account, B's key and fence: asks for A's fence
        b.execute(
            f"INSERT INTO testapp_invoice (account, status, amount, lease_key, lease_epoch) "
            f"VALUES (%s, 'planted', 0, %s, {FENCE})",
            [a_key, b_key, b_key, "b1", 1],
        )
    b_row = invoice(b, b_key, "b1", 1)
    with fails_with("PL004"), b.transaction():  # moving its own row to A's account: A's fence too
        b.execute(f"SELECT {FENCE}", [b_key, "b1", 1])
        b.execute("UPDATE testapp_invoice SET account = %s WHERE id = %s", [a_key, b_row])
    with b.transaction():  # the key alone set by hand: derived back from the account
        b.execute(f"SELECT {FENCE}", [b_key, "b1", 1])
        b.execute("UPDATE testapp_invoice SET lease_key = %s WHERE id = %s", [a_key, b_row])
    assert amount(tenants.admin, b_row) == (0, b_key, 1)
    assert tenants.admin.execute("SELECT count(*) FROM testapp_invoice WHERE status = 'planted'").fetchone() == (0,)
    # Through the ORM, B's fence for a row of A's account is refused before anything is sent.
    grant = Lease.objects.acquire(tenants.prefix("b") + "orm", "b2", ttl=60)
    assert grant is not None
    with pytest.raises(InvalidInputError, match="guarded by lease"):
        Invoice(account=a_key).save(fence=grant)


# ---- 5. one tenant cannot grow the others' cost ---------------------------------------------------


def test_a_tenants_lease_rows_and_kept_tenures_are_bounded(tenants: Tenants) -> None:
    """Finding 5: B made 20,000 permanent lease rows and 20,000 history rows in 1.7 s. With
    PG_LEASE_ROLE_LIMITS the database refuses B's brand-new keys past its limit (QuotaExceededError
    through Django, 53400 in SQL) and keeps B's newest tenures per key only; A is not limited."""
    limits = {tenants.role("b"): {"leases": 5, "tenures_per_key": 3}}
    b = tenants.connect("b_login")
    with override_settings(PG_LEASE_ROLE_LIMITS=limits, PG_LEASE_HISTORY=[tenants.prefix("b")]):
        call_command("leases", "grant", stdout=StringIO())
        history.sync_scope()
        for i in range(5):
            assert b.execute(ACQUIRE, [f"{tenants.prefix('b')}{i}", "b1", "60 seconds"]).fetchone() == (True, 1)
        with fails_with("53400"):
            b.execute(ACQUIRE, [tenants.prefix("b") + "5", "b1", "60 seconds"])
        assert b.execute(ACQUIRE, [tenants.prefix("b") + "0", "b1", "60 seconds"]).fetchone() == (True, 2)  # a row
        with refused(QuotaExceededError, match="quota"):
            Lease.objects.acquire(tenants.prefix("b") + "6", "b1", ttl=60)
        a = tenants.connect("a_login")
        for i in range(8):  # A is not limited
            assert a.execute(ACQUIRE, [f"{tenants.prefix('a')}{i}", "a1", "60 seconds"]).fetchone() == (True, 1)
        # Ten tenures of one of B's keys: the newest three are kept.
        recorded = tenants.prefix("b") + "1"
        epoch = 1
        for _ in range(10):
            assert b.execute(RELEASE, [recorded, "b1", epoch]).fetchone() == ("ok",)
            granted = b.execute(ACQUIRE, [recorded, "b1", "60 seconds"]).fetchone()
            assert granted is not None and granted[0]
            epoch = granted[1]
        kept = tenants.admin.execute(
            "SELECT epoch FROM pg_lease_django_tenure WHERE key = %s ORDER BY epoch", [recorded]
        ).fetchall()
        assert [e for (e,) in kept] == [epoch - 4, epoch - 2, epoch]


def test_concurrent_new_keys_cannot_pass_the_limit_together(tenants: Tenants) -> None:
    """The brand-new keys of a limited role are counted one transaction at a time: the last free
    place goes to one of two concurrent acquires, whichever commits first."""
    limits = {tenants.role("b"): {"leases": 2}}
    first, second = tenants.connect("b_login"), tenants.connect("b_login")
    with override_settings(PG_LEASE_ROLE_LIMITS=limits):
        call_command("leases", "grant", stdout=StringIO())
        assert first.execute(ACQUIRE, [tenants.prefix("b") + "0", "b1", "60 seconds"]).fetchone() == (True, 1)
        with first.transaction():
            assert first.execute(ACQUIRE, [tenants.prefix("b") + "1", "b1", "60 seconds"]).fetchone() == (True, 1)
            thread, outcome = until_blocked(
                tenants,
                second,
                lambda: second.execute(ACQUIRE, [tenants.prefix("b") + "2", "b2", "60 seconds"]).fetchone(),
            )
        thread.join()
    assert outcome == ["53400"]


# ---- 6. notifications any role can send -----------------------------------------------------------


def test_forged_notifications_cost_a_waiter_a_bounded_number_of_attempts(tenants: Tenants, key: str) -> None:
    """Finding 5: 5,000 NOTIFYs from a role granted nothing made one blocking waiter try 1,238 extra
    acquires. A waiter woken early attempts at once WAKE_BURST times, then WAKE_RATE times a second."""
    held_key = f"{key}/held"
    assert Lease.objects.acquire(held_key, "holder", ttl=60) is not None
    nobody = tenants.connect("nobody")
    attempts: list[float] = []
    stop = threading.Event()

    def count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if "pg_lease_acquire" in sql:
            attempts.append(time.monotonic())
        return execute(sql, params, many, context)

    def flood() -> None:
        while not stop.is_set():
            nobody.execute("SELECT pg_notify('pg_lease_django', %s) FROM generate_series(1, 50)", [held_key])

    def wait() -> None:
        try:
            with connection.execute_wrapper(count), pytest.raises(Exception, match="still held"):
                Lease.objects.acquire(held_key, "waiter", ttl=60, blocking=True, timeout=2.0)
        finally:
            connection.close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    started = time.monotonic()
    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join()
    stop.set()
    flooder.join()
    elapsed = time.monotonic() - started
    polls = elapsed / conf.poll_interval() + 2  # the pauses between un-woken attempts, and the first
    assert len(attempts) <= polls + WAKE_BURST + WAKE_RATE * elapsed, (len(attempts), elapsed)
    assert len(attempts) > WAKE_BURST  # the notifications did wake it: the bound is what held it


# ---- 7. bad input first --------------------------------------------------------------------------


def test_bad_input_is_judged_before_the_scope_and_never_echoed_whole(tenants: Tenants) -> None:
    """Finding 6: for a scoped role an empty or 10 MB key got 42501 key_scope (the 10 MB key echoed
    back); a malformed pg_lease.fences gave a raw JSON error; bidi overrides were accepted in keys."""
    b = tenants.connect("b_login")
    huge = "x" * (10 * 1024 * 1024)
    for statement, params in (
        (ACQUIRE, ["", "b1", "60 seconds"]),
        (ACQUIRE, [huge, "b1", "60 seconds"]),
        (INSPECT, [huge]),
        (RELEASE, [huge, "b1", 1]),
        ("SELECT public.pg_lease_check_fence(%s::text, 'b1'::text, 1::bigint)", [huge]),
    ):
        with pytest.raises(psycopg.Error) as info:
            b.execute(statement, params)
        assert info.value.sqlstate == "22023", (statement, info.value.sqlstate)
        assert len(str(info.value)) < 500
    with pytest.raises(psycopg.Error) as info:  # outside B's scope: refused, the key shortened in the message
        b.execute(INSPECT, [tenants.prefix("a") + "y" * 200])
    assert info.value.sqlstate == "42501" and "y" * 100 not in str(info.value)
    assert b.execute(ACQUIRE, [tenants.prefix("b") + "f", "b1", "60 seconds"]).fetchone() == (True, 1)
    b_row = invoice(b, tenants.prefix("b") + "f", "b1", 1)
    for malformed in ("{not json", "[1, 2]", f'{{"{tenants.prefix("b")}f": ["b1", "one"]}}'):
        with pytest.raises(psycopg.Error) as info, b.transaction():
            b.execute("SELECT set_config('pg_lease.fences', %s, true)", [malformed])
            b.execute("UPDATE testapp_invoice SET amount = 1, lease_epoch = 1 WHERE id = %s", [b_row])
        assert info.value.sqlstate == "PL004", (malformed, info.value)
    # The same through Django: a typed error.
    django_key = tenants.prefix("b") + "django"
    grant = Lease.objects.acquire(django_key, "d1", ttl=60)
    assert grant is not None
    row = Invoice(account=django_key)
    row.save(fence=grant)
    with pytest.raises(UnfencedWriteError, match=r"pg_lease\.fences"), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('pg_lease.fences', '{not json', true)")
        Invoice.objects.fenced(grant).filter(pk=row.pk).update(amount=2)
