"""The operators' outputs show other roles' data, never obey it (issue 46, finding 7).

A tenant may choose a key or an owner holding escape sequences (clear the screen, set the window
title), a carriage return and line feed followed by a forged row, C1 controls or a bidi override.
Every human-readable output (``manage.py leases`` and its error messages, ``watch``'s two views, the
admin's pages) shows those characters escaped (`pg_lease_django.display.printable`, or ``!r`` in
messages), one row to a line; ``--json`` gives the exact strings.

The rows are written with plain SQL as the test database's superuser (states acquire() cannot make:
a lapsed lease, a force-released tenure), inside each test's transaction; the last test goes through
acquire, inspect, renew and release, which take any non-empty key and owner (issue 52).
"""

from __future__ import annotations

import ast
import html
import io
import json
import os
import re
import subprocess
import threading
import uuid
from dataclasses import dataclass
from html.parser import HTMLParser

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings
from django.urls import reverse

from pg_lease_django import Lease
from pg_lease_django.display import printable
from pg_lease_django.management.leases.live_view import Frame, Watcher, watch

pytestmark = pytest.mark.django_db

CLEAR = "\x1b[2J"  # erase the screen
TITLE = "\x1b]0;pwned\x07"  # set the window title (an OSC sequence, ended by BEL)
CSI_C1 = "\x9b31m"  # the one-byte (C1) form of ESC [
RLO = "\u202e"  # right-to-left override: what follows reads backwards
FORGED_ROW = "\r\nb/x  held  tenant-b  9  in 1h"  # a line that reads as another tenant's lease

#: What a terminal or a browser acts on rather than shows, spelled out independently of
#: `printable`: C0 controls but the newline, DEL, C1 controls, the bidi controls (ALM, LRM, RLM,
#: the embeddings and overrides, the isolates), the line and paragraph separators, and BOM.
ACTED_ON = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ufeff]")


def acted_on(text: str) -> list[str]:
    """The characters of ``text`` a terminal would obey (none, for a clean output)."""
    return ACTED_ON.findall(text)


@dataclass(frozen=True)
class Tenants:
    """Two leases whose keys and owners are hostile: ``a`` held, ``b`` lapsed long ago."""

    prefix: str
    key_a: str
    owner_a: str
    key_b: str
    owner_b: str
    operator: str
    role: str


def run(*args: str) -> tuple[str, str]:
    """``manage.py leases --no-color ARGS``: (stdout, the CommandError's text or "")."""
    out = io.StringIO()
    try:
        call_command("leases", "--no-color", *args, stdout=out, stderr=io.StringIO())
    except CommandError as exc:
        return out.getvalue(), str(exc)
    return out.getvalue(), ""


@pytest.fixture
def tenants(key: str) -> Tenants:
    """Lease rows (and tenure rows, for ``history`` and ``watch``) with hostile keys and owners."""
    found = Tenants(
        prefix=key,
        key_a=f"{key}/a{CLEAR}{TITLE}{RLO}gnp.exe",
        owner_a=f"w-a{FORGED_ROW}{CSI_C1}[red]x[/red]",
        key_b=f"{key}/b{FORGED_ROW}",
        owner_b=f"w-b{RLO}{CLEAR}",
        operator=f"op{TITLE}{RLO}",
        role=f"role{CLEAR}",
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(max(floor), 0) + 1 FROM pg_lease_django_epoch_floor")
        (epoch,) = cursor.fetchone()
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) VALUES "
            "(%s, %s, %s + 1, clock_timestamp() - interval '1 minute', clock_timestamp() + interval '1 hour'), "
            "(%s, %s, %s, clock_timestamp() - interval '3651 days', clock_timestamp() - interval '3651 days' "
            "+ interval '1 second')",
            [found.key_a, found.owner_a, epoch, found.key_b, found.owner_b, epoch],
        )
        # key_a's history: a tenure force-released by a hostile operator, then the current grant.
        cursor.execute(
            "INSERT INTO pg_lease_django_tenure (key, epoch, owner, granted_at, ended_at, end_reason, ended_by, "
            "ended_by_role) VALUES "
            "(%s, %s, %s, clock_timestamp() - interval '5 minutes', clock_timestamp() - interval '2 minutes', "
            "'force_released', %s, %s), "
            "(%s, %s + 1, %s, clock_timestamp() - interval '1 minute', NULL, NULL, NULL, NULL)",
            [found.key_a, epoch, found.owner_b, found.operator, found.role, found.key_a, epoch, found.owner_a],
        )
    return found


