"""One multi-tenant deployment, whole (issues 42 and 46): docs/security.md's set-up followed step by
step on a fresh database, every seat played by its own role in its own process, then attacked.

The page's SQL and settings are what runs (its names swapped for this run's): the roles, a database
owned by the owner, ``migrate`` as the owner, the tenants' grants. Then, each in a real ``manage.py``
or Django process logging in as its role: each tenant's login member runs an ``@leased`` job that
writes a fenced row and answers the readiness probe; the monitoring role scrapes the database's view;
the operator runs ``leases watch --once --json``; the owner runs ``check`` (W008 and E006 silent).
Last, the attacks of issue 42 made from the tenants' and the operator's seats are refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql as pgsql

from devkit.dbserver import LocalServer, throwaway_datadir
from tests.helpers import conninfo, own_findings

# Its tests share one deployment (the module's fixture), so they run on one worker; they read the
# cluster-wide checks through own_findings (their own roles only), so they need not wait for the
# tests that make bypasses, except the one that grants a parameter to PUBLIC (below).
pytestmark = pytest.mark.xdist_group("deployment-whole")

# The module is named out of the server-version matrix (tests/tiers.py): most of its ~50 Django
# processes run commands whose SQL the matrix's in-process tests run on every major. The tests marked
# server_version run there too: what they see moves between majors (the page's grants and CREATE on
# public, the checks' catalog reads from every seat, CREATEROLE before 16).

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "security.md"
HEADING = "## Tenants: key scopes per role"
NAMES = ("app_owner", "tenant_a_web", "tenant_b_web", "tenant_a", "tenant_b", "app_operator", "app_monitor")


def page_blocks(language: str) -> list[str]:
    """The ```language blocks of the page's multi-tenant section, in order."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(HEADING) :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def statements(block: str) -> list[str]:
    return [s.strip() for s in block.split(";") if s.strip()]


@dataclass
class Deployment:
    """The deployment's database and its roles, as this run names them."""

    tag: str
    database: str
    roles: dict[str, str]  # the page's name -> this run's
    settings: dict[str, Any]  # the page's lease settings, renamed

    def swap(self, text: str) -> str:
        pattern = r"\b(" + "|".join((*NAMES, "billing_invoice")) + r")\b"
        return re.sub(pattern, lambda m: "testapp_invoice" if m[1] == "billing_invoice" else self.roles[m[1]], text)

    def url(self, page_role: str, database: str | None = None) -> str:
        server = psycopg.conninfo.conninfo_to_dict(conninfo())
        host, port = str(server.get("host") or "127.0.0.1"), str(server.get("port") or "5432")
        user, name = quote(self.roles[page_role], safe=""), database or self.database
        if host.startswith("/"):
            return f"postgresql://{user}@:{port}/{name}?host={quote(host, safe='')}"
        return f"postgresql://{user}@{host}:{port}/{name}"

    def connect(self, page_role: str) -> psycopg.Connection[Any]:
        return psycopg.connect(
            psycopg.conninfo.make_conninfo(conninfo(), user=self.roles[page_role], dbname=self.database),
            autocommit=True,
        )

    def run(
        self, page_role: str, *args: str, check: bool = True, database: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A Django process of the deployment, logging in as ``page_role`` (to ``database``: another one)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
        env.update(
            DJANGO_SETTINGS_MODULE="tests.children.deployment_settings",
            DATABASE_URL=self.url(page_role, database),
            PG_LEASE_DEPLOYMENT_SETTINGS=json.dumps(self.settings),
            PYTHONPATH=str(REPO),
        )
        done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if check:
            assert done.returncode == 0, f"{args} as {page_role}:\n{done.stdout}\n{done.stderr}"
        return done

    def script(self, page_role: str, code: str) -> Any:
        """Run ``code`` in a Django process as ``page_role``; its last line of output, as JSON."""
        done = self.run(page_role, "-c", "import django, json\ndjango.setup()\n" + code)
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    tag = uuid.uuid4().hex[:8]
    roles = {name: f"pgl_{tag}_{name}" for name in NAMES}
    made = Deployment(tag, f"pgl_{tag}_app", roles, {})
    admin = psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), dbname="postgres"), autocommit=True)
    created: list[str] = []
    try:
        # 1. Roles (cluster-wide), then the database the owner owns, then the page's schema steps in it.
        roles_sql, grants_sql = page_blocks("sql")
        schema_steps = []
        for statement in statements(made.swap(roles_sql)):
            if statement.startswith("CREATE ROLE"):
                admin.execute(statement)
                created.append(statement.split()[2])
            else:
                schema_steps.append(statement)
        admin.execute(
            pgsql.SQL("CREATE DATABASE {} OWNER {} TEMPLATE template0").format(
                pgsql.Identifier(made.database), pgsql.Identifier(roles["app_owner"])
            )
        )
        with psycopg.connect(
            psycopg.conninfo.make_conninfo(conninfo(), dbname=made.database), autocommit=True
        ) as superuser:
            for statement in schema_steps:
                superuser.execute(statement)
        # 2. The page's settings (and PG_LEASE_SCHEMA, step 4 of the page), then migrate as the owner.
        (settings_block,) = page_blocks("python")
        namespace: dict[str, Any] = {}
        exec(made.swap(settings_block), namespace)
        made.settings = {name: value for name, value in namespace.items() if name.startswith("PG_LEASE_")}
        made.settings["PG_LEASE_SCHEMA"] = "public"
        migrated = made.run("app_owner", "-m", "django", "migrate", "--noinput")
        assert "granted" in migrated.stdout and roles["tenant_a"] in migrated.stdout, migrated.stdout
        # 3. The tenants' own tables.
        with made.connect("app_owner") as owner:
            for statement in statements(made.swap(grants_sql)):
                owner.execute(statement)
        yield made
    finally:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [made.database],
        )
        admin.execute(pgsql.SQL("DROP DATABASE IF EXISTS {}").format(pgsql.Identifier(made.database)))
        for role in reversed(created):
            admin.execute(pgsql.SQL("DROP ROLE IF EXISTS {}").format(pgsql.Identifier(role)))
        admin.close()


JOB = """
from django.test import RequestFactory
from devkit.testapp.models import Invoice
from pg_lease_django import leased
from pg_lease_django.views import live, ready

@leased({key!r}, ttl=30)
def bill(amount):
    row = Invoice(account={key!r}, amount=amount)
    row.save()  # inside the hold of its lease: the hold's fence
    return row.pk, row.lease_epoch

pk, epoch = bill(7)
probes = [json.loads(view(RequestFactory().get("/")).content) for view in (ready, live)]
print(json.dumps({{"pk": pk, "epoch": epoch, "probes": probes}}))
"""

SCRAPE = """
import prometheus_client
from prometheus_client import CollectorRegistry
from pg_lease_django.metrics import database_view
registry = CollectorRegistry()
database_view.register(registry)
text = prometheus_client.generate_latest(registry).decode()
series = [line for line in text.splitlines() if line and not line.startswith("#")]
print(json.dumps({"up": [s for s in series if s.startswith("pg_lease_db_up")], "series": len(series), "text": text}))
"""


@pytest.mark.server_version
def test_the_multi_tenant_deployment_of_the_docs_works_from_every_seat_and_refuses_every_attack(
    deployment: Deployment,
) -> None:
    d = deployment
    prefixes = {tenant: d.settings["PG_LEASE_KEY_SCOPES"][d.roles[f"tenant_{tenant}"]][0] for tenant in "ab"}
    # Each tenant's login member runs an @leased job writing a fenced row; its probes answer ok, and
    # tell an anonymous caller nothing more.
    rows = {}
    for tenant in "ab":
        key = prefixes[tenant] + "invoices"
        done = d.script(f"tenant_{tenant}_web", JOB.format(key=key))
        assert done["epoch"] >= 1 and done["probes"] == [{"status": "ok"}, {"status": "ok"}], done
        rows[tenant] = (key, done["pk"])
    # The monitoring role scrapes the database's view: up, small, a series per tenant, no key in it.
    scraped = d.script("app_monitor", SCRAPE)
    assert scraped["up"] == ["pg_lease_db_up 1.0"] and scraped["series"] < 200, scraped
    for tenant in "ab":
        assert f'pg_lease_db_leases{{prefix="{prefixes[tenant]}",state="held"}}' in scraped["text"], scraped["text"]
    assert "invoices" not in scraped["text"]
    # The operator watches every tenant's leases.
    watched = json.loads(d.run("app_operator", "-m", "django", "leases", "watch", "--once", "--json").stdout)
    keys = json.dumps(watched)
    assert rows["a"][0] in keys and rows["b"][0] in keys
    # The owner's check: W008 and E006 have nothing to say about this deployment.
    checked = d.run("app_owner", "-m", "django", "check", "--database", "default", check=False)
    assert ours(checked, d.tag) == [], checked.stderr
    # The limits of the page are the database's.
    with d.connect("app_owner") as owner:
        limits = owner.execute(
            "SELECT role, max_leases, max_tenures_per_key FROM pg_lease_django_role_limit"
        ).fetchall()
    assert {role for role, *_ in limits} == {d.roles["tenant_a"], d.roles["tenant_b"]}

    # The attacks of issue 42, from the seats that made them.
    a_key, a_row = rows["a"]
    with d.connect("tenant_b_web") as b, d.connect("app_operator") as ops:
        for statement, params in (  # B uses A's key: read its holder, take it, present its fence
            ("SELECT * FROM public.pg_lease_inspect(%s::text)", [a_key]),
            ("SELECT * FROM public.pg_lease_acquire(%s::text, 'b'::text, '30 seconds'::interval)", [a_key]),
            ("SELECT public.pg_lease_check_fence(%s::text, 'x'::text, 1::bigint)", [a_key]),
        ):
            with pytest.raises(psycopg.Error) as refused:
                b.execute(statement, params)
            assert refused.value.sqlstate == "42501", statement
        b_key = prefixes["b"] + "planting"
        row = b.execute(
            "SELECT epoch FROM public.pg_lease_acquire(%s::text, 'b'::text, '30 seconds'::interval)", [b_key]
        )
        b_epoch = row.fetchone()[0]  # type: ignore[index]
        with pytest.raises(psycopg.Error) as refused, b.transaction():  # a row of A's account under B's key
            b.execute(
                "INSERT INTO testapp_invoice (account, status, amount, lease_key, lease_epoch) VALUES "
                "(%s, 'planted', 0, %s, (SELECT public.pg_lease_check_fence(%s::text, 'b'::text, %s::bigint)))",
                [a_key, b_key, b_key, b_epoch],
            )
        assert refused.value.sqlstate == "PL004"
        with pytest.raises(psycopg.Error) as refused, b.transaction():  # A's row, its fence forged
            b.execute("SELECT set_config('pg_lease.fences', %s, true)", [json.dumps({a_key: ["x", 1]})])
            b.execute("UPDATE testapp_invoice SET amount = 0 WHERE id = %s", [a_row])
        assert refused.value.sqlstate == "42501"
        with pytest.raises(psycopg.Error) as refused:  # the operator mints the owner's opt-out
            ops.execute("SELECT public.pg_lease_opt_out_token(%s::name)", [d.roles["app_owner"]])
        assert refused.value.sqlstate == "42501"
        with pytest.raises(psycopg.Error) as refused:  # bad input first, whatever the scope
            b.execute("SELECT * FROM public.pg_lease_inspect(%s::text)", ["x" * 300])
        assert refused.value.sqlstate == "22023"
        with pytest.raises(psycopg.Error) as refused:
            b.execute("SELECT count(*) FROM public.pg_lease_django_lease")  # no tenant reads the table
        assert refused.value.sqlstate == "42501"
    with d.connect("app_owner") as owner:
        stored = owner.execute("SELECT amount, lease_key FROM testapp_invoice WHERE id = %s", [a_row]).fetchone()
        planted = owner.execute("SELECT count(*) FROM testapp_invoice WHERE status = 'planted'").fetchone()
    assert stored == (7, a_key) and planted == (0,)


#: The system checks' own report, which commands that run the checks (migrate) print first: on a
#: shared server it may name other sessions' roles (cluster-wide findings), none of this test's.
CHECK_REPORT = re.compile(
    r"^(System check identified .*|WARNINGS:|ERRORS:|\?: \(pg_lease_django\.\w+\) .*|\s+HINT: .*)$"
)


def one_line(done: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    """The one line a command that failed as expected wrote to stderr: no traceback, no log noise."""
    lines = [line for line in done.stderr.splitlines() if line.strip() and not CHECK_REPORT.match(line)]
    assert done.returncode == status and len(lines) == 1, (done.returncode, done.stderr)
    assert all(word in lines[0] for word in words), (words, lines[0])
    return lines[0]


REFUSED_HOLDS = """
from pg_lease_django import hold, leased
errors = []
for timeout in (None, 1):
    try:
        with hold({key!r}, 10, blocking=timeout is not None, timeout=timeout):
            pass
    except Exception as exc:
        errors.append(type(exc).__name__)

@leased({key!r}, ttl=10)
def job():
    pass

try:
    job()
except Exception as exc:
    errors.append(type(exc).__name__)
print(json.dumps(errors))
"""


def test_a_worker_is_told_busy_timed_out_or_out_of_scope_in_one_line(deployment: Deployment) -> None:
    """Issue 51, items 1 and 3: ``leases run`` from a worker's seat exits 75 busy and 77 timed out,
    naming the holder through the inspect function (the lease table is the operators'); a key out of
    its scope is one line from ``leases run``, ``hold()`` and ``@leased``, nothing settled."""
    d = deployment
    prefixes = {tenant: d.settings["PG_LEASE_KEY_SCOPES"][d.roles[f"tenant_{tenant}"]][0] for tenant in "ab"}
    key = prefixes["a"] + "nightly"
    with d.connect("tenant_a_web") as a:
        a.execute("SELECT * FROM public.pg_lease_acquire(%s::text, 'other-host'::text, '60 seconds'::interval)", [key])
    run = ("-m", "django", "leases", "run")
    busy = d.run("tenant_a_web", *run, key, "--ttl", "10", "--", "true", check=False)
    one_line(busy, 75, "'other-host'", "epoch 1")
    waited = d.run("tenant_a_web", *run, key, "--ttl", "10", "--wait", "0.5", "--", "true", check=False)
    one_line(waited, 77, "timed out", "'other-host'")
    foreign = prefixes["b"] + "nightly"
    refused = d.run("tenant_a_web", *run, foreign, "--ttl", "10", "--", "true", check=False)
    one_line(refused, 1, "may not use lease key")
    refused = d.run("tenant_a_web", *run, foreign, "--ttl", "10", "--wait", "1", "--", "true", check=False)
    one_line(refused, 1, "may not use lease key")
    done = d.run("tenant_a_web", "-c", "import django, json\ndjango.setup()\n" + REFUSED_HOLDS.format(key=foreign))
    assert json.loads(done.stdout) == ["ProgrammingError"] * 3 and not done.stderr.strip(), done.stderr


SEATS = ("tenant_a_web", "app_operator", "app_monitor", "app_owner")


@pytest.mark.server_version
def test_check_is_silent_from_every_correctly_set_up_seat(deployment: Deployment) -> None:
    """Issue 51, item 2: ``check`` and ``check --database default`` (which docs/errors.md tells every
    seat to run) say nothing from a seat set up as the docs say: no crash where a role may not read
    ``django_migrations``, no W008 about what only the owner may compare."""
    d = deployment
    tenant = pgsql.Identifier(d.roles["tenant_a"])
    for readable in (False, True):  # and once a tenant may read which migrations are applied
        with d.connect("app_owner") as owner:
            owner.execute(
                pgsql.SQL("{} SELECT ON django_migrations {} {}").format(
                    pgsql.SQL("GRANT" if readable else "REVOKE"), pgsql.SQL("TO" if readable else "FROM"), tenant
                )
            )
        for seat in SEATS[: None if not readable else 1]:
            for args in (("check",), ("check", "--database", "default")):
                done = d.run(seat, "-m", "django", *args, check=False)
                assert done.returncode == 0 and "Traceback" not in done.stderr, (seat, args, done.stderr)
                assert ours(done, d.tag) == [], (seat, args, done.stderr)
    with d.connect("app_owner") as owner:
        owner.execute(pgsql.SQL("REVOKE SELECT ON django_migrations FROM {}").format(tenant))


def test_a_command_from_the_wrong_seat_names_the_seat_to_use(deployment: Deployment) -> None:
    """Issue 51, item 4: an operator's command as a worker, ``leases grant`` as the operator,
    ``migrate`` as a worker, an undeclared login role, sqlite, an unmigrated database with
    ``PG_LEASE_SCHEMA`` set: each is one line naming the role or the setting to use."""
    d = deployment
    owner, operator, web = d.roles["app_owner"], d.roles["app_operator"], d.roles["tenant_a_web"]
    key = d.settings["PG_LEASE_KEY_SCOPES"][d.roles["tenant_a"]][0] + "seats"
    one_line(
        d.run("tenant_a_web", "-m", "django", "leases", "list", check=False), 1, "PG_LEASE_OPERATOR_ROLES", operator
    )
    one_line(d.run("tenant_a_web", "-m", "django", "leases", "show", key, check=False), 1, operator, web)
    for args in (("grant",), ("grant", "--check")):
        one_line(d.run("app_operator", "-m", "django", "leases", *args, check=False), 1, f"as role {owner}")
    one_line(d.run("tenant_a_web", "-m", "django", "migrate", "--noinput", check=False), 1, f"as role {owner}")
    sqlite = d.run(
        "app_owner",
        "-m",
        "django",
        "leases",
        "run",
        key,
        "--ttl",
        "9",
        "--database",
        "sqlite",
        "--",
        "true",
        check=False,
    )
    one_line(sqlite, 2, "ENGINE is 'django.db.backends.postgresql'", "DATABASE_ROUTERS")
    stray, empty = f"pgl_{d.tag}_stray", f"pgl_{d.tag}_empty"
    d.roles["stray"] = stray
    with psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), dbname=d.database), autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(stray)))
        try:
            admin.execute(pgsql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(pgsql.Identifier(stray)))
            refused = d.run("stray", "-m", "django", "leases", "run", key, "--ttl", "9", "--", "true", check=False)
            one_line(refused, 1, f"role {stray} may not call", "PG_LEASE_WORKER_ROLES", f"as role {owner}")
            # An undeclared grant: `leases grant --check` points at the REVOKE it printed, not at itself.
            admin.execute(
                pgsql.SQL("GRANT SELECT ON public.pg_lease_django_lease TO {}").format(pgsql.Identifier(stray))
            )
            checked = d.run("app_owner", "-m", "django", "leases", "grant", "--check", check=False)
            assert "REVOKE SELECT ON" in checked.stdout and stray in checked.stdout, checked.stdout
            one_line(checked, 1, "run the REVOKE lines above")
            # An unmigrated database, PG_LEASE_SCHEMA set (as the page says): the error names migrate.
            admin.execute(
                pgsql.SQL("CREATE DATABASE {} OWNER {}").format(pgsql.Identifier(empty), pgsql.Identifier(owner))
            )
            unmigrated = d.run(
                "app_owner",
                "-m",
                "django",
                "leases",
                "run",
                key,
                "--ttl",
                "9",
                "--",
                "true",
                check=False,
                database=empty,
            )
            one_line(unmigrated, 1, "PG_LEASE_SCHEMA", "manage.py migrate")
        finally:
            admin.execute(pgsql.SQL("DROP DATABASE IF EXISTS {}").format(pgsql.Identifier(empty)))
            admin.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(stray)))
            admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(stray)))


class Frozen:
    """A throwaway PostgreSQL server the test may freeze (SIGSTOP) and thaw, and Django processes on it."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.postmaster = int((server.datadir / "postmaster.pid").read_text().split()[0])
        self.stopped: list[int] = []

    def env(self, **settings: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
        env.update(
            DJANGO_SETTINGS_MODULE="tests.children.deployment_settings",
            DATABASE_URL=self.server.url(),
            PG_LEASE_DEPLOYMENT_SETTINGS=json.dumps(settings),
            PYTHONPATH=str(REPO),
        )
        return env

    def freeze(self) -> None:
        # The postmaster first (it forks no one while stopped), then its children: each backend is
        # the leader of a process group of its own.
        children = subprocess.run(["pgrep", "-P", str(self.postmaster)], capture_output=True, text=True).stdout
        for pid in [self.postmaster, *map(int, children.split())]:
            with suppress(ProcessLookupError):  # a backend that ended meanwhile
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append(pid)

    def thaw(self) -> None:
        while self.stopped:
            with suppress(ProcessLookupError):
                os.kill(self.stopped.pop(), signal.SIGCONT)


@pytest.fixture
def frozen() -> Iterator[Frozen]:
    server = LocalServer(throwaway_datadir("frozen"))
    server.start()
    made = Frozen(server)
    try:
        yield made
    finally:
        made.thaw()
        server.destroy()


PROBES_FROZEN = """
import json, os, signal, sys
import django
django.setup()
from django.core.management import call_command
from django.test import RequestFactory
from pg_lease_django.views import live, ready

call_command("migrate", "pg_lease_django", verbosity=0)
def probe(view, method="get"):
    response = view(getattr(RequestFactory(), method)("/"))
    return [response.status_code, response.content.decode()]
answers = {"ready": probe(ready), "head": probe(ready, "head"), "live": probe(live)}
print(json.dumps(answers), flush=True)
sys.stdin.readline()  # the test freezes the server now
answers = {"ready": probe(ready), "again": probe(ready), "live": probe(live), "head": probe(live, "head")}
print(json.dumps(answers), flush=True)
"""


@pytest.mark.slow
@pytest.mark.cluster
def test_the_probes_answer_while_the_database_is_frozen(frozen: Frozen) -> None:
    """Issue 51, item 6: with PostgreSQL frozen (SIGSTOP), ``ready`` answers 503 past its own bound
    (``PG_LEASE_READY_TIMEOUT``), a second probe at once while the first check still hangs, and
    ``live`` answers 200 meanwhile; HEAD gets the status and no body. Before, ``ready`` waited for
    the database as long as it hung (the process below never answered)."""
    env = frozen.env(PG_LEASE_READY_TIMEOUT=5, PG_LEASE_HEALTH_DETAILS=True)  # room on a loaded machine
    child = subprocess.Popen(
        [sys.executable, "-c", PROBES_FROZEN],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        before = json.loads(child.stdout.readline())
        assert before["ready"][0] == 200 and before["live"][0] == 200, before
        assert before["head"] == [200, ""], before
        frozen.freeze()
        child.stdin.write("go\n")
        child.stdin.flush()
        # Without the bound the child never answers: communicate() times out and the test fails.
        out, _ = child.communicate(timeout=120)
        during = json.loads(out.strip().splitlines()[-1])
        assert during["ready"][0] == 503 and "PG_LEASE_READY_TIMEOUT" in during["ready"][1], during
        assert during["again"][0] == 503 and "has not returned" in during["again"][1], during
        assert during["live"][0] == 200 and during["head"] == [200, ""], during
    finally:
        frozen.thaw()
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.cluster
def test_leases_run_says_released_only_for_a_release_that_committed(frozen: Frozen) -> None:
    """Issue 51, item 7: stopped (SIGTERM) while the database does not answer, ``leases run`` said
    "released" after its release failed; it says the release did not complete and when the lease
    lapses, and exits with COMMAND's status."""
    env = frozen.env()
    django = [sys.executable, "-m", "django"]
    migrated = subprocess.run([*django, "migrate", "pg_lease_django", "-v", "0"], cwd=REPO, env=env, timeout=300)
    assert migrated.returncode == 0
    run = subprocess.Popen(
        [*django, "leases", "run", "stop:job", "--ttl", "6", "-v", "2", "--", "sleep", "60"],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stderr is not None
        started = [run.stderr.readline()]
        while "acquired 'stop:job'" not in started[-1] and started[-1] and len(started) < 20:
            started.append(run.stderr.readline())  # a warning may come before the grant
        assert "acquired 'stop:job'" in started[-1], started
        frozen.freeze()
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        frozen.thaw()
        run.kill()
        run.wait()
    assert run.returncode == 128 + signal.SIGTERM, (run.returncode, err)
    assert "released" not in err and "did not complete: the lease lapses at" in err, err
    assert "Traceback" not in err, err  # the failed release is one line of the log too


def ours(done: subprocess.CompletedProcess[str], tag: str) -> list[tuple[str, str, str]]:
    """The lease app's findings in ``done``'s output but those about another session's role (a
    cluster-wide check on a shared server sees every role; this test's are ``pgl_<tag>_...``)."""
    found = re.findall(r"\(pg_lease_django\.(\w+)\) (.*?)\n\s*HINT: (.*?)\n", done.stdout + done.stderr)
    return own_findings(found, tag, lambda finding: finding[1])


def findings(done: subprocess.CompletedProcess[str], *names: str) -> list[tuple[str, str, str]]:
    """The lease app's check findings (id, message, hint) that name one of ``names``: other tests'
    and other sessions' roles share the server, and cluster-wide checks see them too."""
    found = re.findall(r"\(pg_lease_django\.(\w+)\) (.*?)\n\s*HINT: (.*?)\n", done.stdout + done.stderr)
    return [(code, message, hint) for code, message, hint in found if any(name in message for name in names)]


@pytest.mark.server_version
def test_the_checks_see_the_mistakes_each_with_its_remedy(deployment: Deployment) -> None:
    """Issue 51, item 8: a tenant group declared an operator, a role limit on a login member (its
    scope is its group's: the limit applies to nothing), a privilege granted to a group (once,
    with the REVOKE that works: the group's, not each member's), a CREATEROLE role (before
    PostgreSQL 16), migrating as a superuser: each is a finding with the statement or setting that
    removes it. (A parameter granted to PUBLIC is the server's, and would let every role beside this
    test turn triggers off: tests/db/test_tenants.py reports it, in the group of the tests it concerns.)"""
    d = deployment
    tenant, crew, maker = d.roles["tenant_a"], f"pgl_{d.tag}_crew", f"pgl_{d.tag}_maker"
    saved = dict(d.settings)
    d.settings["PG_LEASE_OPERATOR_ROLES"] = [*saved["PG_LEASE_OPERATOR_ROLES"], tenant]
    d.settings["PG_LEASE_ROLE_LIMITS"] = {**saved["PG_LEASE_ROLE_LIMITS"], d.roles["tenant_a_web"]: {"leases": 5}}
    try:
        done = d.run("app_owner", "-m", "django", "check", check=False)
        [(code, message, hint)] = findings(done, f"{tenant!r} is declared an operator")
        [(limit, limited, cure)] = findings(done, f"limits role {d.roles['tenant_a_web']!r}")
    finally:
        d.settings = saved
    assert code == "W008" and "PG_LEASE_OPERATOR_ROLES" in message and f"Remove {tenant!r}" in hint, message
    assert limit == "W008" and "limits nothing" in limited and "group role" in cure, (limited, cure)
    with psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), dbname=d.database), autocommit=True) as admin:
        for statement in (
            pgsql.SQL("CREATE ROLE {} NOLOGIN").format(pgsql.Identifier(crew)),
            pgsql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(pgsql.Identifier(crew + "_1"), pgsql.Identifier(crew)),
            pgsql.SQL("CREATE ROLE {} LOGIN CREATEROLE").format(pgsql.Identifier(maker)),
            pgsql.SQL("GRANT SELECT ON public.pg_lease_django_lease TO {}").format(pgsql.Identifier(crew)),
        ):
            admin.execute(statement)
        try:
            checked = d.run("app_owner", "-m", "django", "check", "--database", "default", check=False)
        finally:
            for role in (crew + "_1", crew, maker):
                admin.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
                admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
        version = admin.info.server_version
    [(code, message, hint)] = findings(checked, crew)  # once, the group's: none for its member
    assert code == "W008" and f'REVOKE SELECT ON TABLE pg_lease_django_lease FROM "{crew}"' in hint, hint
    made = findings(checked, maker)
    if version < 160000:
        [(code, message, hint)] = made
        assert "CREATEROLE" in message and f'ALTER ROLE "{maker}" NOCREATEROLE' in hint, (message, hint)
    else:
        assert made == [], made  # from 16 on, CREATEROLE grants no membership of roles it did not create
    # Migrating as a superuser: the lease functions would run as one.
    fresh = f"pgl_{d.tag}_super"
    with psycopg.connect(psycopg.conninfo.make_conninfo(conninfo(), dbname="postgres"), autocommit=True) as admin:
        superuser = admin.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(fresh)))
        d.roles["superuser"] = superuser
        try:
            d.run("superuser", "-m", "django", "migrate", "--noinput", "-v", "0", database=fresh)
            checked = d.run("superuser", "-m", "django", "check", "--database", "default", database=fresh, check=False)
        finally:
            admin.execute(pgsql.SQL("DROP DATABASE {} WITH (FORCE)").format(pgsql.Identifier(fresh)))
    [(code, message, hint)] = findings(checked, f"superuser {superuser!r}")
    assert "not a superuser" in hint and "OWNER TO" in hint, hint


def test_each_seat_runs_its_documented_commands_with_the_documented_exit_status(deployment: Deployment) -> None:
    """Issue 51: every documented command from every seat, its exit status, and for a refusal one
    line without a traceback (the other tests of this module look closer at each)."""
    d = deployment
    key = d.settings["PG_LEASE_KEY_SCOPES"][d.roles["tenant_a"]][0] + "matrix"
    leases, run = ("-m", "django", "leases"), ("-m", "django", "leases", "run", key, "--ttl", "10")
    table: list[tuple[str, tuple[str, ...], int]] = [
        ("app_owner", ("-m", "django", "migrate", "--noinput"), 0),
        ("app_owner", (*leases, "grant"), 0),
        ("app_owner", (*leases, "grant", "--check"), 0),
        ("app_owner", ("-m", "django", "check", "--database", "default"), 0),
        ("tenant_a_web", ("-m", "django", "check", "--database", "default"), 0),
        ("tenant_a_web", (*run, "--", "true"), 0),
        ("tenant_a_web", (*run, "--", "sh", "-c", "exit 3"), 3),
        ("tenant_a_web", ("-m", "django", "leased_job", key), 0),
        ("tenant_a_web", (*leases, "list"), 1),
        ("tenant_a_web", (*leases, "grant"), 1),
        ("tenant_a_web", ("-m", "django", "migrate", "--noinput"), 1),
        ("app_operator", ("-m", "django", "check", "--database", "default"), 0),
        ("app_operator", (*leases, "list"), 0),
        ("app_operator", (*leases, "show", key), 0),
        ("app_operator", (*leases, "watch", "--once", "--json"), 0),
        ("app_operator", (*leases, "grant"), 1),
        ("app_monitor", ("-m", "django", "check", "--database", "default"), 0),
        ("app_monitor", (*leases, "list"), 1),
    ]
    busy: list[tuple[str, tuple[str, ...], int]] = [  # a holder elsewhere: busy, a wait that runs out
        ("tenant_a_web", (*run, "--", "true"), 75),
        ("tenant_a_web", (*run, "--wait", "0.5", "--", "true"), 77),
        ("app_operator", (*leases, "handoff", key), 0),
        ("app_operator", (*leases, "release", key, "--force"), 0),
    ]
    seen = []
    for seat, args, status in table + busy:
        if (seat, args, status) == busy[0]:
            with d.connect("tenant_a_web") as worker:
                worker.execute(
                    "SELECT * FROM public.pg_lease_acquire(%s::text, 'elsewhere'::text, '60 seconds')", [key]
                )
        done = d.run(seat, *args, check=False)
        seen.append((seat, " ".join(args[2:]), done.returncode))
        assert done.returncode == status, (seat, args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (seat, args, done.stderr)
        if status not in (0, 3):
            one_line(done, status)
    print("\n".join(f"{seat:>14}  {status:>3}  {command}" for seat, command, status in seen))
