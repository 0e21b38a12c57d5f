"""The health view (issue 28): 200 with this process's holds when the lease database answers, 503 when not."""

from __future__ import annotations

import json

import pytest
from django.test import RequestFactory, override_settings

from pg_lease_django import hold
from pg_lease_django.views import health


@pytest.mark.django_db(transaction=True)
def test_health_answers_ok_and_lists_this_process_holds(key: str) -> None:
    before = json.loads(health(RequestFactory().get("/health/leases/")).content)
    assert before["status"] == "ok" and all(h["key"] != key for h in before["holds"])
    with hold(key, ttl=30) as lease:
        response = health(RequestFactory().get("/health/leases/"))
    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    document = json.loads(response.content)
    [mine] = [h for h in document["holds"] if h["key"] == key]
    assert mine == {
        "key": key,
        "owner": lease.owner,
        "epoch": lease.epoch,
        "expires_at": mine["expires_at"],
        "lost": False,
    }
    after = json.loads(health(RequestFactory().get("/health/leases/")).content)
    assert all(h["key"] != key for h in after["holds"])  # the hold ended


@pytest.mark.django_db
def test_health_is_503_when_the_lease_functions_are_not_there() -> None:
    with override_settings(PG_LEASE_SCHEMA="no_such_schema"):
        response = health(RequestFactory().get("/health/leases/"))
    assert response.status_code == 503
    document = json.loads(response.content)
    assert document["status"] == "error" and "no_such_schema" in document["database"], document


def test_health_answers_get_only() -> None:
    assert health(RequestFactory().post("/health/leases/")).status_code == 405