def assert_shown_not_obeyed(text: str, *shown: str) -> None:
    """No character of ``text`` is one a terminal obeys, and each of ``shown`` appears escaped."""
    assert acted_on(text) == [], text
    for value in shown:
        assert printable(value) in text, (printable(value), text)


# -- the reading subcommands -------------------------------------------------------------------------


def test_list_shows_keys_and_owners_escaped_one_row_a_line_aligned_and_json_exact(tenants: Tenants) -> None:
    out, error = run("list", "--prefix", tenants.prefix)
    assert error == ""
    assert_shown_not_obeyed(out, tenants.key_a, tenants.owner_a, tenants.key_b, tenants.owner_b)
    assert r"\x1b[2J" in out and r"\u202e" in out and r"\x0d\x0a" in out and r"\x9b" in out
    header, row_a, row_b, summary = out.splitlines()  # no forged row: a lease is one line
    assert summary.startswith("2 leases")
    assert row_a.startswith(printable(tenants.key_a) + " ") and row_b.startswith(printable(tenants.key_b) + " ")
    # The columns are aligned on the escaped text: each starts where its heading does.
    for row, state, owner in ((row_a, "held", tenants.owner_a), (row_b, "lapsed", tenants.owner_b)):
        assert row[header.index("STATE") :].startswith(state + " ")
        assert row[header.index("OWNER") :].startswith(printable(owner) + " ")
        assert row[header.index("OWNER") - 2 : header.index("OWNER")] == "  "
    out, _ = run("list", "--prefix", tenants.prefix, "--json")
    leases = {lease["key"]: lease["owner"] for lease in json.loads(out)["leases"]}
    assert leases == {tenants.key_a: tenants.owner_a, tenants.key_b: tenants.owner_b}


def test_show_shows_the_key_and_owner_escaped_and_json_exact(tenants: Tenants) -> None:
    for key, owner in ((tenants.key_a, tenants.owner_a), (tenants.key_b, tenants.owner_b)):
        out, error = run("show", key)
        assert error == ""
        assert_shown_not_obeyed(out, key, owner)
        lines = out.splitlines()
        assert [line.split(":")[0] for line in lines] == [
            "key",
            "state",
            "owner",
            "epoch",
            "acquired at",
            "expires at",
            "server time",
        ]
        assert lines[0] == f"key:         {printable(key)}" and lines[2] == f"owner:       {printable(owner)}"
        document = json.loads(run("show", key, "--json")[0])
        assert (document["key"], document["owner"]) == (key, owner)


def test_history_shows_owners_operators_and_roles_escaped_and_json_exact(tenants: Tenants) -> None:
    out, error = run("history", tenants.key_a)
    assert error == ""
    assert_shown_not_obeyed(out, tenants.owner_a, tenants.owner_b, tenants.operator, tenants.role)
    header, forced, current, summary = out.splitlines()
    assert forced[header.index("OWNER") :].startswith(printable(tenants.owner_b) + " ")
    assert forced[header.index("ENDED BY") :].startswith(printable(tenants.operator) + " ")
    assert forced[header.index("DB ROLE") :].startswith(printable(tenants.role) + " ")
    assert current[header.index("OWNER") :].startswith(printable(tenants.owner_a) + " ")
    assert summary.startswith("2 tenures of ")
    tenures = json.loads(run("history", tenants.key_a, "--json")[0])["tenures"]
    assert [(t["owner"], t["ended_by"], t["ended_by_role"]) for t in tenures] == [
        (tenants.owner_b, tenants.operator, tenants.role),
        (tenants.owner_a, None, None),
    ]


