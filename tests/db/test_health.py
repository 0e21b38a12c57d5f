"""The probes (issue 46, findings 1, 2 and 5): readiness and liveness as Kubernetes means them.

Readiness worked for no scoped role (it inspected a key of its own, outside every tenant's
prefixes: 503 for every tenant pod) and answered anyone with the process's fences and the database's
host, port and role. Now it checks, with no key, what a role needs; an anonymous caller learns "ok"
or "unavailable" only; details go to staff with the app's view permission. Liveness never reads the
database. Both answer HEAD.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import AnonymousUser, Permission, User
from django.core.management import call_command
from django.db import connection
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from psycopg import sql as pgsql

from pg_lease_django import hold
from pg_lease_django.holds import scheduler as holds_scheduler
from pg_lease_django.provisioning import privileges
from pg_lease_django.views import health, live, ready
from tests.helpers import conninfo

ANONYMOUS_KEYS = {"status"}


def get(view: Any, user: Any = None, method: str = "get") -> tuple[int, dict[str, Any]]:
    request = getattr(RequestFactory(), method)("/health/leases/")
    request.user = user or AnonymousUser()
    response: HttpResponse = view(request)
    return response.status_code, (json.loads(response.content) if response.content else {})


@contextmanager
def django_as(role: str) -> Iterator[None]:
    """Django's default connection logs in as ``role``, straight to the server."""
    settings = connection.settings_dict
    saved = {name: settings[name] for name in ("USER", "PASSWORD", "HOST", "PORT")}
    server = psycopg.conninfo.conninfo_to_dict(conninfo())
    connection.close()
    settings.update(USER=role, PASSWORD="", HOST=server.get("host") or "", PORT=str(server.get("port") or ""))
    try:
        yield
    finally:
        connection.close()
        settings.update(saved)


@pytest.fixture
def tenant(transactional_db: None) -> Iterator[tuple[str, str]]:
    """A NOLOGIN tenant group scoped to its prefix, its login member, and a login role no scope applies to."""
    tag = uuid.uuid4().hex[:8]
    group, login, stray = f"pgl_{tag}_tenant", f"pgl_{tag}_web", f"pgl_{tag}_stray"
    admin = psycopg.connect(conninfo(), autocommit=True)
    ident = pgsql.Identifier
    admin.execute(pgsql.SQL("CREATE ROLE {} NOLOGIN").format(ident(group)))
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(ident(login), ident(group)))
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(ident(stray), ident(group)))
    scopes = {"PG_LEASE_WORKER_ROLES": [group], "PG_LEASE_KEY_SCOPES": {group: [f"{tag}:"]}}
    try:
        with override_settings(**scopes):
            call_command("leases", "grant", stdout=StringIO())
            yield login, stray
    finally:
        with override_settings(PG_LEASE_KEY_SCOPES={}):
            privileges.sync_key_scopes()
        for role in (stray, login, group):
            admin.execute(pgsql.SQL("DROP OWNED BY {} CASCADE").format(ident(role)))
            admin.execute(pgsql.SQL("DROP ROLE {}").format(ident(role)))
        admin.close()


@pytest.mark.django_db(transaction=True)
def test_ready_tells_an_anonymous_caller_ok_and_nothing_else(key: str) -> None:
    """Finding 2: an anonymous GET during a hold() returned key, owner and epoch: a complete fence."""
    with hold(key, ttl=30):
        status, body = get(ready)
        assert (status, body) == (200, {"status": "ok"})
        status, body = get(live)
        assert (status, body) == (200, {"status": "ok"})


@pytest.mark.django_db(transaction=True)
def test_staff_with_the_view_permission_see_the_holds(key: str) -> None:
    staff = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_lease", content_type__app_label="pg_lease_django"))
    staff = User.objects.get(pk=staff.pk)  # a fresh instance: permissions are cached per instance
    plain = User.objects.create_user(f"plain-{uuid.uuid4().hex[:8]}")
    with hold(key, ttl=30) as lease:
        for view in (ready, live):
            status, body = get(view, staff)
            [mine] = [h for h in body["holds"] if h["key"] == key]
            assert status == 200 and mine["owner"] == lease.owner and mine["epoch"] == lease.epoch
            assert get(view, plain) == (200, {"status": "ok"})  # logged in, without the permission
        with override_settings(PG_LEASE_HEALTH_DETAILS=True):  # a probe port nobody else reaches
            assert any(h["key"] == key for h in get(ready)[1]["holds"])


