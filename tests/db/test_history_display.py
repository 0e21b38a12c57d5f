"""A lease's history shown to people: `read_history`'s rows, ``leases history / handoff /
prune-history``, ``release --operator``, the SVG chart of `draw_timeline` parsed as XML, and the
admin's history section, hand-off button and action (through the test client)."""

from __future__ import annotations

import getpass
import html
import json
import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from datetime import datetime, timedelta
from io import StringIO

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings
from django.urls import reverse

from pg_lease_django import Lease
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.models import LeaseTenure
from pg_lease_django.provisioning.history import sync_scope
from pg_lease_django.timeline import History, TenureRow, draw_timeline, read_history
from tests.helpers import free, held, lapsed
from tests.history_story import STORY, recording, tell

pytestmark = pytest.mark.django_db

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def recorded() -> Iterator[None]:
    with recording():
        yield


def leases(*args: str) -> tuple[int, str, str]:
    """``leases ARGS`` through call_command: exit code, stdout, error message."""
    out = StringIO()
    try:
        call_command("leases", *args, stdout=out, stderr=StringIO(), no_color=True)
    except CommandError as exc:
        return exc.returncode, out.getvalue(), str(exc)
    return 0, out.getvalue(), ""


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def bars(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if "pg-lease-tenure" in g.get("class", "").split()]


def classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


# -- the rows ---------------------------------------------------------------------------------------


def test_each_tenure_ends_as_it_happened(key: str) -> None:
    epochs = tell(key)
    history = read_history(key)
    assert history.count == len(STORY)
    assert [(t.epoch, t.owner, t.outcome, t.ended_by) for t in history.tenures] == [
        (epoch, owner, outcome, by) for epoch, (owner, outcome, by) in zip(epochs, STORY, strict=True)
    ]
    *ended, current = history.tenures
    assert all(t.ended_at is not None and t.granted_at <= t.ended_at for t in ended)
    assert [t.forced for t in history.tenures] == [False, False, True, False, False, False]
    state = Lease.objects.inspect(key)
    assert (current.current, current.ended_at, current.expires_at) == (True, None, state.expires_at)
    assert timedelta(0) < current.duration(history.server_time) < timedelta(seconds=30)
    lapsed_one = history.tenures[1]
    assert lapsed_one.ended_at is not None and lapsed_one.ended_at <= history.tenures[2].granted_at
    assert not lapsed_one.current


def test_a_lapsed_grant_nobody_took_over_ends_at_its_expiry(key: str) -> None:
    epoch = lapsed(key, "worker-z")
    (row,) = read_history(key).tenures
    state = Lease.objects.inspect(key)
    assert (row.epoch, row.outcome, row.ended_by, row.current) == (epoch, "lapsed", None, True)
    assert row.ended_at == row.expires_at == state.expires_at
    assert row.describe(datetime.now().astimezone()) == "lapsed (free to take)"


def test_a_hand_off_request_shows_on_the_current_tenure(key: str) -> None:
    held(key, "worker-a")
    request = Lease.objects.request_handoff(key)
    (row,) = read_history(key).tenures
    assert row.handoff_requested_at == request.requested_at
    assert row.describe(request.server_time).endswith(", hand-off requested")


def test_an_end_that_was_not_recorded_is_unknown(key: str) -> None:
    epoch = held(key, "worker-a")
    with override_settings(PG_LEASE_HISTORY=[]):
        sync_scope()
        Lease.objects.release(key, "worker-a", epoch)
    (row,) = read_history(key).tenures
    assert (row.outcome, row.ended_at, row.current) == ("unknown", None, False)


def test_an_epoch_advance_ends_the_tenure(key: str) -> None:
    epoch = held(key, "worker-a")
    Lease.objects.advance_epochs(by=10)  # every lease: rolled back with the test
    (row,) = read_history(key).tenures
    assert (row.epoch, row.outcome, row.forced, row.current) == (epoch, "epochs_advanced", True, False)
    marks = [m for m in parse(draw_timeline(read_history(key))).iter() if "pg-lease-mark-epochs_advanced" in classes(m)]
    assert len(marks) == 1


