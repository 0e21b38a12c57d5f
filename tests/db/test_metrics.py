"""Prometheus metrics (`pg_lease_django.metrics`): scraped over real HTTP after real holds.

Each test labels its keys with a prefix of its own, so the series it reads start at zero whatever
else this process held before: every count asserted is exactly what the scenario implies.
"""

from __future__ import annotations

import http.server
import io
import itertools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections
from django.test import override_settings
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from devkit.dbserver import free_port
from devkit.testapp.models import Entry
from pg_lease_django import (
    Lease,
    LeaseError,
    LeaseLostError,
    LeaseTimeoutError,
    NotAcquirableError,
    conf,
    hold,
    metrics,
)
from pg_lease_django.checks import check_metrics_settings
from pg_lease_django.metrics import database_view, hooks, instruments, push
from pg_lease_django.provisioning.history import sync_scope
from tests.helpers import Background, held, lapsed, url_of_test_database, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
_counter = itertools.count()


#: Behind a transaction-pooling PgBouncer blocking waiters poll: nothing registers (docs/jobs.md).
BEHIND_PGBOUNCER = bool(os.environ.get("PG_LEASE_TEST_PGBOUNCER"))


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return str(response.read().decode())


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``, 0 when absent (a counter never incremented has no child)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def served() -> Iterator[Callable[[], Samples]]:
    """prometheus_client's own HTTP server on an ephemeral port, serving the default registry."""
    assert hooks.installed(), "the app's ready() registers the metrics when prometheus_client is installed"
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1")
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    yield lambda: parse(scrape_text(url))
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


@pytest.fixture
def prefix() -> str:
    return f"m{uuid.uuid4().hex[:12]}n{next(_counter)}"


def test_every_counter_is_at_the_value_the_scenario_implies(served: Callable[[], Samples], prefix: str) -> None:
    p = prefix
    # Two grants and two refusals (busy, then a blocking wait that times out) while one is held.
    with hold(f"{p}:a", ttl=10) as a:
        busy = Background(lambda: hold(f"{p}:a", ttl=10).__enter__())
        busy.start()
        busy.join(timeout=60)
        assert isinstance(busy.error, NotAcquirableError)
        waited = Background(lambda: hold(f"{p}:a", ttl=10, blocking=True, timeout=0.3).__enter__())
        waited.start()
        waited.join(timeout=60)
        assert isinstance(waited.error, LeaseTimeoutError)
        during = served()
        assert value(during, "pg_lease_holds", prefix=p) == 1
        assert a.epoch >= 1
    # A lost hold: an operator force-releases it; the next renewal hears the verdict. A fenced write
    # with the stale lease is then refused by the database.
    with hold(f"{p}:b", ttl=0.6) as b:
        Lease.objects.force_release(f"{p}:b")
        assert b.wait_lost(timeout=60)
        assert b.error is not None
        lost_code = b.error.code
        with pytest.raises(LeaseError) as refusal:
            Entry(account=f"{p}:b", writer="stale").save(fence=b)
    # A hand-off: asked to step down, the holder learns at its next renewal, then releases.
    with hold(f"{p}:c", ttl=0.6) as c:
        Lease.objects.request_handoff(f"{p}:c")
        assert c.wait_stop(timeout=60)
        assert c.handoff_requested and not c.lost
    after = served()

    assert value(after, "pg_lease_grants_total", prefix=p) == 3
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="busy") == 1
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=p, outcome="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_sum", prefix=p, outcome="timeout") >= 0.3
    assert value(after, "pg_lease_releases_total", prefix=p) == 2  # a and c
    assert value(after, "pg_lease_lapses_total", prefix=p) == 0
    assert value(after, "pg_lease_losses_total", prefix=p, reason=lost_code) == 1
    assert value(after, "pg_lease_handoffs_total", prefix=p) == 1
    assert value(after, "pg_lease_fenced_writes_refused_total", prefix=p, reason=refusal.value.code) == 1
    assert value(after, "pg_lease_holds", prefix=p) == 0
    # c renewed at least once (that is how it heard of the hand-off); every renewal has its latency and slack.
    renewals = value(after, "pg_lease_renewals_total", prefix=p)
    assert renewals >= 1
    assert value(after, "pg_lease_renewal_latency_seconds_count", prefix=p) == renewals
    assert value(after, "pg_lease_renewal_slack_seconds_count", prefix=p) == renewals
    # The database's view, in the same scrape: the three keys are free now.
    assert value(after, "pg_lease_db_up") == 1
    assert value(after, "pg_lease_db_leases", prefix=p, state="free") == 3
    assert value(after, "pg_lease_db_leases", prefix=p, state="held") == 0


