"""``PG_LEASE_*`` settings, each read at call time through one small typed function."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

# Settings read on every lease call, kept until a setting changes (``override_settings``): reading an
# unset one through Django's settings costs an AttributeError each time, more than the rest of the read.
_kept: dict[str, Any] = {}


@receiver(setting_changed)
def _forget_kept(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith("PG_LEASE_"):
        _kept.clear()


def listen_enabled() -> bool:
    """``PG_LEASE_LISTEN`` (bool, default ``True``): blocking acquire LISTENs for releases.

    Turn it off behind a transaction-pooling PgBouncer, where LISTEN does not work. Waiters then
    poll every ``PG_LEASE_POLL_INTERVAL`` seconds and at the holder's expiry. It is read once and
    kept until a setting changes, because a non-blocking acquire reads it on every call.
    """
    found = _kept.get("PG_LEASE_LISTEN")
    if found is None:
        found = _kept["PG_LEASE_LISTEN"] = bool(getattr(settings, "PG_LEASE_LISTEN", True))
    return bool(found)


def poll_interval() -> float:
    """``PG_LEASE_POLL_INTERVAL`` (float seconds, default ``0.5``): longest sleep of a waiter.

    A waiter re-tries at the holder's expiry, on a release notification, or after this long,
    whichever comes first. Without LISTEN it is the handoff latency to expect after a release.

    Raises:
        ImproperlyConfigured: the setting is not a positive, finite number of seconds.
    """
    value = getattr(settings, "PG_LEASE_POLL_INTERVAL", 0.5)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ImproperlyConfigured(f"PG_LEASE_POLL_INTERVAL must be a positive number of seconds, got {value!r}")
    return float(value)


def release_on_sigterm() -> bool:
    """``PG_LEASE_RELEASE_ON_SIGTERM`` (bool, default ``True``): a SIGTERM releases the main thread's holds.

    It applies while a sync ``hold()`` / ``@leased`` job or ``with elect()`` is active in the main
    thread and nobody else handles SIGTERM. A SIGTERM then unwinds the job, which releases the lease,
    and ends the process by SIGTERM as before. ``False`` leaves SIGTERM alone: the lease lapses after
    its TTL.
    """
    return bool(getattr(settings, "PG_LEASE_RELEASE_ON_SIGTERM", True))


def safety_margin() -> float:
    """``PG_LEASE_SAFETY_MARGIN`` (float, a fraction of the TTL, default ``0.1``): trust-window margin.

    A holder of ``hold()`` or ``@leased`` trusts itself for ``ttl * (1 - margin)`` after sending the
    acquire or renewal that succeeded, timed on its own monotonic clock. So it stops before the
    server can let anyone else in. The margin absorbs clock-rate differences between the holder and
    the server, and the gap between ``check()`` and the action it guards. ``0`` trusts right up to
    the server's expiry.

    Raises:
        ImproperlyConfigured: the setting is not a number in ``[0, 1)``.
    """
    value = getattr(settings, "PG_LEASE_SAFETY_MARGIN", 0.1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not 0 <= value < 1:
        raise ImproperlyConfigured(f"PG_LEASE_SAFETY_MARGIN must be a fraction of the TTL in [0, 1), got {value!r}")
    return float(value)


def schema() -> str | None:
    """``PG_LEASE_SCHEMA`` (str or ``None``, default ``None``): the schema of the lease table and functions.

    ``None`` looks it up once per database alias: the schema where ``pg_lease_django_lease``
    resolves on the search_path. Set it when leases live in a fixed schema and the search_path
    varies per session.
    """
    value = getattr(settings, "PG_LEASE_SCHEMA", None)
    if value is not None and (not isinstance(value, str) or not value):
        raise ImproperlyConfigured(f"PG_LEASE_SCHEMA must be a schema name or None, got {value!r}")
    return value


def hold_connections() -> int:
    """``PG_LEASE_HOLD_CONNECTIONS`` (int, default ``8``): how many lease connections ``hold()`` keeps per database.

    The holds of a process share one scheduler thread and a small pool of lease connections per
    database alias. These are never the job's connections, nor Django's pool. The setting bounds
    both the idle connections kept per alias and the worker threads that send renewals. Each worker
    has one renewal in flight, on a connection of its own. So at most this many renewals can hang
    at once before another waits.

    Raises:
        ImproperlyConfigured: the setting is not a positive integer.
    """
    value = getattr(settings, "PG_LEASE_HOLD_CONNECTIONS", 8)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ImproperlyConfigured(f"PG_LEASE_HOLD_CONNECTIONS must be a positive integer, got {value!r}")
    return value


def history_prefixes() -> tuple[str, ...]:
    """``PG_LEASE_HISTORY`` (list of key prefixes, default ``[]``): the keys whose tenures are recorded.

    Each tenure of a key starting with one of the prefixes is recorded in `LeaseTenure` by the
    database itself, in the statement that grants or ends it; ``""`` matches every key. ``migrate``
    copies the setting into the database table ``pg_lease_django_history_scope``. So every caller
    of the SQL functions is recorded alike, psql included. Check ``pg_lease_django.W005`` says when
    the two differ.

    Raises:
        ImproperlyConfigured: the setting is not a list or tuple of strings of at most 255 bytes.
    """
    value = getattr(settings, "PG_LEASE_HISTORY", [])
    if (
        isinstance(value, str)
        or not isinstance(value, list | tuple)
        or not all(isinstance(p, str) and len(p.encode()) <= 255 for p in value)
    ):
        raise ImproperlyConfigured(
            f"PG_LEASE_HISTORY must be a list of key prefixes ([''] records every key), got {value!r}"
        )
    return tuple(sorted(set(value)))


def history_retention() -> timedelta:
    """``PG_LEASE_HISTORY_RETENTION`` (timedelta or seconds, default 30 days): how long ended tenures are kept.

    ``manage.py leases prune-history`` and `LeaseTenure.objects.prune` delete the tenures that
    ended longer ago than this, by the server clock. A tenure still running is never deleted.

    Raises:
        ImproperlyConfigured: the setting is not a positive duration.
    """
    value = getattr(settings, "PG_LEASE_HISTORY_RETENTION", 2592000)  # 30 days
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ImproperlyConfigured(f"PG_LEASE_HISTORY_RETENTION must be a positive duration, got {value!r}")
    return value


def _role_list(name: str, value: object) -> tuple[str, ...]:
    if (
        isinstance(value, str)
        or not isinstance(value, list | tuple)
        or not all(isinstance(r, str) and r and len(r.encode()) <= 63 for r in value)
    ):
        raise ImproperlyConfigured(f"{name} must be a list of database role names, got {value!r}")
    return tuple(sorted(set(value)))


def worker_roles() -> tuple[str, ...]:
    """``PG_LEASE_WORKER_ROLES`` (list of database roles, default ``[]``): the roles that work with leases.

    ``migrate`` and ``manage.py leases grant`` grant each what ``pg_lease_privileges()`` lists for
    a worker: the four operations and fenced writes. The lease functions are revoked from
    ``PUBLIC``, so a role connecting as neither the owner nor a declared role can run none of them.
    Check ``pg_lease_django.W008``, run by ``check --database``, says when the database's grants
    fall short.

    Raises:
        ImproperlyConfigured: the setting is not a list of role names of 1 to 63 bytes.
    """
    return _role_list("PG_LEASE_WORKER_ROLES", getattr(settings, "PG_LEASE_WORKER_ROLES", []))


def operator_roles() -> tuple[str, ...]:
    """``PG_LEASE_OPERATOR_ROLES`` (list of database roles, default ``[]``): the roles of people and scripts.

    Granted what a worker is, plus force release, hand-off requests, the opt-out of fencing and
    reading the lease and history tables. ``manage.py leases`` and the admin need these.

    Raises:
        ImproperlyConfigured: the setting is not a list of role names of 1 to 63 bytes.
    """
    return _role_list("PG_LEASE_OPERATOR_ROLES", getattr(settings, "PG_LEASE_OPERATOR_ROLES", []))


def monitor_roles() -> tuple[str, ...]:
    """``PG_LEASE_MONITOR_ROLES`` (list of database roles, default ``[]``): the roles that read the metrics.

    Granted ``pg_lease_metrics()`` only: the database's view for Prometheus. It gives counts by
    key label, never a key, owner or epoch. An operator is granted it too.

    Raises:
        ImproperlyConfigured: the setting is not a list of role names of 1 to 63 bytes.
    """
    return _role_list("PG_LEASE_MONITOR_ROLES", getattr(settings, "PG_LEASE_MONITOR_ROLES", []))


#: ``PG_LEASE_KEY_SCOPES``' value for a role that may use every key (stored as the prefix ``""``).
ALL_KEYS = "*"


def key_scopes() -> dict[str, tuple[str, ...]]:
    """``PG_LEASE_KEY_SCOPES`` (dict of database role -> list of key prefixes, or ``"*"``, default ``{}``).

    It keeps tenants apart. Once any role is listed, every session may name only keys under the
    prefixes of the listed roles its login role is a member of, directly or through groups. This
    holds in every lease function. A session with no such role is refused with 42501
    ``key_scope``. The exceptions are the lease functions' owner, a superuser, and a role listed
    with ``"*"``, which may use every key: operators. ``migrate`` and ``manage.py leases grant``
    copy the setting into the database table ``pg_lease_django_key_scope``, with ``"*"`` stored as
    the prefix ``""``. Check ``pg_lease_django.W008`` says when the two differ, and E006 names a
    role that may call the lease functions with no scope at all.

    Raises:
        ImproperlyConfigured: not a dict of role names to ``"*"`` or non-empty lists of non-empty prefixes
            of at most 255 bytes.
    """
    value = getattr(settings, "PG_LEASE_KEY_SCOPES", {})
    if not isinstance(value, dict) or not all(
        isinstance(role, str)
        and role
        and len(role.encode()) <= 63
        and (
            prefixes == ALL_KEYS
            or (
                isinstance(prefixes, list | tuple)
                and prefixes
                and all(isinstance(p, str) and p and len(p.encode()) <= 255 for p in prefixes)
            )
        )
        for role, prefixes in value.items()
    ):
        raise ImproperlyConfigured(
            'PG_LEASE_KEY_SCOPES must map database role names to "*" (every key) or non-empty lists of '
            f"non-empty key prefixes, got {value!r}"
        )
    return {
        role: ("",) if prefixes == ALL_KEYS else tuple(sorted(set(prefixes)))
        for role, prefixes in sorted(value.items())
    }


#: The limits ``PG_LEASE_ROLE_LIMITS`` may set for a role, and their columns in ``pg_lease_django_role_limit``.
ROLE_LIMITS = ("leases", "tenures_per_key")


def role_limits() -> dict[str, tuple[int | None, int | None]]:
    """``PG_LEASE_ROLE_LIMITS`` (dict of database role -> dict of limits, default ``{}``): one tenant's cost bounded.

    ``{"tenant_a": {"leases": 10000, "tenures_per_key": 100}}`` allows at most ``leases`` lease
    rows under the role's key prefixes, which ``PG_LEASE_KEY_SCOPES`` gives. A brand-new key past
    the limit is refused with `QuotaExceededError`, SQLSTATE 53400. It also keeps only the newest
    ``tenures_per_key`` tenures per recorded key under those prefixes: older ones are deleted as new
    ones come. The database enforces both, for every caller. ``migrate`` and ``manage.py leases
    grant`` copy the setting into it. Returns role -> ``(leases, tenures_per_key)``, with None for a
    limit not set.

    Raises:
        ImproperlyConfigured: not a dict of role names to dicts of those limits, each a positive int.
    """
    value = getattr(settings, "PG_LEASE_ROLE_LIMITS", {})
    if not isinstance(value, dict) or not all(
        isinstance(role, str)
        and role
        and len(role.encode()) <= 63
        and isinstance(limits, dict)
        and limits
        and set(limits) <= set(ROLE_LIMITS)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 2**31 - 1 for n in limits.values())
        for role, limits in value.items()
    ):
        raise ImproperlyConfigured(
            "PG_LEASE_ROLE_LIMITS must map database role names to dicts of limits "
            f"({', '.join(ROLE_LIMITS)}), each a positive int, got {value!r}"
        )
    return {role: (limits.get("leases"), limits.get("tenures_per_key")) for role, limits in sorted(value.items())}


def ready_timeout() -> float:
    """``PG_LEASE_READY_TIMEOUT`` (float seconds, default ``2.0``): the longest `views.ready` waits.

    The readiness probe connects and runs its statement on a thread of its own. Past this long it
    answers 503 at once. So a database that hangs, frozen or behind a network that drops packets,
    never holds the web worker that serves the probe, nor the ``live`` requests queued behind it.

    Raises:
        ImproperlyConfigured: the setting is not a positive, finite number of seconds.
    """
    value = getattr(settings, "PG_LEASE_READY_TIMEOUT", 2.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ImproperlyConfigured(f"PG_LEASE_READY_TIMEOUT must be a positive number of seconds, got {value!r}")
    return float(value)


def health_details() -> bool:
    """``PG_LEASE_HEALTH_DETAILS`` (bool, default ``False``): the probes' details for every caller.

    `pg_lease_django.views.ready` and ``live`` tell an anonymous caller only ``ok`` or
    ``unavailable``. The held leases and the reason for a failure go to users with the
    ``pg_lease_django.view_lease`` permission. A held lease shows its key, owner and epoch, which is
    a fence. With True they go to everyone: set it for a probe port no one else reaches.

    Raises:
        ImproperlyConfigured: the setting is not a bool.
    """
    value = getattr(settings, "PG_LEASE_HEALTH_DETAILS", False)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"PG_LEASE_HEALTH_DETAILS must be a bool, got {value!r}")
    return value


def metrics_enabled() -> bool:
    """``PG_LEASE_METRICS`` (bool, default ``True``): export Prometheus metrics when ``prometheus_client`` is installed.

    With the ``metrics`` extra installed, the app registers its metrics in prometheus_client's
    default registry when Django starts, as docs/observability.md shows. ``False`` registers
    nothing. Without prometheus_client the setting changes nothing.
    """
    return bool(getattr(settings, "PG_LEASE_METRICS", True))


def metrics_database_view() -> bool:
    """``PG_LEASE_METRICS_DATABASE_VIEW`` (bool, default ``True``): add the database's view to the metrics.

    A collector reads them in one statement per scrape, from the router's write database for
    `Lease`. It reads the leases held, lapsed and free by key label, the oldest lapse and the
    waiters registered. With ``PG_LEASE_HISTORY`` it also reads the tenures ended by reason.
    ``False`` exports only the process's own metrics.
    """
    return bool(getattr(settings, "PG_LEASE_METRICS_DATABASE_VIEW", True))


def metrics_key_label() -> str | Callable[[str], str]:
    """``PG_LEASE_METRICS_KEY_LABEL`` (one character, a callable or its dotted path; default ``":"``).

    What the ``prefix`` label of a metric says about a key, so that labels stay few. One character
    labels a key by what comes before its first occurrence: ``"billing:acme:42"`` → ``"billing"``.
    Keys without it share ``"(none)"``. A callable ``f(key) -> str``, or its dotted path, decides
    otherwise. ``"pg_lease_django.metrics.whole_key"`` labels by the raw key, for a small fixed set
    of keys. Whatever the rule, ``PG_LEASE_METRICS_MAX_LABELS`` caps the labels of a process.

    Raises:
        ImproperlyConfigured: not a one-character string, a callable, or the dotted path of one.
    """
    from django.utils.module_loading import import_string

    value = getattr(settings, "PG_LEASE_METRICS_KEY_LABEL", ":")
    if isinstance(value, str) and len(value) == 1:
        return value
    if isinstance(value, str) and value:
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImproperlyConfigured(f"PG_LEASE_METRICS_KEY_LABEL: cannot import {value!r}: {exc}") from None
    if not callable(value):
        raise ImproperlyConfigured(
            "PG_LEASE_METRICS_KEY_LABEL must be one separator character, a callable f(key) -> str or its dotted "
            f"path, got {value!r}"
        )
    return value  # type: ignore[no-any-return]


def metrics_max_labels() -> int:
    """``PG_LEASE_METRICS_MAX_LABELS`` (int, default ``16``): the most key labels one process's metrics carry.

    The first labels this process meets are exported as they are. Every later one is counted under
    `pg_lease_django.metrics.OTHER_LABEL`, ``"(other)"``, so that a flood of unexpected keys cannot
    grow the scrape. Read when a label is first met.

    Raises:
        ImproperlyConfigured: the setting is not a positive integer.
    """
    value = getattr(settings, "PG_LEASE_METRICS_MAX_LABELS", 16)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ImproperlyConfigured(f"PG_LEASE_METRICS_MAX_LABELS must be a positive integer, got {value!r}")
    return value


def metrics_pushgateway() -> str | None:
    """``PG_LEASE_METRICS_PUSHGATEWAY`` (str URL or ``None``, default ``None``): where short-lived processes push.

    A process with the metrics on pushes them to this Prometheus Pushgateway when it exits, through
    `pg_lease_django.metrics.push.push`. It serves ``leases run`` and cron-started ``@leased``
    commands, which no server scrapes. ``None`` pushes nothing. Read at exit.

    Raises:
        ImproperlyConfigured: the setting is neither a non-empty string nor None.
    """
    value = getattr(settings, "PG_LEASE_METRICS_PUSHGATEWAY", None)
    if value is not None and (not isinstance(value, str) or not value):
        raise ImproperlyConfigured(f"PG_LEASE_METRICS_PUSHGATEWAY must be a Pushgateway URL or None, got {value!r}")
    return value