def test_limit_keeps_the_newest(key: str) -> None:
    epochs = tell(key)
    history = read_history(key, limit=2)
    assert [t.epoch for t in history.tenures] == epochs[-2:]
    assert history.count == len(STORY)


# -- leases history ------------------------------------------------------------------------------------


def test_history_command_prints_a_table(key: str) -> None:
    epochs = tell(key)
    code, out, _ = leases("history", key)
    assert code == 0
    header, *rows, summary = out.splitlines()
    assert header.split() == [
        "EPOCH",
        "OWNER",
        "GRANTED",
        "AT",
        "ENDED",
        "AT",
        "HOW",
        "IT",
        "ENDED",
        "ENDED",
        "BY",
        "DB",
        "ROLE",
        "DURATION",
    ]
    assert [int(row.split()[0]) for row in rows] == epochs
    assert "force-released" in rows[2] and "ops@console" in rows[2]
    assert "lapsed" in rows[1] and "worker-c" in rows[1]
    assert "handed off" in rows[3]
    assert "held, expires in" in rows[5]
    assert summary.startswith(f"6 tenures of {key!r} (server time ")


def test_history_command_json(key: str) -> None:
    epochs = tell(key)
    code, out, _ = leases("history", key, "--json", "--limit", "3")
    assert code == 0
    document = json.loads(out)
    assert set(document) == {"key", "server_time", "count", "tenures"}
    assert (document["key"], document["count"]) == (key, 6)
    assert [t["epoch"] for t in document["tenures"]] == epochs[-3:]
    fields = {
        "epoch",
        "owner",
        "granted_at",
        "ended_at",
        "outcome",
        "ended_by",
        "ended_by_role",
        "expires_at",
        "handoff_requested_at",
        "duration_seconds",
    }
    assert all(set(t) == fields for t in document["tenures"])
    handed, reacquired, current = document["tenures"]
    assert (handed["outcome"], handed["ended_by"]) == ("handed_off", "worker-a")
    with connection.cursor() as cursor:  # the role that sent the release: this test's
        cursor.execute("SELECT session_user")
        assert handed["ended_by_role"] == cursor.fetchone()[0]
    assert reacquired["outcome"] == "reacquired"
    assert (current["outcome"], current["ended_at"]) == ("held", None)
    assert datetime.fromisoformat(current["expires_at"]) > datetime.fromisoformat(document["server_time"])
    ended = datetime.fromisoformat(handed["ended_at"]) - datetime.fromisoformat(handed["granted_at"])
    assert handed["duration_seconds"] == pytest.approx(ended.total_seconds())


def test_history_of_a_key_never_acquired_or_not_recorded(key: str) -> None:
    assert leases("history", key)[0] == ExitCode.NOT_FOUND
    with override_settings(PG_LEASE_HISTORY=["elsewhere:"]):
        sync_scope()
        held(key)
    code, out, _ = leases("history", key)
    assert code == 0 and "No recorded tenures" in out
    assert json.loads(leases("history", key, "--json")[1])["tenures"] == []
    assert leases("history", key, "--limit", "0")[0] == ExitCode.USAGE


# -- leases handoff --------------------------------------------------------------------------------------


def test_handoff_command_asks_the_holder(key: str) -> None:
    epoch = held(key, "worker-a")
    code, out, _ = leases("handoff", key)
    assert code == 0
    assert out.startswith(f"Hand-off requested from 'worker-a' (epoch {epoch}) on {key!r}")
    document = json.loads(leases("handoff", key, "--epoch", str(epoch), "--json")[1])
    assert set(document) == {"key", "owner", "epoch", "expires_at", "requested_at", "server_time"}
    assert (document["owner"], document["epoch"]) == ("worker-a", epoch)
    lease = Lease.objects.get(key=key)
    assert lease.handoff_requested_at == datetime.fromisoformat(document["requested_at"])
    state = Lease.objects.inspect(key)
    assert (state.status, state.epoch) == ("held", epoch)  # advice only


def test_handoff_command_refusals(key: str) -> None:
    assert leases("handoff", key)[0] == ExitCode.NOT_FOUND
    free(key)
    assert leases("handoff", key)[0] == ExitCode.ALREADY_FREE
    lapsed(key)
    code, _, error = leases("handoff", key)
    assert code == ExitCode.ALREADY_FREE and "nobody to hand off from" in error
    epoch = held(key)
    code, _, error = leases("handoff", key, "--epoch", str(epoch + 7))
    assert code == ExitCode.MOVED_ON and "nothing requested" in error