def test_watch_once_shows_leases_and_transitions_escaped_and_json_exact(tenants: Tenants) -> None:
    out, error = run("watch", "--prefix", tenants.prefix, "--once")
    assert error == ""
    assert_shown_not_obeyed(out, tenants.key_a, tenants.owner_a, tenants.key_b, tenants.owner_b)
    lines = out.splitlines()
    assert lines[0].startswith("2 leases matching prefix")
    header, row_a, row_b = lines[1:4]
    assert row_a.startswith(printable(tenants.key_a) + " ") and row_b.startswith(printable(tenants.key_b) + " ")
    assert row_a[header.index("OWNER") :].startswith(printable(tenants.owner_a) + " ")
    assert lines[4:6] == ["", "Recent transitions (newest first):"]
    transitions = lines[6:]
    assert len(transitions) == 3  # two grants and a force release, a line each
    assert all(printable(tenants.key_a) in line for line in transitions)
    document = json.loads(run("watch", "--prefix", tenants.prefix, "--once", "--json")[0])
    assert {(lease["key"], lease["owner"]) for lease in document["leases"]} == {
        (tenants.key_a, tenants.owner_a),
        (tenants.key_b, tenants.owner_b),
    }
    assert {(t["key"], t["owner"]) for t in document["transitions"]} == {
        (tenants.key_a, tenants.owner_a),
        (tenants.key_a, tenants.owner_b),
    }


class _Terminal(io.StringIO):
    """A stream that says it is a terminal: ``watch`` draws its live (rich) view on it."""

    def isatty(self) -> bool:
        return True


class _OneFrame(Watcher):
    """A watcher that stops the watch after its first frame."""

    def __init__(self, prefix: str) -> None:
        super().__init__("default", prefix=prefix)
        self.done = threading.Event()

    def read(self) -> Frame:
        frame = super().read()
        self.done.set()
        return frame


# rich's own drawing on a terminal: SGR colours, cursor moves and line erasures (CSI ... letter), and
# the carriage returns it repositions with.
_RICH_CONTROLS = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def test_the_live_view_draws_keys_and_owners_escaped_never_as_markup(
    tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that rich neither wraps nor crops a cell
    watcher = _OneFrame(tenants.prefix)
    screen = _Terminal()
    watch(watcher, screen, what="the tenants", interval=0.01, stop=watcher.done)
    drawn = screen.getvalue()
    for payload in (CLEAR, TITLE, "\x07", CSI_C1, RLO):  # the tenants' sequences never reach the terminal raw
        assert payload not in drawn
    text = _RICH_CONTROLS.sub("", drawn)
    assert_shown_not_obeyed(text, tenants.key_a, tenants.owner_a, tenants.key_b, tenants.owner_b)
    row_a = next(line for line in text.splitlines() if printable(tenants.key_a) + " " in line)
    assert printable(tenants.owner_a) in row_a and "held" in row_a  # one lease, one line
    assert "[red]x[/red]" in text  # shown as written: rich did not read it as markup


# -- the writing subcommands -------------------------------------------------------------------------


def test_release_handoff_and_prune_report_keys_and_owners_escaped(tenants: Tenants) -> None:
    out, error = run("prune", "--free-for", "3650d", "--dry-run")
    assert error == ""
    assert_shown_not_obeyed(out, tenants.key_b)
    assert f"\n  {printable(tenants.key_b)}\n" in out + "\n"  # one key, one line
    keys = json.loads(run("prune", "--free-for", "3650d", "--dry-run", "--json")[0])["keys"]
    assert tenants.key_b in keys

    out, error = run("prune-history", "--older-than", "3650d\r\n", "--dry-run")
    assert error == "" and acted_on(out) == [] and out.count("\n") == 1, out

    for args in (
        ("release", tenants.key_a, "--dry-run"),
        ("release", tenants.key_a),  # refused without --force: the error names the holder
        ("release", tenants.key_a, "--epoch", "1", "--force"),  # moved on
        ("handoff", tenants.key_a),
        ("handoff", tenants.key_b),  # lapsed: nobody to ask
        ("release", tenants.key_a, "--force", "--operator", "ops"),
        ("release", tenants.key_a, "--force"),  # already free now
    ):
        out, error = run(*args)
        assert acted_on(out + error) == [], (args, out, error)
        assert out.count("\n") <= 1 and "\n" not in error, (args, out, error)
        assert repr(tenants.key_a) in out + error or repr(tenants.key_b) in out + error, (args, out, error)
    with connection.cursor() as cursor:
        cursor.execute("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = %s", [tenants.key_a])
        assert cursor.fetchone()[0] is None  # the forced release went through


def test_grant_check_names_roles_escaped(tenants: Tenants) -> None:
    present = f"t{uuid.uuid4().hex[:12]}{CLEAR}{RLO}"
    absent = f"gone{TITLE}{FORGED_ROW}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {connection.ops.quote_name(present)} NOLOGIN")  # undone with the test
    with override_settings(PG_LEASE_WORKER_ROLES=[present, absent]):
        out, error = run("grant", "--check")
    assert "grant(s) missing" in error
    assert_shown_not_obeyed(out + error, present, absent)
    assert f"role {printable(absent)} does not exist" in out.splitlines()
    assert any(line.startswith("GRANT ") and line.endswith(printable(f'"{present}"')) for line in out.splitlines())
    with override_settings(PG_LEASE_WORKER_ROLES=[absent]):
        _, error = run("grant")
    assert error.startswith("database error: declared lease roles ")
    assert_shown_not_obeyed(error, absent)