def test_an_election_counts_its_campaign_and_its_term(served: Callable[[], Samples], prefix: str) -> None:
    from pg_lease_django import current_election, elect

    def lead(lease: Any) -> None:
        election = current_election()
        assert election is not None
        election.wait_stop()

    election = elect(f"{prefix}:leader", ttl=5, on_started_leading=lead, on_stopped_leading=lambda: None)
    try:
        wait_until(lambda: election.leading, timeout=60, what="the election to lead")
        during = served()
        assert value(during, "pg_lease_elections", prefix=prefix) == 1
        assert value(during, "pg_lease_leaderships", prefix=prefix) == 1
        assert value(during, "pg_lease_holds", prefix=prefix) == 1
    finally:
        election.stop()
        assert election.join(timeout=60)
    after = served()
    assert value(after, "pg_lease_elections", prefix=prefix) == 0
    assert value(after, "pg_lease_leaderships", prefix=prefix) == 0
    assert value(after, "pg_lease_grants_total", prefix=prefix) == 1
    assert value(after, "pg_lease_releases_total", prefix=prefix) == 1


def test_the_database_view_counts_states_lapses_waiters_and_tenures(served: Callable[[], Samples], prefix: str) -> None:
    p = prefix
    with override_settings(PG_LEASE_HISTORY=[f"{p}:"]):
        sync_scope()
        try:
            held(f"{p}:held", "w1")
            lapsed(f"{p}:lapsed-1", "w2")
            lapsed(f"{p}:lapsed-2", "w3")
            epoch = held(f"{p}:free", "w4")
            Lease.objects.release(f"{p}:free", "w4", epoch)

            # A blocking waiter registers (LISTEN) while the key is held.
            def wait() -> Any:
                try:
                    return Lease.objects.acquire(f"{p}:held", "w5", ttl=10, blocking=True, timeout=60)
                finally:
                    connections.close_all()  # this thread's own

            waiter = Background(wait)
            waiter.start()
            if not BEHIND_PGBOUNCER:  # a pooled session cannot LISTEN: there the waiter polls, registering nothing
                wait_until(lambda: value(served(), "pg_lease_db_waiters", prefix=p) == 1, timeout=60, what="a waiter")
            samples = served()
            Lease.objects.release(f"{p}:held", "w1", Lease.objects.inspect(f"{p}:held").epoch)
            waiter.join(timeout=60)
            assert waiter.error is None and waiter.result is not None
            after = served()
        finally:
            with override_settings(PG_LEASE_HISTORY=[]):
                sync_scope()
    assert value(samples, "pg_lease_db_leases", prefix=p, state="held") == 1
    assert value(samples, "pg_lease_db_leases", prefix=p, state="lapsed") == 2
    assert value(samples, "pg_lease_db_leases", prefix=p, state="free") == 1
    assert value(samples, "pg_lease_db_oldest_lapse_seconds", prefix=p) > 0
    assert value(samples, "pg_lease_db_tenures_ended", prefix=p, reason="released") == 1
    assert value(after, "pg_lease_db_leases", prefix=p, state="held") == 1  # the waiter's grant
    assert value(after, "pg_lease_db_waiters", prefix=p) == 0
    assert value(after, "pg_lease_db_tenures_ended", prefix=p, reason="released") == 2
    # With history off the tenures are not read (a constant false filter: no scan).
    assert value(served(), "pg_lease_db_tenures_ended", prefix=p, reason="released") == 0


def test_a_callable_label_leaves_the_database_view_to_the_databases_rule(prefix: str) -> None:
    """Issue 51: the database's view labels by the rule the database holds (no caller chooses it,
    and no per-key read only the owner could make): a callable labels this process's metrics."""
    held(f"{prefix}/x:1")
    held(f"{prefix}/y:2")
    registry = CollectorRegistry()
    with override_settings(PG_LEASE_METRICS_KEY_LABEL="tests.db.test_metrics.slash_label"):
        database_view.register(registry)
        samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "pg_lease_db_up") == 1
    assert value(samples, "pg_lease_db_leases", prefix=f"{prefix}/x", state="held") == 1


def slash_label(key: str) -> str:
    return key.split("/", 1)[0]