# -- release --operator, prune-history ------------------------------------------------------------------


def test_release_records_the_operator(key: str) -> None:
    held(key, "worker-a")
    assert leases("release", key, "--force", "--operator", "alice")[0] == 0
    held(key, "worker-b")
    assert leases("release", key, "--force")[0] == 0
    assert [t.ended_by for t in LeaseTenure.objects.for_key(key)] == [
        "alice",
        f"{getpass.getuser()}@{socket.gethostname()}",
    ]
    assert leases("release", key, "--force", "--operator", "")[0] == ExitCode.USAGE


def test_prune_history(key: str) -> None:
    tell(key)
    code, out, _ = leases("prune-history", "--older-than", "1d", "--json")
    assert (code, json.loads(out)) == (0, {"dry_run": False, "older_than_seconds": 86400.0, "tenures": 0})
    code, out, _ = leases("prune-history", "--older-than", "0", "--dry-run")
    assert code == 0 and out.startswith("Dry run: would delete ")
    assert LeaseTenure.objects.for_key(key).count() == len(STORY)
    code, out, _ = leases("prune-history", "--older-than", "0s")
    assert code == 0 and "Deleted " in out
    assert [t.outcome for t in read_history(key).tenures] == ["held"]  # a running tenure stays
    document = json.loads(leases("prune-history", "--dry-run", "--json")[1])
    assert document["older_than_seconds"] == 30 * 86400.0
    assert leases("prune-history", "--older-than", "soon")[0] == ExitCode.USAGE


# -- the chart ------------------------------------------------------------------------------------------


def test_chart_draws_a_bar_per_tenure_in_lanes_per_owner(key: str) -> None:
    epochs = tell(key)
    history = read_history(key)
    root = parse(draw_timeline(history))
    assert root.tag == f"{SVG}svg"
    drawn = bars(root)
    assert [int(g.get("data-epoch", "")) for g in drawn] == epochs
    assert [g.get("data-owner") for g in drawn] == [owner for owner, _, _ in STORY]
    outcomes = [next(c for c in classes(g) if c.startswith("pg-lease-outcome-")) for g in drawn]
    assert outcomes == [f"pg-lease-outcome-{outcome}" for _, outcome, _ in STORY]
    lanes = [t.text for t in root.iter(f"{SVG}text") if "pg-lease-lane" in classes(t)]
    assert lanes == ["worker-a", "worker-b", "worker-c"]
    for g, tenure in zip(drawn, history.tenures, strict=True):
        tooltip = g.find(f"{SVG}title")
        assert tooltip is not None and tooltip.text is not None
        assert tooltip.text.startswith(f"epoch {tenure.epoch} \N{MIDDLE DOT} {tenure.owner}")
        assert g.find(f"{SVG}rect[@class='pg-lease-bar']") is not None
        marks = {c for m in g.iter() for c in classes(m) if c.startswith("pg-lease-mark-")}
        expected = {
            "lapsed": {"pg-lease-mark-lapsed"},
            "force_released": {"pg-lease-mark-force_released"},
            "handed_off": {"pg-lease-mark-handed_off"},
        }.get(tenure.outcome, set())
        assert marks == expected, tenure
    forced = drawn[2]
    words = [t.text for t in forced.iter(f"{SVG}text") if "pg-lease-outcome" in classes(t)]
    assert words == ["force-released by ops@console"]
    labels = [t.text for g in drawn for t in g.iter(f"{SVG}text") if "pg-lease-epoch" in classes(t)]
    assert labels and set(labels) <= {f"#{e}" for e in epochs}
    current = drawn[-1]
    assert current.find(f"{SVG}rect[@class='pg-lease-until-expiry']") is not None
    assert [e for e in root.iter() if "pg-lease-now" in classes(e)]


