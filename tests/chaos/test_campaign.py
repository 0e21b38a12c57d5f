"""``manage.py leases run --campaign KEY -- COMMAND``: COMMAND kept running on exactly one of several machines.

Three real ``python -m django leases run --campaign`` processes campaign for one key; COMMAND is
``python -m tests.children.election_child command``, which writes fenced rows (raw SQL) stamped with the
server clock while it runs, and reports on stdout (inherited from its supervisor). The leader's
supervisor is killed (SIGKILL: its COMMAND lives on, orphaned, and must be fenced out), a COMMAND
exits (the campaign restarts), a hand-off is requested, then every supervisor is stopped. The
history of the writes shows one COMMAND at a time, epochs strictly increasing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from typing import IO, Any

import pytest
from django.core.management import CommandError, call_command

from devkit.dbserver import REPO
from devkit.testapp.models import Entry
from pg_lease_django import Lease
from pg_lease_django.management.exit_codes import ExitCode
from tests.helpers import url_of_test_database

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TTL = 3.0
COMMAND = [sys.executable, "-m", "tests.children.election_child", "command"]


class Campaign:
    """One ``leases run --campaign`` process (a session of its own) and the events its COMMANDs print."""

    def __init__(self, key: str, name: str) -> None:
        self.name = name
        env = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
        argv = [sys.executable, "-m", "django", "leases", "run", "--campaign", key, "--ttl", str(TTL)]
        self.proc = subprocess.Popen(
            [*argv, "--owner", name, "--grace", "5", "-v", "2", "--", *COMMAND],
            cwd=REPO,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream: IO[bytes], events: bool) -> None:
        for line in stream:
            with self._changed:
                if events:
                    self.events.append({"supervisor": self.name, **json.loads(line)})
                else:
                    self.stderr.append(line.decode())
                self._changed.notify_all()

    def of(self, event: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.events if e["event"] == event]

    def expect_stderr(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(text in line for line in self.stderr):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{self.name}: no {text!r} on stderr:\n{''.join(self.stderr)}"
                self._changed.wait(remaining)

    def finish(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)


@pytest.fixture
def campaigns(key: str) -> Iterator[list[Campaign]]:
    started = [Campaign(key, name) for name in ("s1", "s2", "s3")]
    yield started
    for campaign in started:  # orphaned COMMANDs included: every one of them ran in a group of its own
        for event in campaign.of("running"):
            with suppress(ProcessLookupError):
                os.killpg(event["pid"], signal.SIGKILL)
        if campaign.proc.poll() is None:
            os.killpg(campaign.proc.pid, signal.SIGKILL)
            campaign.proc.wait(10)


def nth_run(campaigns: list[Campaign], n: int, timeout: float = 30.0) -> dict[str, Any]:
    """The ``n``-th COMMAND started among all supervisors (by time), once it has written."""
    deadline = time.monotonic() + timeout
    while True:
        runs = sorted((e for c in campaigns for e in c.of("running")), key=lambda e: e["at"])
        if len(runs) >= n:
            run = runs[n - 1]
            campaign = next(c for c in campaigns if c.name == run["supervisor"])
            if [e for e in campaign.of("wrote") if e["epoch"] == run["epoch"]]:
                return run
        if time.monotonic() > deadline:
            stderr = "\n".join(f"{c.name}:\n{''.join(c.stderr)}" for c in campaigns)
            pytest.fail(f"no COMMAND #{n}: {runs}\n{stderr}")
        time.sleep(0.01)


def test_the_command_runs_on_one_machine_at_a_time_through_a_kill_an_exit_and_a_handoff(
    key: str, campaigns: list[Campaign]
) -> None:
    by_name = {c.name: c for c in campaigns}
    first = nth_run(campaigns, 1)

    # SIGKILL the leader's supervisor: its lease lapses, another machine runs COMMAND; the
    # orphaned COMMAND goes on writing, and the fence refuses it from the takeover on.
    killed_at = time.monotonic()
    os.kill(by_name[first["supervisor"]].proc.pid, signal.SIGKILL)
    second = nth_run(campaigns, 2)
    after_kill = second["at"] - killed_at
    assert second["supervisor"] != first["supervisor"]
    assert second["epoch"] == first["epoch"] + 1, "taken over once the lease lapsed: nobody released it"
    orphan_refused = by_name[first["supervisor"]]
    deadline = time.monotonic() + 10
    while not [e for e in orphan_refused.of("refused") if e["epoch"] == first["epoch"]]:
        assert time.monotonic() < deadline, "the orphaned COMMAND was never fenced out"
        time.sleep(0.01)
    os.killpg(first["pid"], signal.SIGKILL)

    # COMMAND exits: its supervisor steps down and campaigns again; a COMMAND runs again.
    leader = by_name[second["supervisor"]]
    os.kill(second["pid"], signal.SIGUSR1)
    third = nth_run(campaigns, 3)
    leader.expect_stderr("exited with status 0; stepping down")
    assert third["epoch"] > second["epoch"]

    # A hand-off: COMMAND gets SIGTERM, the lease is released (epoch + 1: a lapse would take the
    # lease at + 1), another machine runs COMMAND (+ 2). Times are printed; latencies are `make bench`'s.
    handing = by_name[third["supervisor"]]
    asked_at = time.monotonic()
    Lease.objects.request_handoff(key)
    fourth = nth_run(campaigns, 4)
    after_handoff = fourth["at"] - asked_at
    assert fourth["supervisor"] != third["supervisor"]
    assert fourth["epoch"] == third["epoch"] + 2, "released for the hand-off, not left to lapse"
    assert [e["epoch"] for e in handing.of("terminated")][-1] == third["epoch"]
    handing.expect_stderr("for a hand-off")

    # SIGTERM stops every supervisor: the leader's COMMAND gets it too, and its status is the exit status.
    alive = [c for c in campaigns if c.proc.poll() is None]
    for campaign in alive:
        os.kill(campaign.proc.pid, signal.SIGTERM)
    statuses = {c.name: c.finish() for c in alive}
    assert statuses[fourth["supervisor"]] == 128 + signal.SIGTERM  # COMMAND's: it died of the SIGTERM passed on
    assert set(statuses.values()) == {128 + signal.SIGTERM}
    assert by_name[fourth["supervisor"]].of("terminated")[-1]["epoch"] == fourth["epoch"]
    assert Lease.objects.inspect(key).status == "free"

    # The whole history: one COMMAND at a time on the server clock, epochs strictly increasing.
    rows = list(Entry.objects.filter(account=key).order_by("ticket", "id").values_list("writer", "lease_epoch"))
    terms: list[tuple[str, int]] = []
    for writer, epoch in rows:
        assert epoch is not None
        if not terms or terms[-1] != (writer, epoch):
            assert not terms or epoch > terms[-1][1], f"{writer} at epoch {epoch} after {terms[-1]}"
            terms.append((writer, epoch))
    runs = [first, second, third, fourth]
    assert terms == [(run["owner"], run["epoch"]) for run in runs]
    print(f"\nrun --campaign: failover after SIGKILL {after_kill:.2f}s, hand-off {after_handoff:.2f}s")


def test_campaign_and_wait_do_not_go_together(key: str) -> None:
    with pytest.raises(CommandError, match="leave out --wait") as info:
        call_command("leases", "run", key, "--ttl", "5", "--campaign", "--wait", "5", "--", "true")
    assert info.value.returncode == ExitCode.USAGE
