"""The Lease admin through Django's test client, with real users and permissions, on a real server."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from pg_lease_django import Lease
from tests.helpers import held

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:pg_lease_django_lease_changelist"


def changelist_url(query: str = "") -> str:
    return reverse(CHANGELIST) + (f"?{query}" if query else "")


def change_url(key: str) -> str:
    return reverse("admin:pg_lease_django_lease_change", args=[quote(key)])


def make_user(username: str, *codenames: str, superuser: bool = False) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True, is_superuser=superuser)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="pg_lease_django", codename__in=codenames)
    )
    return user


@pytest.fixture
def viewer() -> User:
    """Staff with the view permission only."""
    return make_user("viewer", "view_lease")


@pytest.fixture
def staff() -> User:
    """Staff with no lease permission at all."""
    return make_user("staff")


@pytest.fixture
def operator() -> User:
    """Staff who may view and force-release leases (not a superuser)."""
    return make_user("operator", "view_lease", "force_release_lease")


@pytest.fixture
def superuser() -> User:
    return make_user("root", superuser=True)


def login(user: User, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def rows(html: str) -> dict[str, str]:
    """Changelist rows: key -> the row's HTML."""
    found = {}
    for row in re.findall(r"<tr>.*?</tr>", html, flags=re.S):
        match = re.search(r'class="field-key_display"><a href="[^"]*"><span[^>]*>([^<]*)</span></a>', row)
        if match:
            found[match.group(1)] = row
    return found


def badge(row: str) -> str:
    match = re.search(r"pg-lease-state-(\w+)", row)
    assert match, row
    return match.group(1)


# -- the changelist -----------------------------------------------------------------------------------


def test_changelist_shows_states_from_the_server_clock(viewer: User, trio: dict[str, str]) -> None:
    response = login(viewer).get(changelist_url())
    assert response.status_code == 200
    html = response.content.decode()
    found = rows(html)
    assert {badge(found[k]): k for k in trio.values()} == {state: k for state, k in trio.items()}
    assert "worker-1" in found[trio["held"]] and ">in " in found[trio["held"]]
    assert "worker-2" in found[trio["lapsed"]] and "ago" in found[trio["lapsed"]]
    for column in ("key", "state", "owner", "epoch", "expires", "acquired at"):
        assert f">{column.capitalize()}<" in html or f">{column}<" in html.lower()


def test_changelist_cost_does_not_grow_with_the_page(superuser: User, key: str) -> None:
    client = login(superuser)

    def queries_for_page() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get(changelist_url()).status_code == 200
        return len(queries)

    for i in range(3):
        held(f"{key}/{i}")
    few = queries_for_page()
    for i in range(3, 60):
        held(f"{key}/{i}", ttl=0.001 if i % 2 else 60)
    assert queries_for_page() == few


def test_filter_by_state(viewer: User, trio: dict[str, str]) -> None:
    client = login(viewer)
    for state, lease_key in trio.items():
        assert set(rows(client.get(changelist_url(f"state={state}")).content.decode())) == {lease_key}


def test_search_by_key_and_owner(viewer: User, trio: dict[str, str]) -> None:
    client = login(viewer)
    assert set(rows(client.get(changelist_url("q=worker-2")).content.decode())) == {trio["lapsed"]}
    assert set(rows(client.get(changelist_url("q=b-held")).content.decode())) == {trio["held"]}


def test_ordering_by_key_by_default_and_by_state(viewer: User, trio: dict[str, str]) -> None:
    client = login(viewer)
    assert list(rows(client.get(changelist_url()).content.decode())) == sorted(trio.values())
    by_state = list(rows(client.get(changelist_url("o=1")).content.decode()))  # column 1: state (no actions)
    assert by_state == [trio["free"], trio["held"], trio["lapsed"]]