def test_a_database_that_cannot_be_read_is_reported_not_raised() -> None:
    registry = CollectorRegistry()
    database_view.register(registry, using="other")  # a database alias without the lease table
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "pg_lease_db_up") == 0


@pytest.mark.parametrize("bad", ["", "::", "no.such.module.label", 3])
def test_a_bad_key_label_setting_is_a_system_check_error(bad: object) -> None:
    with override_settings(PG_LEASE_METRICS_KEY_LABEL=bad):
        with pytest.raises(ImproperlyConfigured):
            from pg_lease_django import conf

            conf.metrics_key_label()
        [error] = check_metrics_settings()
    assert error.id == "pg_lease_django.E005"
    assert check_metrics_settings() == []


def test_the_default_label_is_the_text_before_the_first_colon() -> None:
    assert hooks.key_label("billing:acme:42") == "billing"
    # Keys without the separator share one label: a tenant's junk keys cannot make a series each.
    assert hooks.key_label("nightly-billing") == metrics.NO_PREFIX_LABEL == "(none)"
    assert hooks.key_label("invoice-81723") == "(none)"
    assert metrics.OTHER_LABEL == "(other)"


@pytest.fixture
def reinstalled() -> Iterator[Callable[[], CollectorRegistry]]:
    """Install the metrics afresh (no label seen yet) in a registry of the test's own; the default one after."""

    def install() -> CollectorRegistry:
        hooks.uninstall()
        registry = CollectorRegistry()
        assert hooks.install(registry)
        return registry

    try:
        yield install
    finally:
        hooks.uninstall()
        hooks.install()


def _pair(key: str, owner: str = "w1") -> None:
    grant = Lease.objects.acquire(key, owner, ttl=30)
    assert grant is not None
    Lease.objects.release(key, owner, grant.epoch)


def _prefixes(registry: CollectorRegistry) -> set[str]:
    return {sample.labels["prefix"] for family in registry.collect() for sample in family.samples if sample.labels}


def test_a_process_exports_at_most_max_labels_prefixes_and_counts_the_rest_under_other(
    reinstalled: Callable[[], CollectorRegistry], prefix: str
) -> None:
    with override_settings(PG_LEASE_METRICS_MAX_LABELS=3):
        registry = reinstalled()
        for n in range(20):  # one tenant's junk keys, without the separator: one label between them
            _pair(f"{prefix}junk{n}")
        for n in range(5):  # five families of keys: two more labels fit under the cap, three do not
            _pair(f"{prefix}f{n}:job")
        with hold(f"{prefix}f0:held", ttl=10):  # an admitted label stays admitted
            pass
        with hold(f"{prefix}f4:held", ttl=10):
            pass
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert _prefixes(registry) == {"(none)", f"{prefix}f0", f"{prefix}f1", "(other)"}
    assert value(samples, "pg_lease_grants_total", prefix="(none)") == 20
    assert value(samples, "pg_lease_releases_total", prefix="(none)") == 20
    assert value(samples, "pg_lease_grants_total", prefix=f"{prefix}f0") == 2
    assert value(samples, "pg_lease_grants_total", prefix=f"{prefix}f1") == 1
    assert value(samples, "pg_lease_grants_total", prefix="(other)") == 4  # f2, f3, f4 and f4's hold
    assert value(samples, "pg_lease_releases_total", prefix="(other)") == 4


def test_a_callable_label_rule_is_capped_the_same_way(
    reinstalled: Callable[[], CollectorRegistry], prefix: str
) -> None:
    with override_settings(
        PG_LEASE_METRICS_KEY_LABEL="pg_lease_django.metrics.whole_key", PG_LEASE_METRICS_MAX_LABELS=2
    ):
        registry = reinstalled()
        for n in range(6):
            _pair(f"{prefix}:{n}")
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert _prefixes(registry) == {f"{prefix}:0", f"{prefix}:1", "(other)"}
    assert value(samples, "pg_lease_grants_total", prefix="(other)") == 4


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("PG_LEASE_METRICS_MAX_LABELS", 0),
        ("PG_LEASE_METRICS_MAX_LABELS", True),
        ("PG_LEASE_METRICS_MAX_LABELS", "16"),
        ("PG_LEASE_METRICS_PUSHGATEWAY", ""),
        ("PG_LEASE_METRICS_PUSHGATEWAY", 9091),
    ],
)
def test_a_bad_label_cap_or_pushgateway_setting_is_refused_when_read(name: str, bad: object) -> None:
    read = conf.metrics_max_labels if name.endswith("LABELS") else conf.metrics_pushgateway
    with override_settings(**{name: bad}), pytest.raises(ImproperlyConfigured, match=name):
        read()