@pytest.mark.django_db
def test_ready_is_503_and_says_only_unavailable_when_the_database_does_not_answer() -> None:
    """Finding 2: the 503 body showed the database's host, port and role to anyone."""
    with override_settings(PG_LEASE_SCHEMA="no_such_schema"):
        assert get(ready) == (503, {"status": "unavailable"})
        with override_settings(PG_LEASE_HEALTH_DETAILS=True):
            status, body = get(ready)
        assert status == 503 and "no_such_schema" in body["reason"]
        # Liveness never reads the database: a database outage restarts no pod.
        assert get(live) == (200, {"status": "ok"})


@pytest.mark.django_db(transaction=True)
def test_ready_answers_for_a_scoped_tenant_role_and_refuses_a_role_no_scope_applies_to(
    tenant: tuple[str, str],
) -> None:
    """Finding 1: the probe inspected pg_lease_django:health, outside every tenant's prefixes, so every
    scoped role got a 503 and every tenant pod was marked unready. Without a key it answers for the
    tenant's login member; a role whose every call would be refused (no scope applies) is not ready."""
    login, _stray = tenant
    with django_as(login):
        assert get(ready) == (200, {"status": "ok"})
        with override_settings(PG_LEASE_HEALTH_DETAILS=True):
            assert get(ready)[0] == 200
    nobody = f"pgl_{uuid.uuid4().hex[:8]}_nobody"
    admin = psycopg.connect(conninfo(), autocommit=True)
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(nobody)))
    try:
        with django_as(nobody), override_settings(PG_LEASE_HEALTH_DETAILS=True):
            status, body = get(ready)  # granted nothing: not ready
        assert status == 503 and "leases grant" in body["reason"]
    finally:
        admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(nobody)))
        admin.close()


@pytest.mark.django_db(transaction=True)
def test_ready_refuses_a_role_no_scope_applies_to(tenant: tuple[str, str]) -> None:
    """Fail closed: a role in the tenant's group but taken out of it has no scope left."""
    login, stray = tenant
    admin = psycopg.connect(conninfo(), autocommit=True)
    try:
        group = login.replace("_web", "_tenant")
        admin.execute(pgsql.SQL("REVOKE {} FROM {}").format(pgsql.Identifier(group), pgsql.Identifier(stray)))
        admin.execute(
            pgsql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {}").format(pgsql.Identifier(stray))
        )
        with django_as(stray), override_settings(PG_LEASE_HEALTH_DETAILS=True):
            status, body = get(ready)
        assert status == 503 and "none applies to this role" in body["reason"], body
    finally:
        admin.close()


def test_the_probes_answer_head_and_refuse_post() -> None:
    """Finding 5: HEAD got 405 (some checkers use it)."""
    assert get(live, method="head")[0] == 200
    assert get(live, method="post")[0] == 405
    assert get(ready, method="post")[0] == 405
    assert health is ready  # the 0.2 view is readiness


@pytest.mark.django_db(transaction=True)
def test_live_fails_when_the_renewals_thread_of_the_holds_is_gone(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness: a process whose holds lost their renewal thread (here the scheduler crashes as it
    starts) is wedged: its leases will lapse while its jobs run on. Restarting it is the cure."""

    def crash(self: Any) -> None:
        raise RuntimeError("the scheduler crashed")

    monkeypatch.setattr(holds_scheduler.Scheduler, "_run", crash)
    monkeypatch.setattr(holds_scheduler, "_the_scheduler", None)
    assert get(live)[0] == 200
    with hold(key, ttl=30):
        thread = holds_scheduler.process_scheduler().__dict__["_thread"]
        thread.join(timeout=30)
        assert get(live) == (503, {"status": "unavailable"})
    assert get(live)[0] == 200
