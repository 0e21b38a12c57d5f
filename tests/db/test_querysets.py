"""`LeaseQuerySet` on its own: ``with_state()``, ``matching()``, ``listing()`` and ``row()``; and how
``leases release --force`` turns `force_release`'s outcomes into exit codes."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db.models import QuerySet

from pg_lease_django import Lease, LeaseManager, NeverAcquiredError
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.querysets import LeaseQuerySet
from pg_lease_django.status import LeaseStatus

pytestmark = pytest.mark.django_db


def test_lease_objects_is_a_lease_manager_with_the_queryset_methods() -> None:
    assert isinstance(Lease.objects, LeaseManager)
    assert isinstance(Lease.objects.db_manager("other"), LeaseManager)
    assert isinstance(Lease.objects.db_manager("other").with_state(), LeaseQuerySet)
    assert Lease.objects.db_manager("other").matching(owner="w").db == "other"


def test_with_state_annotates_the_state_and_the_times_on_the_server_clock(trio: dict[LeaseStatus, str]) -> None:
    annotated: QuerySet[Any] = Lease.objects.with_state().filter(key__in=trio.values())  # mypy: annotations
    leases = {row["key"]: row for row in annotated.values("key", "state", "expires_in", "held_for")}
    assert {state: leases[key]["state"] for state, key in trio.items()} == {state: state for state in trio}
    held, lapsed, free = (leases[trio[state]] for state in LeaseStatus)
    assert timedelta(0) < held["expires_in"] <= timedelta(seconds=60)
    assert lapsed["expires_in"] < timedelta(0) and lapsed["held_for"] > timedelta(0)
    assert (free["expires_in"], free["held_for"]) == (None, None)
    assert list(annotated.filter(state=LeaseStatus.LAPSED).values_list("key", flat=True)) == [trio[LeaseStatus.LAPSED]]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({}, [LeaseStatus.HELD, LeaseStatus.LAPSED, LeaseStatus.FREE]),
        ({"states": [LeaseStatus.HELD, "free"]}, [LeaseStatus.HELD, LeaseStatus.FREE]),
        ({"states": list(LeaseStatus)}, [LeaseStatus.HELD, LeaseStatus.LAPSED, LeaseStatus.FREE]),
        ({"states": []}, []),
        ({"owner": "worker-2"}, [LeaseStatus.LAPSED]),
        ({"glob": "*/[ab]"}, []),  # no character classes: [ is literal
    ],
)
def test_matching(trio: dict[LeaseStatus, str], key: str, filters: dict[str, Any], expected: list[LeaseStatus]) -> None:
    found = Lease.objects.matching(prefix=f"{key}/", **filters).values_list("key", flat=True)
    assert sorted(found) == sorted(trio[state] for state in expected)


def test_matching_refuses_an_unknown_state() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Lease.objects.matching(states=["bogus"])


def test_listing_and_row(trio: dict[LeaseStatus, str], key: str) -> None:
    listing = Lease.objects.matching(glob=f"{key}/?-*").listing(limit=2)
    assert listing.count == 3
    assert [(row.key, row.state, row.owner) for row in listing.rows] == [  # in key order
        (trio[LeaseStatus.LAPSED], LeaseStatus.LAPSED, "worker-2"),
        (trio[LeaseStatus.HELD], LeaseStatus.HELD, "worker-1"),
    ]
    assert all(row.server_time == listing.server_time for row in listing.rows)
    held = Lease.objects.row(trio[LeaseStatus.HELD])
    assert held is not None and held.expiry.startswith("in ")
    assert Lease.objects.row(f"{key}/never") is None
    nothing = Lease.objects.matching(prefix=f"{key}/never").listing()
    assert (nothing.rows, nothing.count) == ([], 0) and nothing.server_time.endswith("+00:00")


# -- leases release --force relies on force_release's outcome ------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "code"),
    [("freed", ExitCode.ALREADY_FREE), ("pruned", ExitCode.NOT_FOUND), ("taken over", ExitCode.MOVED_ON)],
)
def test_release_reports_what_happened_between_its_look_and_its_release(
    key: str, monkeypatch: pytest.MonkeyPatch, outcome: str, code: ExitCode
) -> None:
    grant = Lease.objects.acquire(key, "w1", ttl=30)
    assert grant is not None
    real = type(Lease.objects).force_release

    def meanwhile(self: Any, lease_key: str, *, epoch: int | None = None, operator: str | None = None) -> int:
        Lease.objects.release(lease_key, "w1", grant.epoch)
        if outcome == "pruned":
            raise NeverAcquiredError(f"no lease with key {lease_key!r} (never acquired): nothing to release")
        if outcome == "taken over":
            assert Lease.objects.acquire(lease_key, "w2", ttl=30) is not None
        return real(self, lease_key, epoch=epoch, operator=operator)

    monkeypatch.setattr(type(Lease.objects), "force_release", meanwhile)
    with pytest.raises(CommandError) as caught:
        call_command("leases", "release", key, "--force", stdout=StringIO(), stderr=StringIO())
    assert caught.value.returncode == code
    assert "\n" not in str(caught.value)
