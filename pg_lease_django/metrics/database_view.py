"""The database's view for Prometheus: one statement per scrape (docs/observability.md).

`DatabaseCollector` reads, from the router's write database for `Lease`, the leases held, lapsed
and free by key label, the oldest lapse not yet taken over, the waiters registered and, with
``PG_LEASE_HISTORY``, the tenures ended by reason. Registered by the app's ``ready()`` in
prometheus_client's default registry (``PG_LEASE_METRICS_DATABASE_VIEW``); in multiprocess mode
register it in the registry your ``/metrics`` view builds (`register`).

With a one-character ``PG_LEASE_METRICS_KEY_LABEL`` (the default ``:``) it calls
``pg_lease_metrics()``, which a role declared in ``PG_LEASE_MONITOR_ROLES`` may run and which
returns counts by label, never a key: the labels are bounded there (keys without the separator
share ``"(none)"``, at most ``PG_LEASE_METRICS_MAX_LABELS`` labels, the rest ``"(other)"``). A
callable label reads a row per key (an operator's SELECT on the lease tables) and is bounded here.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from django.db import connections, router, transaction

from pg_lease_django import conf
from pg_lease_django.sql import run, statements

from . import OTHER_LABEL

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = ["DATABASE_METRICS", "DatabaseCollector", "register"]

logger = logging.getLogger(__name__)

#: Every metric of the database's view: name, type, labels (checked like `instruments.METRICS`).
DATABASE_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pg_lease_db_up": ("gauge", ()),
    "pg_lease_db_leases": ("gauge", ("prefix", "state")),
    "pg_lease_db_oldest_lapse_seconds": ("gauge", ("prefix",)),
    "pg_lease_db_waiters": ("gauge", ("prefix",)),
    "pg_lease_db_tenures_ended": ("gauge", ("prefix", "reason")),
}


class DatabaseCollector:
    """A prometheus_client collector: the database's view of the leases, read at each scrape.

    With a one-character ``PG_LEASE_METRICS_KEY_LABEL`` the database groups by label itself
    (``pg_lease_metrics()``, which a monitoring role may run); with a callable it returns a row per
    key and state, grouped here (costlier on a large table, and an operator's SELECT on the lease
    tables). Either way a scrape has at most ``PG_LEASE_METRICS_MAX_LABELS`` labels plus
    ``"(other)"``. A failed read (database down, no privilege) sets ``pg_lease_db_up`` to 0 and is
    logged; it never fails the scrape.

    Args:
        using: the database alias; default the router's write database for `Lease`.
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> list[Metric]:
        """Nothing: the metrics are only known at a scrape (no query at registration)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Read the view (one statement) and yield it as gauges."""
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("pg_lease_db_up", "1 if the last read of the database's view of the leases worked.")
        try:
            rows = self.read()
        except Exception as exc:
            logger.warning("reading the database's view of the leases for the metrics failed: %s", exc)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from _families(rows)

    def read(self) -> list[tuple[str, str, str, float, float | None]]:
        """The view's rows, labelled: (kind, prefix, state or reason, count, oldest lapse in seconds)."""
        from pg_lease_django.models import Lease

        alias = self.using or router.db_for_write(Lease)
        connection = connections[alias]
        rule = conf.metrics_key_label()
        cap = conf.metrics_max_labels()
        history_on = bool(conf.history_prefixes())
        opened = connection.connection is None
        try:
            with transaction.atomic(using=alias):
                if isinstance(rule, str):
                    return run.rows(connection, statements.METRICS, [rule, cap, history_on])
                # The planner cannot estimate how many keys share a label, guesses a group per row
                # and sorts every row, on disk past work_mem; with room for a hash of that guess it
                # hashes instead (2-3x faster at 100k rows). For this transaction only, never lowered.
                run.run(connection, statements.WORK_MEM_ROOM)
                raw = run.rows(connection, statements.METRICS_PER_KEY, [history_on])
        finally:
            # A scrape thread of prometheus_client's server is new each time: close what it opened.
            if opened and not connection.in_atomic_block:
                connection.close()
        return _regroup(raw, rule, cap)


def _regroup(
    raw: list[tuple[str, str, str, float, float | None]], label: Callable[[str], str], cap: int
) -> list[tuple[str, str, str, float, float | None]]:
    """Rows per key labelled by ``label``: the ``cap`` labels with the most lease rows keep their own,
    the rest are counted as `OTHER_LABEL` (as ``pg_lease_metrics()`` bounds them in SQL)."""
    labels = {key: str(label(key)) for _kind, key, *_ in raw}
    rows: dict[str, float] = defaultdict(float)
    for kind, key, _what, count, _lapse in raw:
        if kind == "lease":
            rows[labels[key]] += count
    kept = set(sorted(rows, key=lambda name: (-rows[name], name))[:cap])
    counts: dict[tuple[str, str, str], float] = defaultdict(float)
    lapses: dict[tuple[str, str, str], float | None] = {}
    for kind, key, what, count, lapse in raw:
        group = (kind, labels[key] if labels[key] in kept else OTHER_LABEL, what)
        counts[group] += count
        if lapse is not None:
            known = lapses.get(group)
            lapses[group] = lapse if known is None else max(known, lapse)
    return [(*group, count, lapses.get(group)) for group, count in counts.items()]


def _families(rows: list[tuple[str, str, str, float, float | None]]) -> Iterator[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    from pg_lease_django.status import LeaseStatus

    leases = GaugeMetricFamily(
        "pg_lease_db_leases", "Lease rows by key label and state (server clock).", labels=["prefix", "state"]
    )
    oldest = GaugeMetricFamily(
        "pg_lease_db_oldest_lapse_seconds",
        "Seconds since the expiry of the longest-lapsed lease not yet taken over (0: none lapsed).",
        labels=["prefix"],
    )
    waiters = GaugeMetricFamily("pg_lease_db_waiters", "Keys with a blocking waiter registered now.", labels=["prefix"])
    tenures = GaugeMetricFamily(
        "pg_lease_db_tenures_ended",
        "Recorded tenures (PG_LEASE_HISTORY) by how they ended, as kept (pruning lowers them).",
        labels=["prefix", "reason"],
    )
    seen: dict[str, set[str]] = defaultdict(set)
    lapsed_for: dict[str, float] = {}
    for kind, prefix, what, count, lapse in rows:
        if kind == "lease":
            leases.add_metric([prefix, what], count)
            seen[prefix].add(what)
            if what == LeaseStatus.LAPSED and lapse is not None:
                lapsed_for[prefix] = max(lapse, lapsed_for.get(prefix, 0.0))
        elif kind == "waiter":
            waiters.add_metric([prefix], count)
        else:
            tenures.add_metric([prefix, what], count)
    for prefix, states in seen.items():
        for state in LeaseStatus.values:  # every state of a label present, 0 included: alerts need no absent()
            if state not in states:
                leases.add_metric([prefix, state], 0.0)
        oldest.add_metric([prefix], lapsed_for.get(prefix, 0.0))
    yield from (leases, oldest, waiters, tenures)


def register(registry: CollectorRegistry | None = None, using: str | None = None) -> DatabaseCollector:
    """Register a `DatabaseCollector` in ``registry`` (default prometheus_client's default registry).

    For multiprocess mode, where ``/metrics`` builds a registry of its own per scrape.
    """
    import prometheus_client

    collector = DatabaseCollector(using)
    (prometheus_client.REGISTRY if registry is None else registry).register(collector)
    return collector