def test_chart_heading_fits_a_long_key_and_the_tooltip_keeps_it_whole(key: str) -> None:
    """A 200-character key was cut off at the chart's right edge (noticed in issue 28's first hour)."""
    long_key = f"{key}/" + "x" * (200 - len(key))
    assert Lease.objects.acquire(long_key, "worker-a", ttl=30) is not None
    for width in (960, 640):
        root = parse(draw_timeline(read_history(long_key), width=width))
        (heading,) = [t.text or "" for t in root.iter(f"{SVG}text") if "pg-lease-heading" in classes(t)]
        assert len(heading) * 9 <= width - 20, (width, heading)
        assert "\N{HORIZONTAL ELLIPSIS}" in heading and heading.endswith(" UTC")
        title = root.find(f"{SVG}title")
        assert title is not None and long_key in (title.text or "")


def test_chart_shades_the_gaps(key: str) -> None:
    start = datetime(2026, 5, 1, 12, 0, 0).astimezone()
    at = [start + timedelta(seconds=s) for s in (0, 10, 30, 40, 55)]
    history = History(
        key,
        [
            TenureRow(1, "w1", at[0], at[1], "released", "w1"),
            TenureRow(3, "w2", at[2], at[3], "force_released", "ops"),
            TenureRow(5, "w1", at[4], None, "held", None, at[4] + timedelta(seconds=30)),
        ],
        3,
        at[4] + timedelta(seconds=5),
    )
    root = parse(draw_timeline(history))
    gaps = [e for e in root.iter(f"{SVG}rect") if "pg-lease-gap" in classes(e)]
    assert len(gaps) == 2
    widths = [float(g.get("width", "0")) for g in gaps]
    assert widths[0] / widths[1] == pytest.approx(20 / 15, rel=0.02)  # drawn to scale
    titles = [g.find(f"{SVG}title") for g in gaps]
    assert [t.text for t in titles if t is not None] == ["no holder for 20s", "no holder for 15s"]
    ticks = [t.text for t in root.iter(f"{SVG}text") if "pg-lease-tick" in classes(t)]
    assert ticks and all(len(tick or "") == 8 for tick in ticks)  # HH:MM:SS


def test_chart_escapes_user_text(key: str) -> None:
    nasty_owner = '<script>alert("x")</script>&\'"'
    nasty_key = f"{key}/<img src=x onerror=alert(1)>\x01"
    # acquire() refuses a control character in a new key: a row stored before that rule (or by hand).
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
            "SELECT %s, %s, f.floor + 1, clock_timestamp(), clock_timestamp() + interval '30 seconds' "
            "FROM pg_lease_django_epoch_floor f",
            [nasty_key, nasty_owner],
        )
    svg = draw_timeline(read_history(nasty_key))
    assert "<script" not in svg and "<img" not in svg
    root = parse(svg)  # well-formed XML despite the control character
    assert not [e for e in root.iter() if e.tag in (f"{SVG}script", "script", f"{SVG}img")]
    (bar,) = bars(root)
    assert bar.get("data-owner") == nasty_owner
    lanes = [t.text for t in root.iter(f"{SVG}text") if "pg-lease-lane" in classes(t)]
    assert lanes == ['<script>alert("x")</scr\N{HORIZONTAL ELLIPSIS}']
    heading = next(t for t in root.iter(f"{SVG}text") if "pg-lease-heading" in classes(t))
    assert "/<img src=x" in (heading.text or "")  # shortened to fit, escaped
    title = root.find(f"{SVG}title")
    assert title is not None and "/<img src=x onerror=alert(1)>" in (title.text or "")


def test_chart_escapes_a_rewritten_history(key: str) -> None:
    """The table is writable by its owner (docs/history.md): even its end_reason is only text."""
    at = datetime(2026, 5, 1, 12, 0, 0).astimezone()
    hostile = '"><script>alert(1)</script><g onload="alert(2)'
    row = TenureRow(1, "w1", at, at + timedelta(seconds=5), hostile, hostile)
    svg = draw_timeline(History(key, [row], 1, at + timedelta(seconds=9)))
    root = parse(svg)
    assert "<script" not in svg
    assert not [e for e in root.iter() if "onload" in e.attrib]
    (bar,) = bars(root)
    assert f"pg-lease-outcome-{hostile}" in (bar.get("class") or "")