def test_admin_is_read_only(superuser: User, trio: dict[str, str]) -> None:
    client = login(superuser)
    changelist = client.get(changelist_url()).content.decode()
    assert reverse("admin:pg_lease_django_lease_add") not in changelist
    assert 'value="delete_selected"' not in changelist
    assert client.get(reverse("admin:pg_lease_django_lease_add")).status_code == 403
    assert client.get(reverse("admin:pg_lease_django_lease_delete", args=[quote(trio["held"])])).status_code == 403
    before = Lease.objects.inspect(trio["held"])
    response = client.post(change_url(trio["held"]), {"owner": "intruder", "epoch": "999"})
    assert response.status_code == 403
    after = Lease.objects.inspect(trio["held"])
    assert (after.owner, after.epoch, after.expires_at) == (before.owner, before.epoch, before.expires_at)


def test_detail_page_shows_the_facts_and_how_to_use_the_key(viewer: User, key: str) -> None:
    lease_key = f'{key}/it\'s a "key"'
    epoch = held(lease_key, "worker-9")
    response = login(viewer).get(change_url(lease_key))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'name="_save"' not in html
    assert "worker-9" in html and "pg-lease-state-held" in html
    assert "how to use this key" in html.lower()
    assert "Lease.objects.acquire(&quot;" in html
    assert f"leases release &#x27;{key}/it&#x27;&quot;&#x27;&quot;&#x27;s" in html
    assert f"--force --epoch {epoch}" in html
    assert "pg_lease_inspect(&#x27;" in html and "it&#x27;&#x27;s" in html


def test_staff_without_lease_permissions_cannot_see_leases(staff: User, trio: dict[str, str]) -> None:
    client = login(staff)
    assert client.get(changelist_url()).status_code == 403
    assert client.get(change_url(trio["held"])).status_code == 403


# -- force release ----------------------------------------------------------------------------------


def action_offered(client: Client) -> bool:
    return 'value="force_release"' in client.get(changelist_url()).content.decode()


def test_force_release_is_offered_only_with_the_permission(
    viewer: User, operator: User, superuser: User, trio: dict[str, str]
) -> None:
    assert not action_offered(login(viewer))
    assert action_offered(login(operator))
    assert action_offered(login(superuser))


def test_viewer_cannot_force_release_by_posting(viewer: User, trio: dict[str, str]) -> None:
    epoch = Lease.objects.inspect(trio["held"]).epoch
    client = login(viewer)
    for extra in ({"index": "0"}, {"post": "yes", "confirmed": f"{epoch}:{trio['held']}"}):
        client.post(changelist_url(), {"action": "force_release", "_selected_action": [trio["held"]], **extra})
    state = Lease.objects.inspect(trio["held"])
    assert (state.status, state.epoch) == ("held", epoch)
    assert not LogEntry.objects.exists()