# ---- every lease call is counted once, whichever API made it -------------------------------------


def test_every_call_of_the_manager_is_counted_once(served: Callable[[], Samples], prefix: str) -> None:
    p = prefix
    grant = Lease.objects.acquire(f"{p}:a", "w1", ttl=30)
    assert grant is not None
    assert Lease.objects.acquire(f"{p}:a", "w2", ttl=30) is None  # busy
    with pytest.raises(LeaseTimeoutError):
        Lease.objects.acquire(f"{p}:a", "w2", ttl=30, blocking=True, timeout=0.2)
    Lease.objects.renew(f"{p}:a", "w1", grant.epoch, ttl=30)
    Lease.objects.release(f"{p}:a", "w1", grant.epoch)
    with pytest.raises(LeaseLostError) as late_renewal:
        Lease.objects.renew(f"{p}:a", "w1", grant.epoch, ttl=30)  # released: not this owner's any more
    with pytest.raises(LeaseLostError) as late_release:
        Lease.objects.release(f"{p}:a", "w1", grant.epoch)
    # A blocking acquire that waits for the holder's expiry, and is granted.
    assert Lease.objects.acquire(f"{p}:b", "w1", ttl=0.3) is not None
    Lease.objects.acquire(f"{p}:b", "w2", ttl=30, blocking=True, timeout=60)
    after = served()

    assert value(after, "pg_lease_grants_total", prefix=p) == 3
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="busy") == 1
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=p, outcome="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=p, outcome="granted") == 1
    assert value(after, "pg_lease_renewals_total", prefix=p) == 1
    assert value(after, "pg_lease_releases_total", prefix=p) == 1
    assert late_renewal.value.code == late_release.value.code == "not_owner"
    assert value(after, "pg_lease_losses_total", prefix=p, reason="not_owner") == 2
    assert value(after, "pg_lease_holds", prefix=p) == 0  # the gauge is the holds'


def test_every_call_of_the_async_manager_is_counted_once(served: Callable[[], Samples], prefix: str) -> None:
    p = prefix

    async def scenario() -> str:
        grant = await Lease.objects.aacquire(f"{p}:a", "w1", ttl=30)
        assert grant is not None
        assert await Lease.objects.aacquire(f"{p}:a", "w2", ttl=30) is None  # busy
        with pytest.raises(LeaseTimeoutError):  # on a connection of the waiter's own
            await Lease.objects.aacquire(f"{p}:a", "w2", ttl=30, blocking=True, timeout=0.2)
        await Lease.objects.arenew(f"{p}:a", "w1", grant.epoch, ttl=30)
        await Lease.objects.arelease(f"{p}:a", "w1", grant.epoch)
        with pytest.raises(LeaseLostError) as late:
            await Lease.objects.arelease(f"{p}:a", "w1", grant.epoch)
        assert await Lease.objects.aacquire(f"{p}:b", "w1", ttl=0.3) is not None
        await Lease.objects.aacquire(f"{p}:b", "w2", ttl=30, blocking=True, timeout=60)
        return late.value.code

    code = async_to_sync(scenario)()
    after = served()
    assert value(after, "pg_lease_grants_total", prefix=p) == 3
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="busy") == 1
    assert value(after, "pg_lease_refusals_total", prefix=p, reason="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=p, outcome="timeout") == 1
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=p, outcome="granted") == 1
    assert value(after, "pg_lease_renewals_total", prefix=p) == 1
    assert value(after, "pg_lease_releases_total", prefix=p) == 1
    assert value(after, "pg_lease_losses_total", prefix=p, reason=code) == 1


def test_a_blocking_hold_that_waits_counts_one_grant_and_one_wait(served: Callable[[], Samples], prefix: str) -> None:
    key = f"{prefix}:k"
    assert Lease.objects.acquire(key, "other", ttl=0.3) is not None  # lapses: the hold gets it then
    with hold(key, ttl=10, blocking=True, timeout=60) as lease:
        assert lease.epoch >= 2
    after = served()
    assert value(after, "pg_lease_grants_total", prefix=prefix) == 2
    assert value(after, "pg_lease_refusals_total", prefix=prefix, reason="busy") == 0
    assert value(after, "pg_lease_blocking_wait_seconds_count", prefix=prefix, outcome="granted") == 1
    assert value(after, "pg_lease_releases_total", prefix=prefix) == 1
    assert value(after, "pg_lease_holds", prefix=prefix) == 0