def test_chart_of_no_history(key: str) -> None:
    root = parse(draw_timeline(read_history(key)))
    assert not bars(root)
    assert "No recorded tenures" in "".join(root.itertext())


# -- the admin (test client; the real browser is test_history_browser) -------------------------------


def admin_client(*codenames: str) -> Client:
    user = User.objects.create_user("staff-" + "-".join(codenames), password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="pg_lease_django", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def test_lease_page_shows_the_chart_and_the_tenures_escaped(key: str) -> None:
    nasty = f"{key}/<b>bold</b>"
    held(nasty, '<script>alert("owner")</script>')
    response = admin_client("view_lease").get(reverse("admin:pg_lease_django_lease_change", args=[quote(nasty)]))
    page = response.content.decode()
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="pg-lease-timeline"') == 1
    assert "<script>alert" not in page and "<b>bold</b>" not in page
    assert 'id="pg-lease-tenures"' in page and "held, expires in" in page
    assert 'id="pg-lease-request-handoff"' not in page  # a viewer may not ask


def test_handoff_from_the_admin_needs_the_permission(key: str) -> None:
    epoch = held(key, "worker-a")
    url = reverse("admin:pg_lease_django_lease_handoff", args=[quote(key)])
    assert admin_client("view_lease").post(url, {"epoch": str(epoch)}).status_code == 403
    assert Lease.objects.get(key=key).handoff_requested_at is None
    operator = admin_client("view_lease", "force_release_lease")
    page = operator.get(reverse("admin:pg_lease_django_lease_change", args=[quote(key)])).content.decode()
    assert 'id="pg-lease-request-handoff"' in page and f'name="epoch" value="{epoch}"' in page
    assert operator.get(url).status_code == 405  # POST only
    assert operator.post(url, {"epoch": "x"}).status_code == 400
    assert operator.post(url, {"epoch": str(epoch + 1)}).status_code == 302  # moved on: reported, not asked
    assert Lease.objects.get(key=key).handoff_requested_at is None
    assert operator.post(url, {"epoch": str(epoch)}).status_code == 302
    assert Lease.objects.get(key=key).handoff_requested_at is not None
    (entry,) = LogEntry.objects.filter(object_id=key)
    assert entry.get_change_message() == f"Requested a hand-off from 'worker-a' at epoch {epoch}."


def test_handoff_action_asks_each_held_lease(key: str) -> None:
    keys = [f"{key}/held", f"{key}/free"]
    held(keys[0], "worker-a")
    free(keys[1])
    response = admin_client("view_lease", "force_release_lease").post(
        reverse("admin:pg_lease_django_lease_changelist"),
        {"action": "request_handoff", "_selected_action": keys},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    assert any(m.startswith(f"Hand-off requested from {keys[0]!r} ('worker-a'") for m in messages), messages
    assert f"No hand-off requested: {keys[1]!r} is not held: nobody to ask." in messages
    assert Lease.objects.get(key=keys[0]).handoff_requested_at is not None


def test_force_release_from_the_admin_records_the_user(key: str) -> None:
    epoch = held(key, "worker-a")
    admin_client("view_lease", "force_release_lease").post(
        reverse("admin:pg_lease_django_lease_changelist"),
        {"action": "force_release", "_selected_action": [key], "post": "yes", "confirmed": f"{epoch}:{key}"},
    )
    (tenure,) = LeaseTenure.objects.for_key(key)
    assert (tenure.end_reason, tenure.ended_by) == ("force_released", "staff-view_lease-force_release_lease")


def test_the_tenure_list_is_read_only_and_filters_by_key(key: str) -> None:
    tell(key)
    held(f"{key}-other", "worker-z")
    client = admin_client("view_lease", "view_leasetenure")
    page = client.get(reverse("admin:pg_lease_django_lease_change", args=[quote(key)])).content.decode()
    link = re.search(r'href="([^"]*leasetenure/\?key=[^"]*)"', page)
    assert link is not None
    listing = client.get(html.unescape(link.group(1)))
    assert listing.status_code == 200
    shown = listing.content.decode()
    assert "worker-z" not in shown and shown.count("ops@console") == 1
    assert 'value="delete_selected"' not in shown
    assert reverse("admin:pg_lease_django_leasetenure_add") not in shown
