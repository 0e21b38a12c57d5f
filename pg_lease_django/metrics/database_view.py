"""The database's view for Prometheus: one statement per scrape (docs/observability.md).

`DatabaseCollector` reads from the router's write database for `Lease`. It reads the leases held,
lapsed and free by key label, the oldest lapse not yet taken over and the waiters registered. With
``PG_LEASE_HISTORY`` it also reads the tenures ended by reason. The app's ``ready()`` registers it
in prometheus_client's default registry when ``PG_LEASE_METRICS_DATABASE_VIEW`` is on. In
multiprocess mode, `register` it in the registry your ``/metrics`` view builds.

It calls ``pg_lease_metrics()``, which a role declared in ``PG_LEASE_MONITOR_ROLES`` may run. It
returns counts by label, never a key. The label rule is the database's, never the caller's, since
a caller choosing it could read keys back. A key under a scope prefix declared in
``PG_LEASE_KEY_SCOPES`` is labelled by that prefix. Any other key is labelled by its part before
the separator of ``PG_LEASE_METRICS_KEY_LABEL``, or ``"(none)"`` without it. There are at most
``PG_LEASE_METRICS_MAX_LABELS`` labels, and the rest are ``"(other)"``. `sync_metrics_rule` copies
the settings in at ``migrate``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.db import connections, router, transaction

from pg_lease_django import conf
from pg_lease_django.sql import run, statements
from pg_lease_django.sql.rows import LeaseCount

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = [
    "DATABASE_METRICS",
    "METRICS_RULE_TABLE",
    "DatabaseCollector",
    "metrics_rule",
    "register",
    "sync_metrics_rule",
]

#: The table holding the rule (migration 0011).
METRICS_RULE_TABLE = "pg_lease_django_metrics_rule"

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

    The database groups by label itself, by the rule it holds, in ``pg_lease_metrics()``, which a
    monitoring role may run. So a scrape has at most ``PG_LEASE_METRICS_MAX_LABELS`` labels plus
    ``"(other)"``. A failed read, with the database down or no privilege, sets ``pg_lease_db_up`` to
    0 and is logged; it never fails the scrape.

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

    def read(self) -> list[LeaseCount]:
        """The view's rows, labelled by the database's rule."""
        from pg_lease_django.models import Lease

        alias = self.using or router.db_for_write(Lease)
        connection = connections[alias]
        opened = connection.connection is None
        try:
            with transaction.atomic(using=alias):
                return run.rows(connection, statements.METRICS)
        finally:
            # A scrape thread of prometheus_client's server is new each time: close what it opened.
            if opened and not connection.in_atomic_block:
                connection.close()


def metrics_rule() -> tuple[str, int]:
    """The label rule the database is to hold: ``PG_LEASE_METRICS_KEY_LABEL``'s separator (``":"``
    when the setting is a callable, which labels this process's own metrics only) and
    ``PG_LEASE_METRICS_MAX_LABELS``."""
    rule = conf.metrics_key_label()
    return (rule if isinstance(rule, str) else ":"), conf.metrics_max_labels()


def sync_metrics_rule(using: str) -> bool:
    """Make database ``using`` label the database's view by `metrics_rule`; whether anything changed.

    Called by ``migrate`` and ``manage.py leases grant``
    (`pg_lease_django.provisioning.privileges.grant_privileges`), as the owner: ``pg_lease_metrics()``
    takes no rule from its caller. Nothing to do before migration 0011.
    """
    connection = connections[using]
    if not run.one(
        connection, statements.RELATION_EXISTS, namespace=run.schema_name(connection), relation=METRICS_RULE_TABLE
    ):
        return False
    wanted = metrics_rule()
    stored = run.first(connection, statements.METRICS_RULE)
    if stored is not None and (stored.separator, stored.max_labels) == wanted:
        return False
    run.run(connection, statements.METRICS_RULE_SET, separator=wanted[0], max_labels=wanted[1])
    return True


def _families(rows: list[LeaseCount]) -> Iterator[Metric]:
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
    for row in rows:
        if row.kind == "lease":
            leases.add_metric([row.label, row.state], row.total)
            seen[row.label].add(row.state)
            if row.state == LeaseStatus.LAPSED and row.oldest_lapse is not None:
                lapsed_for[row.label] = max(row.oldest_lapse, lapsed_for.get(row.label, 0.0))
        elif row.kind == "waiter":
            waiters.add_metric([row.label], row.total)
        else:
            tenures.add_metric([row.label, row.state], row.total)
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
