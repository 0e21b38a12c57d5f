"""docs/deployment.md's recipes, run: the systemd unit's ExecStart and the Kubernetes Deployment's
command, each started on the test database (three campaigners, as three machines or replicas),
then stopped as systemd (``KillMode=mixed``: SIGTERM to the main process) and the kubelet (SIGTERM
to PID 1) stop them. The leader's COMMAND stands in for ``manage.py run_scheduler``: it takes a
second to clean up after SIGTERM. Each stopped leader must exit within the recipe's grace period
(``TimeoutStopSec``, ``terminationGracePeriodSeconds``) with its lease released, and another
campaigner must take over before the TTL: a deploy does not wait for a lapse.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pg_lease_django import Lease
from tests.helpers import url_of_test_database, wait_until

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "deployment.md"

pytestmark = pytest.mark.django_db(transaction=True)

#: COMMAND in place of `manage.py run_scheduler`: runs until SIGTERM, then a second of clean-up.
SCHEDULER = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))\n"
    "while True: time.sleep(0.1)\n"
)


def block(language: str) -> str:
    found = re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(found) == 1, f"{PAGE.name} should have one ```{language} block"
    return str(found[0])


def systemd_recipe() -> tuple[list[str], float]:
    unit = block("ini")
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, flags=re.M))
    assert settings["KillMode"] == "mixed" and settings["KillSignal"] == "SIGTERM", settings
    argv = shlex.split(settings["ExecStart"])
    assert argv[:2] == ["/srv/app/.venv/bin/python", "manage.py"], argv
    return argv[2:], float(settings["TimeoutStopSec"])


def kubernetes_recipe() -> tuple[list[str], float]:
    manifest = block("yaml")
    command = json.loads(re.search(r"^\s*command: (\[.*\])$", manifest, flags=re.M)[1])  # type: ignore[index]
    grace = re.search(r"^\s*terminationGracePeriodSeconds: (\d+)$", manifest, flags=re.M)
    assert grace is not None and command[:2] == ["python", "manage.py"], command  # exec form, no shell
    return command[2:], float(grace[1])


def taken_over(key: str, epoch: int, owner: str | None) -> bool:
    now = Lease.objects.inspect(key)
    return now.status == "held" and now.epoch > epoch and now.owner != owner


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [systemd_recipe, kubernetes_recipe], ids=["systemd", "kubernetes"])
def test_a_deploy_stops_the_leader_within_its_grace_and_another_takes_over_before_the_ttl(recipe: object) -> None:
    args, grace = recipe()  # type: ignore[operator]
    key, ttl = args[2], float(args[args.index("--ttl") + 1])
    assert args[:2] == ["leases", "run"] and "--campaign" in args
    assert float(args[args.index("--grace") + 1]) + 1 < grace, "the grace period must cover --grace and a release"
    argv = [sys.executable, "-m", "django", *args[: args.index("--") + 1], sys.executable, "-c", SCHEDULER]
    environ = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    machines = [subprocess.Popen(argv, cwd=REPO, env=environ, stdin=subprocess.DEVNULL) for _ in range(3)]
    try:
        wait_until(lambda: Lease.objects.inspect(key).status == "held", timeout=60, what="a leader")
        for _ in range(2):  # a rollout: the leader's machine is stopped, then the next leader's
            leader = Lease.objects.inspect(key)
            leading = [p for p in machines if p.poll() is None and f":{p.pid}:" in f":{leader.owner}:"]
            assert len(leading) == 1, f"no running campaigner owns {leader}"
            stopping = leading[0]
            started = time.monotonic()
            stopping.send_signal(signal.SIGTERM)  # systemd's KillMode=mixed, or the kubelet to PID 1
            status = stopping.wait(timeout=grace)  # else the supervisor would SIGKILL it
            assert status in (0, 128 + signal.SIGTERM), status  # COMMAND's own status
            wait_until(functools.partial(taken_over, key, leader.epoch, leader.owner), ttl + 60, "a takeover")
            # Before the TTL: the stopped leader released (epoch + 1) and another took it (+ 2); had it
            # been left to lapse, the next holder would be at + 1. (A stopwatch would fail on a stall.)
            after = Lease.objects.inspect(key)
            assert after.epoch == leader.epoch + 2, (leader, after)
            print(f"\ntaken over {time.monotonic() - started:.2f}s after the SIGTERM (ttl {ttl}s)")
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.send_signal(signal.SIGTERM)
        for machine in machines:
            try:
                machine.wait(timeout=30)
            except subprocess.TimeoutExpired:
                machine.kill()
                machine.wait(30)


def test_a_sigterm_just_as_the_campaign_is_won_stops_it(key: str, raw_connect: Any) -> None:
    """The deploy's SIGTERM reaching ``leases run --campaign`` right as its term begins (before COMMAND
    starts). It used to hang there for good (the election thread waited for a term the main thread
    had given up): 5 of 12 tries on this machine. The grant is watched every 2 ms from another
    connection and the signal sent at once; each of ten tries must exit and leave the lease free."""
    watcher = raw_connect()
    environ = {**os.environ, "DATABASE_URL": url_of_test_database(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    hung = []
    for attempt in range(10):
        name = f"{key}:{attempt}"
        argv = [sys.executable, "-m", "django", "leases", "run", name, "--campaign", "--ttl", "30", "--"]
        machine = subprocess.Popen([*argv, sys.executable, "-c", SCHEDULER], cwd=REPO, env=environ)
        try:
            deadline = time.monotonic() + 60
            while not watcher.execute(
                "SELECT EXISTS (SELECT FROM pg_lease_django_lease WHERE key = %s AND expires_at > now())", [name]
            ).fetchone()[0]:
                assert time.monotonic() < deadline, "no term within 60 s"
                time.sleep(0.002)  # the race is the few ms between the grant and COMMAND's start
            machine.send_signal(signal.SIGTERM)
            machine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            hung.append(attempt)
        finally:
            if machine.poll() is None:
                machine.kill()
                machine.wait(30)
    assert hung == [], f"leases run --campaign did not stop after SIGTERM in tries {hung}"
