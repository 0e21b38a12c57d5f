"""The process's Prometheus metrics, `METRICS`, in a registry, and what they count from the lease signals.

`Instruments` creates the metrics in one registry, for ``hooks.install``. It bounds each key's
label: at most ``PG_LEASE_METRICS_MAX_LABELS`` per process, the later ones `OTHER_LABEL`. It keeps
the children of each label, and receives the signals. A hold's ``lease_acquired``,
``lease_released``, ``lease_lost`` and ``lease_handoff_requested`` give the holds' and leaderships'
gauges, lapses, losses and hand-offs. Nothing of prometheus_client is imported until an
`Instruments` is made.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pg_lease_django import conf
from pg_lease_django.signals import lease_acquired, lease_handoff_requested, lease_lost, lease_released

from . import OTHER_LABEL

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["METRICS", "Instruments"]

logger = logging.getLogger(__name__)

#: Every metric this module exports: name (as exposed, counters with ``_total``), type, labels.
#: docs/observability.md and the Grafana dashboard are checked against it (tests/db/test_metrics.py).
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pg_lease_grants_total": ("counter", ("prefix",)),
    "pg_lease_refusals_total": ("counter", ("prefix", "reason")),
    "pg_lease_renewals_total": ("counter", ("prefix",)),
    "pg_lease_renewal_errors_total": ("counter", ("prefix",)),
    "pg_lease_releases_total": ("counter", ("prefix",)),
    "pg_lease_lapses_total": ("counter", ("prefix",)),
    "pg_lease_losses_total": ("counter", ("prefix", "reason")),
    "pg_lease_handoffs_total": ("counter", ("prefix",)),
    "pg_lease_fenced_writes_refused_total": ("counter", ("prefix", "reason")),
    "pg_lease_renewal_latency_seconds": ("histogram", ("prefix",)),
    "pg_lease_renewal_slack_seconds": ("histogram", ("prefix",)),
    "pg_lease_blocking_wait_seconds": ("histogram", ("prefix", "outcome")),
    "pg_lease_holds": ("gauge", ("prefix",)),
    "pg_lease_elections": ("gauge", ("prefix",)),
    "pg_lease_leaderships": ("gauge", ("prefix",)),
}


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLACK_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: How many (metric, key, labels) the counting keeps the child of, before it starts over: the recent keys.
_COUNTED_KEYS = 4096


class Instruments:
    """The metrics, created in ``registry`` (by `pg_lease_django.metrics.hooks.install`)."""

    def __init__(self, registry: CollectorRegistry, label: Callable[[str], str]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.label = label
        self.registry = registry

        def counter(name: str, doc: str, *labels: str) -> Any:
            return Counter(name.removesuffix("_total"), doc, ("prefix", *labels), registry=registry)

        def gauge(name: str, doc: str) -> Any:
            # livesum: in multiprocess mode (PROMETHEUS_MULTIPROC_DIR) the sum over the live processes.
            return Gauge(name, doc, ("prefix",), registry=registry, multiprocess_mode="livesum")

        self.grants = counter(
            "pg_lease_grants_total", "Leases granted to this process (Lease.objects, holds, elections)."
        )
        self.refusals = counter(
            "pg_lease_refusals_total",
            "Acquires of this process that got no lease: busy (held by another) or timeout (a blocking wait).",
            "reason",
        )
        self.renewals = counter("pg_lease_renewals_total", "Renewals confirmed by the server.")
        self.renewal_errors = counter(
            "pg_lease_renewal_errors_total", "Renewals that failed without a verdict (retried while trusted)."
        )
        self.releases = counter(
            "pg_lease_releases_total", "Releases of this process the server confirmed (the key is free)."
        )
        self.lapses = counter(
            "pg_lease_lapses_total",
            "Holds that ended leaving their lease to lapse at its expiry (hold_at_least, or a failed release).",
        )
        self.losses = counter(
            "pg_lease_losses_total",
            "Leases of this process lost while held, by the error's code (lapsed, not_owner, ...).",
            "reason",
        )
        self.handoffs = counter("pg_lease_handoffs_total", "Hand-off requests seen by this process's holders.")
        self.fenced_refused = counter(
            "pg_lease_fenced_writes_refused_total",
            "Fenced writes of this process the database refused, by the error's code.",
            "reason",
        )
        self.latency = Histogram(
            "pg_lease_renewal_latency_seconds",
            "Seconds from sending a renewal to its confirmation.",
            ("prefix",),
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.slack = Histogram(
            "pg_lease_renewal_slack_seconds",
            "Seconds of trust window the holder had left when a renewal was confirmed (0: it came too late).",
            ("prefix",),
            registry=registry,
            buckets=_SLACK_BUCKETS,
        )
        self.wait = Histogram(
            "pg_lease_blocking_wait_seconds",
            "Seconds a blocking acquire waited for its lease, by outcome (granted, timeout).",
            ("prefix", "outcome"),
            registry=registry,
            buckets=_WAIT_BUCKETS,
        )
        self.holds = gauge("pg_lease_holds", "Leases this process's holds hold now (acquired, not released or lost).")
        self.elections = gauge("pg_lease_elections", "Elections this process campaigns in now.")
        self.leaderships = gauge("pg_lease_leaderships", "Elections this process leads now.")
        self._held: weakref.WeakSet[Any] = weakref.WeakSet()  # the leases counted in holds
        self._leading: weakref.WeakSet[Any] = weakref.WeakSet()  # those also counted in leaderships
        self._held_lock = threading.Lock()
        # Children by (metric, label values): as many as label combinations, which the labels keep few.
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # The child each (metric, key, labels) counts in, kept for the keys counted most recently: a
        # lease call counts once or twice, and a key's label, once given, does not change.
        self._counted: dict[tuple[Any, str, tuple[str, ...]], Any] = {}
        # The key labels this process exports (at most PG_LEASE_METRICS_MAX_LABELS), in order of arrival.
        self._labels: set[str] = set()
        self._labels_lock = threading.Lock()

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: a dict lookup instead of prometheus_client's checks and lock."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def receivers(self) -> list[tuple[Any, Callable[..., None]]]:
        return [
            (lease_acquired, self.on_acquired),
            (lease_released, self.on_released),
            (lease_lost, self.on_lost),
            (lease_handoff_requested, self.on_handoff),
        ]

    def collectors(self) -> list[Any]:
        return [
            self.grants, self.refusals, self.renewals, self.renewal_errors, self.releases, self.lapses, self.losses,
            self.handoffs, self.fenced_refused, self.latency, self.slack, self.wait, self.holds, self.elections,
            self.leaderships,
        ]  # fmt: skip

    def prefix(self, key: str | None) -> str:
        if key is None:
            return ""
        try:
            label = str(self.label(key))
        except Exception:
            logger.exception("PG_LEASE_METRICS_KEY_LABEL failed for a key; labelled ''")
            return ""
        if label in self._labels:
            return label
        return self._admit(label)

    def _admit(self, label: str) -> str:
        """``label``, if fewer than ``PG_LEASE_METRICS_MAX_LABELS`` labels are exported yet; else `OTHER_LABEL`."""
        try:
            cap = conf.metrics_max_labels()
        except Exception:
            logger.exception("PG_LEASE_METRICS_MAX_LABELS is invalid; a new label is counted as %r", OTHER_LABEL)
            return OTHER_LABEL
        with self._labels_lock:
            if label not in self._labels:
                if len(self._labels) >= cap:
                    return OTHER_LABEL
                self._labels.add(label)
        return label

    def count(self, metric: Any, key: str, *labels: str) -> None:
        """Add one to ``metric`` for ``key``'s label and ``labels``; never raises.

        A lease call that committed must return. In multiprocess mode an increment writes to a file,
        which can fail.
        """
        try:
            found = self._counted.get((metric, key, labels))
            if found is None:
                if len(self._counted) >= _COUNTED_KEYS:
                    self._counted.clear()
                found = self._counted[metric, key, labels] = self.child(metric, self.prefix(key), *labels)
            found.inc()
        except Exception:
            logger.exception("counting a lease call in the metrics failed")

    # ---- signal receivers (connected by install) -------------------------------------------------

    def on_acquired(self, sender: Any, lease: Any, **kwargs: Any) -> None:
        with self._held_lock:
            self._held.add(lease)
        self.child(self.holds, self.prefix(lease.key)).inc()

    def lead(self, lease: Any) -> None:
        with self._held_lock:
            if lease not in self._held or lease in self._leading:
                return  # already ended (lost while starting), or counted
            self._leading.add(lease)
        self.child(self.leaderships, self.prefix(lease.key)).inc()

    def _ended(self, lease: Any) -> str | None:
        with self._held_lock:
            if lease not in self._held:
                return None
            self._held.discard(lease)
            led = lease in self._leading
            self._leading.discard(lease)
        prefix = self.prefix(lease.key)
        self.child(self.holds, prefix).dec()
        if led:
            self.child(self.leaderships, prefix).dec()
        return prefix

    def on_released(self, sender: Any, lease: Any, freed: bool, **kwargs: Any) -> None:
        prefix = self._ended(lease) or self.prefix(lease.key)
        if not freed:  # a release is counted where the server confirmed it (`release_confirmed`)
            self.child(self.lapses, prefix).inc()

    def on_lost(self, sender: Any, lease: Any, error: Any, **kwargs: Any) -> None:
        prefix = self._ended(lease) or self.prefix(lease.key)
        self.child(self.losses, prefix, str(getattr(error, "code", "unknown"))).inc()

    def on_handoff(self, sender: Any, lease: Any, **kwargs: Any) -> None:
        self.child(self.handoffs, self.prefix(lease.key)).inc()
