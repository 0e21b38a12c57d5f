"""Observability, described in docs/observability.md; here, the rule every metric's ``prefix`` label follows.

Every metric has a ``prefix`` label: the key's label under ``PG_LEASE_METRICS_KEY_LABEL``. It is
never the raw key unless asked, through `whole_key`. Keys without the separator share
`NO_PREFIX_LABEL`. A process exports at most ``PG_LEASE_METRICS_MAX_LABELS`` labels, and counts the
later ones under `OTHER_LABEL`. `hooks` bounds the process's labels, `database_view` the database's.

Kept small: importing any module of the folder runs this one. The modules, lowest first:

- `tracing`: OpenTelemetry spans of holds' operations, where opentelemetry-api is installed.
- `instruments`: the process's Prometheus metrics, `METRICS`, in a registry, each key's label
  bounded. Also the receivers of the lease signals: the holds' gauges, lapses, losses, hand-offs.
- `hooks`: the metrics installed once by the app's ``ready()``, and the hooks the library calls
  where a lease call's answer is read: `operations`, the waits, holds, elections, fenced writes.
- `push`: what a short-lived process counted, out of it at exit. It goes to a Pushgateway, or is
  marked dead in the multiprocess directory.
- `database_view`: the database's view, read in one statement per scrape. It is an operator's
  module, since it reads the lease table's database; docs/architecture.md places it.
"""

from __future__ import annotations

from collections.abc import Callable

from pg_lease_django import conf

__all__ = ["NO_PREFIX_LABEL", "OTHER_LABEL", "labeller", "whole_key"]

#: The label of every key without the separator of ``PG_LEASE_METRICS_KEY_LABEL``: they share it.
NO_PREFIX_LABEL = "(none)"
#: The label of the keys whose own label came after ``PG_LEASE_METRICS_MAX_LABELS`` others in this process.
OTHER_LABEL = "(other)"


def whole_key(key: str) -> str:
    """The raw key as its label: ``PG_LEASE_METRICS_KEY_LABEL = "pg_lease_django.metrics.whole_key"``.

    Only for a bounded set of keys: every key becomes a series of every metric.
    """
    return key


def labeller() -> Callable[[str], str]:
    """``PG_LEASE_METRICS_KEY_LABEL`` as a function of the key, not yet bounded by the label cap.

    Raises:
        ImproperlyConfigured: the setting is invalid.
    """
    rule = conf.metrics_key_label()
    if isinstance(rule, str):
        separator = rule

        def up_to_separator(key: str) -> str:
            head, found, _rest = key.partition(separator)
            return head if found else NO_PREFIX_LABEL

        return up_to_separator
    return rule
