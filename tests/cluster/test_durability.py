"""Durability: what a failed attempt writes, and what survives a crash of the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from devkit.dbserver import REPO, LocalServer, throwaway_datadir
from pg_lease_django import Lease
from tests.helpers import row_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


def test_refused_acquire_takes_no_lock_and_no_transaction_id(key: str, raw_connect: Any) -> None:
    """No xid means no row lock and nothing WAL-logged; the upsert pattern takes both."""
    assert Lease.objects.acquire(key, "holder", ttl=30) is not None
    conn = raw_connect(autocommit=False)
    before = row_snapshot(conn, key)
    for _ in range(50):
        assert conn.execute("SELECT granted FROM pg_lease_acquire(%s, 'waiter', '30 s')", [key]).fetchone() == (False,)
    assert conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() == (None,)
    conn.rollback()
    assert row_snapshot(conn, key) == before

    # The pattern we avoid: INSERT .. ON CONFLICT DO UPDATE .. WHERE lapsed locks the row even when it fails.
    conn.execute(
        """INSERT INTO pg_lease_django_lease AS l (key, owner, epoch, acquired_at, expires_at)
           VALUES (%s, 'waiter', 1, clock_timestamp(), clock_timestamp() + interval '30 s')
           ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, epoch = l.epoch + 1
           WHERE l.expires_at <= clock_timestamp()""",
        [key],
    )
    assert conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() != (None,)
    conn.rollback()


def test_refused_renew_and_release_take_no_transaction_id(key: str, raw_connect: Any) -> None:
    grant = Lease.objects.acquire(key, "holder", ttl=30)
    assert grant is not None
    conn = raw_connect(autocommit=False)
    assert conn.execute(
        "SELECT outcome FROM pg_lease_renew(%s, 'intruder', %s, '30 s')", [key, grant.epoch]
    ).fetchone() == ("not_owner",)
    assert conn.execute(
        "SELECT outcome FROM pg_lease_release(%s, 'holder', %s)", [key, grant.epoch + 1]
    ).fetchone() == ("epoch_mismatch",)
    assert conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() == (None,)
    conn.rollback()


def run_django(url: str, code: str) -> Any:
    """Run ``code`` in a fresh Python process with Django set up on ``url``; return its JSON output."""
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    script = "import django, json; django.setup()\nfrom pg_lease_django import Lease\n" + code
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.cluster
def test_acknowledged_grants_survive_a_crash_even_with_synchronous_commit_off() -> None:
    """Crash (immediate shutdown) right after a burst of grants: every acknowledged epoch survives."""
    server = LocalServer(throwaway_datadir("crash"))
    server.start("synchronous_commit=off")
    try:
        url = server.url()
        last = run_django(
            url,
            "from django.core.management import call_command\n"
            "call_command('migrate', 'pg_lease_django', verbosity=0)\n"
            "grants = [Lease.objects.acquire('job', 'w', ttl=30) for _ in range(200)]\n"
            "epochs = [g.epoch for g in grants if g]\n"
            "assert epochs == list(range(1, 201)), grants\n"
            "print(json.dumps(epochs[-1]))",
        )
        server.restart("immediate", "synchronous_commit=off")
        after = run_django(
            url,
            "s = Lease.objects.inspect('job')\n"
            "g = Lease.objects.acquire('job', 'w', ttl=30)\n"
            "print(json.dumps([s.status, s.owner, s.epoch, g.epoch]))",
        )
        assert after == ["held", "w", last, last + 1]
    finally:
        server.destroy()
