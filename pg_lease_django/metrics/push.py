"""What a short-lived process counted, out of it before it ends (docs/observability.md, "Short-lived processes").

A process nobody scrapes would take its metrics with it: ``leases run`` under cron, or a
cron-started ``@leased`` command. When it ends, `exiting` uses `push` to send them to the
Prometheus Pushgateway of ``PG_LEASE_METRICS_PUSHGATEWAY``. In prometheus_client's multiprocess
mode it also marks the process dead. That mode keeps the metrics in ``PROMETHEUS_MULTIPROC_DIR``,
which a server on the same host reads at each scrape. The dead process's counters and histograms
stay in the directory and add up over runs, and its live gauges leave the sum. The app's
``ready()`` arms it with `arm` once the metrics are installed. A process ending by a signal's
default disposition runs no ``atexit``, so `pg_lease_django.sigterm` calls it itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pg_lease_django import conf

from . import hooks

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["PUSH_JOB", "PUSH_TIMEOUT", "arm", "exiting", "push"]

logger = logging.getLogger(__name__)

#: The Pushgateway ``job`` of `push`; its grouping key adds ``instance`` (the host's name) and ``prefix``.
PUSH_JOB = "pg_lease_django"
#: Seconds one `push` may wait on the Pushgateway: for each network operation, and for all its
#: requests together (one per key label).
PUSH_TIMEOUT = 5.0

_armed_by: int | None = None  # the process `arm` was called in: the only one `exiting` acts for
_lock = threading.Lock()


def push() -> bool:
    """Push this process's lease metrics to the Pushgateway of ``PG_LEASE_METRICS_PUSHGATEWAY``, now.

    What `exiting` does when the process ends; call it yourself where a process nobody scrapes
    should report before it ends. One group per key label: ``job`` `PUSH_JOB`, ``instance`` this
    host's name, ``prefix`` the label, holding that label's series only. Each push replaces its
    group with an HTTP PUT, so a group holds the counts of the last process that pushed it. Waits
    `PUSH_TIMEOUT` seconds at most; a failure is logged, never raised.

    Returns:
        True when every label was pushed, or nothing was counted; False when the metrics are not
        installed, the setting is not set, or the push failed.
    """
    if not hooks.installed():
        return False
    gateway = None
    try:
        gateway = conf.metrics_pushgateway()
        if gateway is None:
            return False
        _push(gateway)
    except Exception:
        logger.warning("pushing the lease metrics to %s failed", gateway, exc_info=True)
        return False
    return True


def _push(gateway: str) -> None:
    from prometheus_client import push_to_gateway

    families = [family for collector in hooks.collectors() for family in collector.collect()]
    labels = sorted({sample.labels["prefix"] for family in families for sample in family.samples})
    instance = socket.gethostname()
    deadline = time.monotonic() + PUSH_TIMEOUT
    for label in labels:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{PUSH_TIMEOUT} s passed before every key label was pushed")
        grouping = {"instance": instance, "prefix": label}
        push_to_gateway(gateway, PUSH_JOB, _OneLabel(families, label), grouping, timeout=remaining)


class _OneLabel:
    """The series of one key label out of collected families: one label's group."""

    def __init__(self, families: list[Metric], label: str) -> None:
        self.families = families
        self.label = label

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric

        for family in self.families:
            samples = [sample for sample in family.samples if sample.labels.get("prefix") == self.label]
            if samples:
                one = Metric(family.name, family.documentation, family.type, family.unit)
                one.samples = samples
                yield one


def arm() -> None:
    """Run `exiting` when this process exits (``atexit``); called by the app's ``ready()`` once the
    metrics are installed. A second call does nothing."""
    global _armed_by
    with _lock:
        if _armed_by == os.getpid():
            return
        _armed_by = os.getpid()
    atexit.register(exiting)


def exiting() -> None:
    """The process ends: `push` its metrics, and in multiprocess mode mark the process dead.

    The push needs ``PG_LEASE_METRICS_PUSHGATEWAY``. Marked dead in prometheus_client's
    multiprocess mode, the process's live gauges leave the sum. Run by ``atexit``, and by
    `pg_lease_django.sigterm` in a process about to end by a signal's default disposition. It runs
    once per process, and only in the one `arm` was called in. A forked child, such as a worker of a
    preloading server, leaves it to its parent. Never raises.
    """
    global _armed_by
    with _lock:
        if _armed_by != os.getpid():
            return
        _armed_by = None
    push()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
        except Exception:
            logger.warning("marking this process dead in PROMETHEUS_MULTIPROC_DIR failed", exc_info=True)