def test_confirmation_page_lists_the_leases_and_their_owners(operator: User, trio: dict[str, str]) -> None:
    response = login(operator).post(
        changelist_url(), {"action": "force_release", "_selected_action": list(trio.values()), "index": "0"}
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "Force release" in html
    for lease_key in trio.values():
        assert lease_key in html
    assert "worker-1" in html and "worker-2" in html
    assert "already free: skipped" in html
    assert 'value="Yes, force-release 2 leases"' in html
    confirmed = set(re.findall(r'name="confirmed" value="([^"]*)"', html))
    assert confirmed == {f"1:{trio['held']}", f"1:{trio['lapsed']}"}
    # Nothing happens until confirmed.
    assert Lease.objects.inspect(trio["held"]).status == "held"


def confirm(client: Client, *pairs: tuple[str, int], selected: list[str] | None = None) -> Any:
    return client.post(
        changelist_url(),
        {
            "action": "force_release",
            "_selected_action": selected or [k for k, _ in pairs],
            "post": "yes",
            "confirmed": [f"{epoch}:{k}" for k, epoch in pairs],
        },
        follow=True,
    )


def test_confirmed_force_release_bumps_epochs_logs_and_reports(operator: User, trio: dict[str, str]) -> None:
    client = login(operator)
    response = confirm(client, (trio["held"], 1), (trio["lapsed"], 1), selected=list(trio.values()))
    assert response.status_code == 200
    assert response.redirect_chain and response.redirect_chain[-1][1] == 302
    for lease_key in (trio["held"], trio["lapsed"]):
        state = Lease.objects.inspect(lease_key)
        assert (state.status, state.owner, state.epoch) == ("free", None, 2)
    messages = [str(m) for m in response.context["messages"]]
    assert len(messages) == 1 and messages[0].startswith("Force-released 2 leases:")
    entries = LogEntry.objects.filter(
        content_type=ContentType.objects.get_for_model(Lease), user=operator, action_flag=CHANGE
    )
    assert {e.object_id: e.get_change_message() for e in entries} == {
        trio["held"]: "Force-released: was held by 'worker-1' at epoch 1; new epoch 2.",
        trio["lapsed"]: "Force-released: was held by 'worker-2' at epoch 1; new epoch 2.",
    }
    assert Lease.objects.acquire(trio["held"], "w-new", ttl=30).epoch == 3  # type: ignore[union-attr]


def test_superuser_can_force_release(superuser: User, trio: dict[str, str]) -> None:
    response = confirm(login(superuser), (trio["held"], 1))
    (message,) = [str(m) for m in response.context["messages"]]
    assert message.startswith("Force-released 1 lease:")
    assert Lease.objects.inspect(trio["held"]).epoch == 2
    assert LogEntry.objects.get(user=superuser).object_id == trio["held"]


def test_a_lease_that_moved_on_after_confirmation_is_left_alone(operator: User, key: str) -> None:
    old = held(key, "w1")
    new = held(key, "w1")  # self-takeover after the operator saw epoch `old`
    response = confirm(login(operator), (key, old))
    messages = [str(m) for m in response.context["messages"]]
    assert messages == [f"Not released: {key!r} changed hands after you confirmed (now held by 'w1')."]
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("held", new)
    assert not LogEntry.objects.exists()


def test_a_lease_freed_after_confirmation_is_reported(operator: User, key: str) -> None:
    epoch = held(key, "w1")
    Lease.objects.release(key, "w1", epoch)
    response = confirm(login(operator), (key, epoch))
    assert [str(m) for m in response.context["messages"]] == [f"Not released: {key!r} was already free."]


def test_selecting_only_free_leases_releases_nothing(operator: User, trio: dict[str, str]) -> None:
    response = confirm(login(operator), selected=[trio["free"]])
    assert [str(m) for m in response.context["messages"]] == ["Nothing to release: the selected leases are free."]
    assert Lease.objects.inspect(trio["free"]).epoch == 2


@pytest.mark.parametrize("confirmed", ["x:y", "0:{key}", f"{2**63}:{{key}}", f"{10**40}:{{key}}"])
def test_confirmation_must_name_epochs(operator: User, trio: dict[str, str], confirmed: str) -> None:
    response = login(operator).post(
        changelist_url(),
        {
            "action": "force_release",
            "_selected_action": [trio["held"]],
            "post": "yes",
            "confirmed": confirmed.format(key=trio["held"]),
        },
    )
    assert response.status_code == 400  # not a 500
    assert Lease.objects.inspect(trio["held"]).status == "held"


def test_force_release_is_csrf_protected(operator: User, trio: dict[str, str]) -> None:
    client = login(operator, enforce_csrf_checks=True)
    data = {
        "action": "force_release",
        "_selected_action": [trio["held"]],
        "post": "yes",
        "confirmed": f"1:{trio['held']}",
    }
    assert client.post(changelist_url(), data).status_code == 403
    assert Lease.objects.inspect(trio["held"]).status == "held"

    client.get(changelist_url())
    token = client.cookies["csrftoken"].value
    response = client.post(changelist_url(), {**data, "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert Lease.objects.inspect(trio["held"]).epoch == 2


def test_state_filter_counts(viewer: User, trio: dict[str, str]) -> None:
    html = login(viewer).get(changelist_url("_facets=True")).content.decode()
    for state in ("held", "lapsed", "free"):
        assert re.search(rf">\s*{state} \(1\)\s*<", html), state