def test_a_database_error_quoting_a_key_is_shown_escaped(tenants: Tenants) -> None:
    # A role that may ask for hand-offs of its own keys only (the owner and superusers span every
    # key): the key scope's refusal quotes the key, shortened to its first 64 characters.
    role = f"pgl_{uuid.uuid4().hex[:10]}"
    with connection.cursor() as cursor:  # rolled back with the test's transaction, the role included
        cursor.execute(f'CREATE ROLE "{role}"')
        cursor.execute(f'GRANT EXECUTE ON FUNCTION pg_lease_request_handoff(text, bigint) TO "{role}"')
        cursor.execute("INSERT INTO pg_lease_django_key_scope (role, prefix) VALUES (%s, 'elsewhere/')", [role])
        cursor.execute(f'SET LOCAL SESSION AUTHORIZATION "{role}"')
    _, error = run("handoff", tenants.key_a)
    assert error.startswith("database error: key_scope: ")
    assert acted_on(error) == [], error
    assert printable(tenants.key_a[:64]) in error


# -- the admin ---------------------------------------------------------------------------------------


class _ShownText(HTMLParser):
    """What a browser shows of a page: its text, and the attributes it displays (tooltips, labels).

    Form values and ``data-`` attributes, which carry the exact strings back, are not shown.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.parts.extend(value or "" for name, value in attrs if name in ("title", "aria-label", "alt"))

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def found(pattern: str, text: str) -> str:
    """The first group of ``pattern``'s first match in ``text`` (which must match)."""
    match = re.search(pattern, text, re.S)
    assert match is not None, (pattern, text)
    return match[1]


def shown_text(page: str) -> str:
    parser = _ShownText()
    parser.feed(page)
    return "\n".join(parser.parts)