# ---- short-lived processes: their metrics leave with them ----------------------------------------


Received = list[tuple[str, str, str]]  # method, path, body


@pytest.fixture
def pushgateway() -> Iterator[tuple[str, Received]]:
    """A real HTTP receiver in place of a Pushgateway: it keeps what each request pushed and answers 200."""
    received: Received = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            received.append((self.command, self.path, body))
            self.send_response(200)
            self.end_headers()

        do_POST = do_PUT

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def _short_lived(how: str, key: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a real ``manage.py`` child that holds ``key`` once and exits: ``leases run`` or an ``@leased`` command."""
    argv = {
        "leases run": ["leases", "run", key, "--ttl", "10", "--", sys.executable, "-c", "pass"],
        "@leased command": ["leased_job", key],
    }[how]
    environment = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "django", *argv],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("how", ["leases run", "@leased command"])
def test_a_short_lived_process_pushes_its_counts_to_the_pushgateway_at_exit(
    pushgateway: tuple[str, Received], prefix: str, how: str
) -> None:
    url, received = pushgateway
    _short_lived(how, f"{prefix}:nightly", PG_LEASE_TEST_PUSHGATEWAY=url)
    # One group per key label, replaced by the next run of the same job on this host (PUT).
    [(method, path, body)] = received
    assert method == "PUT"
    assert path == f"/metrics/job/pg_lease_django/instance/{socket.gethostname()}/prefix/{prefix}"
    pushed = parse(body)
    assert value(pushed, "pg_lease_grants_total", prefix=prefix) == 1
    assert value(pushed, "pg_lease_releases_total", prefix=prefix) == 1
    assert value(pushed, "pg_lease_holds", prefix=prefix) == 0
    assert all(dict(labels)["prefix"] == prefix for (_name, labels) in pushed)  # this label's series only


@pytest.mark.slow
def test_a_process_that_sigterm_ends_pushes_its_counts_before_it_dies(
    pushgateway: tuple[str, Received], prefix: str
) -> None:
    """SIGTERM unwinds an @leased job (its lease released), then ends the process by SIGTERM: no atexit."""
    url, received = pushgateway
    env = {
        **os.environ,
        "DATABASE_URL": url_of_test_database(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PG_LEASE_TEST_PUSHGATEWAY": url,
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "django", "leased_job", f"{prefix}:nightly", "--until-signalled"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "holding"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    [(method, _path, body)] = received
    pushed = parse(body)
    assert method == "PUT"
    assert value(pushed, "pg_lease_grants_total", prefix=prefix) == 1
    assert value(pushed, "pg_lease_releases_total", prefix=prefix) == 1


@pytest.mark.slow
def test_a_short_lived_process_on_the_host_leaves_its_counts_in_the_multiprocess_directory(
    tmp_path: Path, prefix: str
) -> None:
    from prometheus_client import multiprocess

    _short_lived("leases run", f"{prefix}:nightly", PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    _short_lived("@leased command", f"{prefix}:hourly", PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "pg_lease_grants_total", prefix=prefix) == 2  # the two runs add up
    assert value(samples, "pg_lease_releases_total", prefix=prefix) == 2
    assert value(samples, "pg_lease_holds", prefix=prefix) == 0
    # Each exit marked its process dead: no live gauge of a gone process is summed at the next scrape.
    assert not list(tmp_path.glob("gauge_live*"))


def test_push_sends_one_group_per_label_and_nothing_when_nothing_was_counted(
    reinstalled: Callable[[], CollectorRegistry], pushgateway: tuple[str, Received], prefix: str
) -> None:
    url, received = pushgateway
    reinstalled()
    with override_settings(PG_LEASE_METRICS_PUSHGATEWAY=url):
        assert push.push()
        assert received == []  # nothing counted: nothing to push
        _pair(f"{prefix}a:1")
        _pair(f"{prefix}a:2")
        _pair(f"{prefix}b:1")
        assert push.push()
    by_path = {path.rsplit("/", 1)[1]: parse(body) for _method, path, body in received}
    assert set(by_path) == {f"{prefix}a", f"{prefix}b"}
    assert value(by_path[f"{prefix}a"], "pg_lease_grants_total", prefix=f"{prefix}a") == 2
    assert value(by_path[f"{prefix}a"], "pg_lease_grants_total", prefix=f"{prefix}b") == 0
    assert value(by_path[f"{prefix}b"], "pg_lease_releases_total", prefix=f"{prefix}b") == 1


def test_a_push_that_fails_is_logged_never_raised_and_bounded_by_its_timeout(
    reinstalled: Callable[[], CollectorRegistry],
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reinstalled()
    _pair(f"{prefix}:job")
    caplog.set_level(logging.WARNING, logger="pg_lease_django.metrics.push")
    with override_settings(PG_LEASE_METRICS_PUSHGATEWAY=f"http://127.0.0.1:{free_port()}"):  # nothing listens
        assert push.push() is False
    # A gateway that accepts the connection and never answers: the push gives up at its timeout.
    monkeypatch.setattr(push, "PUSH_TIMEOUT", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with override_settings(PG_LEASE_METRICS_PUSHGATEWAY=f"http://127.0.0.1:{silent.getsockname()[1]}"):
            pushing = Background(push.push)
            pushing.start()
            assert pushing.outcome(timeout=60) is False
    assert len([r for r in caplog.records if "pushing the lease metrics" in r.getMessage()]) == 2


@pytest.mark.slow
def test_multiprocess_mode_sums_two_worker_processes(tmp_path: Path, prefix: str) -> None:
    """Two real workers with PROMETHEUS_MULTIPROC_DIR; the parent serves their sum over HTTP."""
    from prometheus_client import multiprocess

    env = {
        **os.environ,
        "DATABASE_URL": url_of_test_database(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
    }
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.children.metrics_child", f"{prefix}:w{n}"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert json.loads(worker.stdout.readline())["event"] == "holding"
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
        server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        try:
            during = parse(scrape_text(url))
            assert value(during, "pg_lease_grants_total", prefix=prefix) == 2
            assert value(during, "pg_lease_holds", prefix=prefix) == 2
            for worker in workers:
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.close()
                assert json.loads(worker.stdout.readline())["event"] == "released"
                assert worker.wait(timeout=60) == 0
                multiprocess.mark_process_dead(worker.pid, str(tmp_path))  # type: ignore[no-untyped-call]
            after = parse(scrape_text(url))
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=30)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert value(after, "pg_lease_grants_total", prefix=prefix) == 2
    assert value(after, "pg_lease_releases_total", prefix=prefix) == 2
    assert value(after, "pg_lease_holds", prefix=prefix) == 0


def _declared() -> dict[str, tuple[str, ...]]:
    """Every series name the code exports (histograms with their three suffixes) -> its labels."""
    names: dict[str, tuple[str, ...]] = {}
    for name, (kind, labels) in {**instruments.METRICS, **database_view.DATABASE_METRICS}.items():
        names[name] = labels
        if kind == "histogram":
            names[f"{name}_bucket"] = (*labels, "le")
            names[f"{name}_sum"] = names[f"{name}_count"] = labels
    return names


def test_the_declared_metrics_are_the_ones_registered_with_those_labels() -> None:
    exposition = prometheus_client.generate_latest().decode()
    for name, (kind, _labels) in instruments.METRICS.items():
        assert f"# TYPE {name} {kind}\n" in exposition
    registered = {
        collector._name: tuple(collector._labelnames)  # type: ignore[attr-defined]
        for collector in list(prometheus_client.REGISTRY._collector_to_names)
        if getattr(collector, "_name", "").startswith("pg_lease_")
    }
    declared = {name.removesuffix("_total"): labels for name, (_kind, labels) in instruments.METRICS.items()}
    assert registered == declared


def test_the_database_view_exports_what_it_declares(prefix: str) -> None:
    held(f"{prefix}:x")
    registry = CollectorRegistry()
    database_view.register(registry)
    families = {family.name: family for family in registry.collect()}
    assert set(families) == set(database_view.DATABASE_METRICS)
    for name, (kind, labels) in database_view.DATABASE_METRICS.items():
        assert families[name].type == kind
        # Waiters and ended tenures appear only when there are some (history is off here).
        assert families[name].samples or name in ("pg_lease_db_waiters", "pg_lease_db_tenures_ended"), name
        for sample in families[name].samples:
            assert tuple(sample.labels) == labels, (name, sample)


def test_every_dashboard_query_names_an_exported_metric_with_labels_it_has() -> None:
    dashboard = json.loads((REPO / "docs" / "grafana" / "pg_lease.json").read_text())
    declared = _declared()
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(expressions) >= 10
    used: set[str] = set()
    for expression in expressions:
        names = re.findall(r"\bpg_lease_\w+", expression)
        assert names, f"{expression!r} names no metric of ours"
        for name in names:
            assert name in declared, f"{name} (in {expression!r}) is not a metric the code exports"
        labels: set[str] = set()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expression):
            labels |= {label.strip() for label in group.split(",") if label.strip()}
        for selector in re.findall(r"\{([^}]*)\}", expression):
            labels |= set(re.findall(r"(\w+)\s*(?:=|!=|=~|!~)", selector))
        allowed = set().union(*(declared[name] for name in names))
        assert labels <= allowed, f"{expression!r} uses labels {labels - allowed} its metrics do not have"
        used.update(name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for name in names)
    # And the dashboard shows every metric (a new one gets a panel, or this fails).
    assert used == set(instruments.METRICS) | set(database_view.DATABASE_METRICS)


def test_the_observability_page_explains_every_metric_and_setting() -> None:
    page = (REPO / "docs" / "observability.md").read_text()
    for name in {**instruments.METRICS, **database_view.DATABASE_METRICS}:
        assert f"`{name}`" in page, f"docs/observability.md does not explain {name}"
    for setting in (
        "PG_LEASE_METRICS",
        "PG_LEASE_METRICS_DATABASE_VIEW",
        "PG_LEASE_METRICS_KEY_LABEL",
        "PG_LEASE_METRICS_MAX_LABELS",
        "PG_LEASE_METRICS_PUSHGATEWAY",
        "PROMETHEUS_MULTIPROC_DIR",
    ):
        assert setting in page
    assert "observability.md" in (REPO / "mkdocs.yml").read_text()


def _child(mode: str, key: str) -> list[dict[str, Any]]:
    env = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.children.observability_child", mode, key],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_each_lease_operation_of_a_hold_is_a_span_with_prefix_outcome_and_epoch(prefix: str) -> None:
    spans = _child("spans", f"{prefix}:traced")
    by_outcome = {(span["name"], span["attributes"]["pg_lease.outcome"]): span for span in spans}
    granted = by_outcome["pg_lease.acquire", "granted"]
    epoch = granted["attributes"]["pg_lease.epoch"]
    assert granted["attributes"]["pg_lease.prefix"] == prefix
    assert "pg_lease.epoch" not in by_outcome["pg_lease.acquire", "busy"]["attributes"]
    renew = by_outcome["pg_lease.renew", "renewed"]
    assert renew["attributes"]["pg_lease.epoch"] == epoch and renew["duration_ns"] > 0
    assert by_outcome["pg_lease.release", "freed"]["attributes"]["pg_lease.epoch"] == epoch
    assert {span["attributes"]["pg_lease.prefix"] for span in spans} == {prefix}


@pytest.mark.slow
def test_without_the_optional_packages_nothing_is_registered_and_holds_work(prefix: str) -> None:
    [report] = _child("without", f"{prefix}:plain")
    assert report == {"metrics": False, "rich": False, "epoch": report["epoch"]}
    assert report["epoch"] >= 1


# ---- the database's view under least privilege, over junk keys (issue 46, finding 3) -------------


@pytest.fixture
def monitor(transactional_db: None) -> Iterator[str]:
    """A login role declared in PG_LEASE_MONITOR_ROLES (granted pg_lease_metrics() by `leases grant`)."""
    import psycopg
    from psycopg import sql as pgsql

    from tests.helpers import conninfo

    role = f"pgl_{uuid.uuid4().hex[:8]}_monitor"
    admin = psycopg.connect(conninfo(), autocommit=True)
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    try:
        with override_settings(PG_LEASE_MONITOR_ROLES=[role]):
            call_command("leases", "grant", stdout=io.StringIO())
            yield role
    finally:
        admin.execute(pgsql.SQL("DROP OWNED BY {} CASCADE").format(pgsql.Identifier(role)))
        admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
        admin.close()


@contextmanager
def database_rule(separator: str, cap: int) -> Iterator[None]:
    """The metrics' label rule the database holds, set (committed) for a while: the view's labels
    follow it, never the scraping process's settings."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT separator, max_labels FROM pg_lease_django_metrics_rule")
        saved = cursor.fetchone()
        cursor.execute("UPDATE pg_lease_django_metrics_rule SET separator = %s, max_labels = %s", [separator, cap])
    try:
        yield
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute("UPDATE pg_lease_django_metrics_rule SET separator = %s, max_labels = %s", list(saved))


def scrape_as(role: str, **settings: Any) -> str:
    """The database view's exposition text, read on a connection that logs in as ``role``."""
    from tests.helpers import conninfo

    server = psycopg_conninfo(conninfo())
    alias = "default"
    saved = dict(connections[alias].settings_dict)
    connections[alias].close()
    connections[alias].settings_dict.update(
        USER=role, PASSWORD="", HOST=server.get("host") or "", PORT=str(server.get("port") or "")
    )
    try:
        registry = CollectorRegistry()
        with override_settings(**settings):
            database_view.register(registry, using=alias)
            return prometheus_client.generate_latest(registry).decode()
    finally:
        connections[alias].close()
        connections[alias].settings_dict.update(saved)


def psycopg_conninfo(text: str) -> dict[str, Any]:
    import psycopg

    return dict(psycopg.conninfo.conninfo_to_dict(text))


def test_the_database_view_works_for_a_monitoring_role_and_stays_small_over_junk_keys(monitor: str) -> None:
    """Finding 3: the database view failed under the documented roles (the operator lacked SELECT on
    the waiter table, the worker on the lease table), and one tenant's junk keys without a ':' made
    a scrape 21 MB with 80,073 series. A monitoring role reads counts through pg_lease_metrics();
    keys without the separator share "(none)", at most PG_LEASE_METRICS_MAX_LABELS labels keep their
    own and the rest count as "(other)"."""
    tag = uuid.uuid4().hex[:8]
    with connections["default"].cursor() as cursor:  # 3,000 junk keys: 1,500 labels, 1,500 without ':'
        cursor.execute(
            "INSERT INTO pg_lease_django_lease (key, owner, epoch, acquired_at, expires_at) "
            "SELECT CASE WHEN i %% 2 = 0 THEN 'junk' || i || %s || ':k' ELSE 'junk-' || %s || '-' || i END, 'w', "
            "f.floor + 1, clock_timestamp(), clock_timestamp() + interval '1 hour' "
            "FROM generate_series(1, 3000) i, pg_lease_django_epoch_floor f",
            [tag, tag],
        )
    with database_rule(":", 16):
        text = scrape_as(monitor)
    samples = parse(text)
    assert value(samples, "pg_lease_db_up") == 1
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series) < 200, len(series)
    labels = {dict(pairs)["prefix"] for name, pairs in samples if name == "pg_lease_db_leases"}
    assert len(labels) <= 17 and {metrics.OTHER_LABEL, metrics.NO_PREFIX_LABEL} <= labels
    # Another role, granted nothing, reads nothing: db_up says so, and the scrape goes on.
    import psycopg
    from psycopg import sql as pgsql

    from tests.helpers import conninfo

    stranger = f"pgl_{tag}_stranger"
    admin = psycopg.connect(conninfo(), autocommit=True)
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(stranger)))
    try:
        assert value(parse(scrape_as(stranger)), "pg_lease_db_up") == 0
    finally:
        admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(stranger)))
        admin.close()


@pytest.mark.django_db
def test_the_database_and_the_process_label_a_key_alike(key: str) -> None:
    """Both views spell the same labels: a key without the separator, and the labels past the cap
    (the database's cap is the one its rule holds: set here in the test's transaction)."""
    held(f"no-separator-{uuid.uuid4().hex}")
    held(f"{key}:x")
    query = "SELECT DISTINCT label FROM public.pg_lease_metrics() WHERE kind = 'lease'"
    with connections["default"].cursor() as cursor:
        cursor.execute("UPDATE pg_lease_django_metrics_rule SET max_labels = 1000000")
        cursor.execute(query)
        wide = {row[0] for row in cursor.fetchall()}
        cursor.execute("UPDATE pg_lease_django_metrics_rule SET max_labels = 1")
        cursor.execute(query)
        narrow = {row[0] for row in cursor.fetchall()}
    assert metrics.NO_PREFIX_LABEL in wide and key in wide
    assert len(narrow) == 2 and metrics.OTHER_LABEL in narrow
    label = hooks.key_label
    with override_settings(PG_LEASE_METRICS_MAX_LABELS=1_000_000):
        assert label("no-separator") == metrics.NO_PREFIX_LABEL and label(f"{key}:x") == key