def test_the_admin_shows_keys_owners_and_operators_escaped(tenants: Tenants, admin_client: Client) -> None:
    """Django escapes HTML, not bidi overrides or controls: the pages show those escaped too."""
    changelist = admin_client.get(reverse("admin:pg_lease_django_lease_changelist"), {"q": tenants.prefix})
    assert_shown_not_obeyed(
        shown_text(changelist.content.decode()), tenants.key_a, tenants.owner_a, tenants.key_b, tenants.owner_b
    )
    tenure_list = admin_client.get(reverse("admin:pg_lease_django_leasetenure_changelist"), {"q": tenants.prefix})
    assert_shown_not_obeyed(shown_text(tenure_list.content.decode()), tenants.owner_a, tenants.operator)

    page = admin_client.get(reverse("admin:pg_lease_django_lease_change", args=[quote(tenants.key_a)]))
    assert page.status_code == 200
    text = shown_text(page.content.decode())
    assert_shown_not_obeyed(text, tenants.key_a, tenants.owner_a, tenants.owner_b, tenants.operator)
    # The snippets spell the key with escapes that Python, PostgreSQL and bash read back exactly.
    snippet = html.unescape(found(r"<pre[^>]*>(.*?)</pre>", page.content.decode()))
    python_key = found(r"acquire\((.*), \"my-worker-id\"", snippet)
    assert ast.literal_eval(python_key) == tenants.key_a
    sql_key = found(r"pg_lease_inspect\((.*)\);", snippet)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql_key}")  # the literal the page shows, as an operator would paste it
        assert cursor.fetchone()[0] == tenants.key_a
    shell_key = found(r"leases show ([^\n]*)\n", snippet)
    utf8 = {**os.environ, "LC_ALL": "C.UTF-8"}  # bash spells \u escapes in the locale's encoding
    echoed = subprocess.run(["bash", "-c", f"printf %s {shell_key}"], capture_output=True, check=True, env=utf8)
    assert echoed.stdout.decode() == tenants.key_a

    confirmation = admin_client.post(
        reverse("admin:pg_lease_django_lease_changelist"),
        {"action": "force_release", "_selected_action": [tenants.key_a, tenants.key_b], "index": "0"},
    )
    assert_shown_not_obeyed(
        shown_text(confirmation.content.decode()), tenants.key_a, tenants.owner_a, tenants.key_b, tenants.owner_b
    )
    confirmed = re.findall(r'name="confirmed" value="([^"]*)"', confirmation.content.decode())
    done = admin_client.post(
        reverse("admin:pg_lease_django_lease_changelist"),
        {
            "action": "force_release",
            "_selected_action": [tenants.key_a],
            "post": "yes",
            "confirmed": [value for value in map(html.unescape, confirmed) if value.endswith(tenants.key_a)],
        },
        follow=True,
    )
    messages = [str(message) for message in done.context["messages"]]
    assert messages and messages[0].startswith("Force-released 1 lease: ")
    assert acted_on(" ".join(messages)) == []  # the messages quote keys and owners with their escapes
    entry = LogEntry.objects.get(object_id=tenants.key_a)
    assert acted_on(entry.object_repr + entry.get_change_message()) == []


#: Issue 52: keys and owners are any non-empty text. Characters a person must not be shown raw, which
#: acquire() once refused (U+202E) or let through (U+00AD), and legitimate text that such a refusal
#: would break (an emoji family joined by U+200D): each round-trips, and every view escapes it.
INVISIBLE = {"rlo": "\u202e", "zwj": "\U0001f468\u200d\U0001f469\u200d\U0001f467", "shy": "soft\u00adhyphen"}
NEVER_RAW = ("\u202e", "\u200d", "\u00ad")


def test_keys_with_a_bidi_override_a_joiner_or_a_soft_hyphen_round_trip_and_show_escaped(
    key: str, admin_client: Client
) -> None:
    for name, text in INVISIBLE.items():
        lease_key, owner = f"{key}/{name}/{text}", f"w-{text}"
        grant = Lease.objects.acquire(lease_key, owner, ttl=60)
        assert grant is not None and (grant.key, grant.owner) == (lease_key, owner)
        state = Lease.objects.inspect(lease_key)
        assert (state.key, state.owner, state.epoch) == (lease_key, owner, grant.epoch)
        Lease.objects.renew(lease_key, owner, grant.epoch, ttl=60)
        shown = {
            "list": run("list", "--prefix", f"{key}/{name}/")[0],
            "show": run("show", lease_key)[0],
            "watch": run("watch", "--prefix", f"{key}/{name}/", "--once")[0],
            "admin": shown_text(
                admin_client.get(reverse("admin:pg_lease_django_lease_changelist"), {"q": key}).content.decode()
            ),
        }
        for view, out in shown.items():
            assert [c for c in NEVER_RAW if c in out] == [], (name, view)
            assert printable(lease_key) in out and printable(owner) in out, (name, view, out)
        for args in (("list", "--prefix", f"{key}/{name}/", "--json"), ("show", lease_key, "--json")):
            out = run(*args)[0]
            assert [c for c in NEVER_RAW if c in out] == [], (name, args)  # written \uXXXX
            document = json.loads(out)
            lease = document["leases"][0] if "leases" in document else document
            assert (lease["key"], lease["owner"]) == (lease_key, owner)
        Lease.objects.release(lease_key, owner, grant.epoch)
        assert Lease.objects.inspect(lease_key).status == "free"
    assert printable("a\ue000b\U000e0080") == "a\\ue000b\\U000e0080"  # private use, unassigned
