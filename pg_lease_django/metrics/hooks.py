"""Prometheus metrics of this process's lease calls, holds, elections and fenced writes (docs/observability.md).

Optional: with ``prometheus_client`` installed (the ``metrics`` extra) and ``PG_LEASE_METRICS`` on
(the default), `install` registers the metrics below in prometheus_client's default registry when
Django starts (``PgLeaseConfig.ready``), so django-prometheus' ``/metrics`` or prometheus_client's
own server shows them with no user code. Without prometheus_client nothing is imported and every
hook below is one global read.

Every lease call is counted once, whichever API made it (``Lease.objects``, sync or async,
``hold()``, ``@leased``, elections, ``leases run``), where its answer is read: `operations` calls
`granted`, `refused`, `renewal_confirmed` and `release_confirmed` as it decodes the statement's row
(and the async blocking wait, which sends its own statements, as it decodes its attempts), and both
blocking waits run inside `waiting` (a timeout, the wait's time). A loss is counted where the holder
learns of it: ``Lease.objects.renew`` / ``release`` (`lost`) or a hold's ``lease_lost`` signal. The
signals give the holds' gauges and lapses; a few hooks say what no signal says: a hold's renewal
latency and slack (`hold_renewed`, `renewal_failed`), a refused fenced write
(`fenced_write_refused`) and an election's campaign and terms (`campaigning`, `leading`). A hook
never raises.

Every metric has a ``prefix`` label: `key_label` of the key (``PG_LEASE_METRICS_KEY_LABEL``), never
the raw key unless asked. Labels are bounded by construction: keys without the separator share
`NO_PREFIX_LABEL`, and a process exports at most ``PG_LEASE_METRICS_MAX_LABELS`` labels, the later
ones counted under `OTHER_LABEL`.

What a short-lived process counted leaves it at exit through `pg_lease_django.metrics_push`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pg_lease_django import conf
from pg_lease_django.exceptions import LeaseTimeoutError, NotAcquirableError
from pg_lease_django.signals import lease_acquired, lease_handoff_requested, lease_lost, lease_released

from . import tracing

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pg_lease_django.holds.lease import HeldLease

__all__ = [
    "METRICS",
    "NO_PREFIX_LABEL",
    "OTHER_LABEL",
    "acquiring",
    "campaigning",
    "collectors",
    "fenced_write_refused",
    "granted",
    "hold_renewed",
    "install",
    "install_quietly",
    "install_tracing",
    "installed",
    "key_label",
    "leading",
    "lost",
    "refused",
    "release_confirmed",
    "renewal_confirmed",
    "renewal_failed",
    "uninstall",
    "waiting",
    "whole_key",
]

logger = logging.getLogger(__name__)

#: Every metric this module exports: name (as exposed, counters with ``_total``), type, labels.
#: docs/observability.md and the Grafana dashboard are checked against it (tests/test_metrics.py).
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

#: The label of every key without the separator of ``PG_LEASE_METRICS_KEY_LABEL``: they share it.
NO_PREFIX_LABEL = "(none)"
#: The label of the keys whose own label came after ``PG_LEASE_METRICS_MAX_LABELS`` others in this process.
OTHER_LABEL = "(other)"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLACK_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def whole_key(key: str) -> str:
    """The raw key as its label: ``PG_LEASE_METRICS_KEY_LABEL = "pg_lease_django.metrics.whole_key"``.

    Only for a bounded set of keys: every key becomes a series of every metric.
    """
    return key


def _labeller() -> Callable[[str], str]:
    rule = conf.metrics_key_label()
    if isinstance(rule, str):
        separator = rule

        def up_to_separator(key: str) -> str:
            head, found, _rest = key.partition(separator)
            return head if found else NO_PREFIX_LABEL

        return up_to_separator
    return rule


class _Instruments:
    """The metrics, created in ``registry`` by `install`."""

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
        """Add one to ``metric`` for ``key``'s label (and ``labels``); never raises: a lease call that
        committed must return (in multiprocess mode an increment writes to a file, which can fail)."""
        try:
            self.child(metric, self.prefix(key), *labels).inc()
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


class _TracedAcquire:
    """Around one acquire of a hold: its span (outcome, epoch)."""

    __slots__ = ("epoch", "prefix", "span")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.epoch: int | None = None
        self.span: Any = None

    def granted(self, epoch: int) -> None:
        """The acquire was granted at ``epoch`` (for its span)."""
        self.epoch = epoch

    def __enter__(self) -> _TracedAcquire:
        self.span = tracing.start("pg_lease.acquire", self.prefix)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            outcome = "granted"
        elif issubclass(exc_type, NotAcquirableError):
            outcome = "busy"
        elif issubclass(exc_type, LeaseTimeoutError):
            outcome = "timeout"
        else:
            outcome = "error"  # interrupted, or the database failed: neither a grant nor a refusal
        try:
            tracing.finish(self.span, outcome, self.epoch)
        except Exception:
            logger.exception("tracing an acquire failed")


class _Waiting:
    """Around a blocking wait: its time by outcome, and a timeout counted as a refusal."""

    __slots__ = ("instruments", "prefix", "started")

    def __init__(self, instruments: _Instruments, prefix: str) -> None:
        self.instruments = instruments
        self.prefix = prefix
        self.started = 0.0

    def __enter__(self) -> _Waiting:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        instruments, prefix = self.instruments, self.prefix
        try:
            if exc_type is None:
                outcome = "granted"  # the grant itself is counted by the attempt that got it
            elif issubclass(exc_type, LeaseTimeoutError):
                outcome = "timeout"
                instruments.child(instruments.refusals, prefix, outcome).inc()
            else:
                return  # interrupted, or the database failed: neither a grant nor a refusal
            instruments.child(instruments.wait, prefix, outcome).observe(time.monotonic() - self.started)
        except Exception:
            logger.exception("recording a blocking wait in the metrics failed")


class _NotMeasured:
    """`acquiring` / `waiting` when nothing measures them: does nothing."""

    def granted(self, epoch: int) -> None:
        pass

    def __enter__(self) -> _NotMeasured:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        pass


_instruments: _Instruments | None = None
_tracing = False  # install_tracing() found opentelemetry-api
_install_lock = threading.Lock()


def installed() -> bool:
    """True once `install` registered the metrics in this process."""
    return _instruments is not None


def collectors() -> list[Any]:
    """The process's metrics as prometheus_client collectors (none when not installed): what `metrics_push` sends."""
    instruments = _instruments
    return [] if instruments is None else instruments.collectors()


def install(registry: CollectorRegistry | None = None) -> bool:
    """Register the process's metrics once (the app's ``ready()`` then adds `metrics_db`'s collector).

    Called by the app's ``ready()``; a second call does nothing. Returns False, registering nothing,
    when prometheus_client is not installed or ``PG_LEASE_METRICS`` is False.

    Args:
        registry: where to register; default prometheus_client's default registry.

    Raises:
        ImproperlyConfigured: ``PG_LEASE_METRICS_KEY_LABEL``, ``PG_LEASE_METRICS_MAX_LABELS`` or
            ``PG_LEASE_METRICS_PUSHGATEWAY`` is invalid.
    """
    global _instruments
    if not conf.metrics_enabled():
        return False
    try:
        import prometheus_client
    except ImportError:
        return False
    label = _labeller()
    conf.metrics_max_labels()  # a bad value is reported now, not at the first lease call
    conf.metrics_pushgateway()
    with _install_lock:
        if _instruments is not None:
            return True
        target = prometheus_client.REGISTRY if registry is None else registry
        instruments = _Instruments(target, label)
        for signal_, receiver in instruments.receivers():
            signal_.connect(receiver, weak=False, dispatch_uid=f"pg_lease_django.metrics.{receiver.__name__}")
        _instruments = instruments
    return True


def uninstall() -> None:
    """Undo `install`: disconnect the receivers, unregister the metrics; the hooks do nothing again.

    For benchmarks (the metrics' cost, side by side) and tests; a later `install` starts from zero.
    """
    global _instruments
    with _install_lock:
        instruments, _instruments = _instruments, None
        if instruments is None:
            return
        for signal_, receiver in instruments.receivers():
            signal_.disconnect(dispatch_uid=f"pg_lease_django.metrics.{receiver.__name__}")
        for collector in instruments.collectors():
            instruments.registry.unregister(collector)


def install_tracing() -> bool:
    """Trace the holds' lease operations when opentelemetry-api is installed (`pg_lease_django.tracing`).

    Called by the app's ``ready()``; False (and nothing done) without opentelemetry-api.
    """
    global _tracing
    if tracing.tracer() is None:
        return False
    with _install_lock:
        lease_released.connect(_trace_released, weak=False, dispatch_uid="pg_lease_django.tracing.released")
        lease_lost.connect(_trace_lost, weak=False, dispatch_uid="pg_lease_django.tracing.lost")
        _tracing = True
    return True


def _trace_released(sender: Any, lease: Any, freed: bool, **kwargs: Any) -> None:
    tracing.record("pg_lease.release", key_label(lease.key), "freed" if freed else "kept", lease.epoch)


def _trace_lost(sender: Any, lease: Any, error: Any, **kwargs: Any) -> None:
    tracing.record("pg_lease.lost", key_label(lease.key), str(getattr(error, "code", "unknown")), lease.epoch)


def install_quietly() -> bool:
    """`install`, logging instead of raising on a bad setting (check ``pg_lease_django.E005`` reports it)."""
    from django.core.exceptions import ImproperlyConfigured

    try:
        return install()
    except ImproperlyConfigured as exc:
        logger.error("the lease metrics are not registered: %s", exc)
        return False


def key_label(key: str) -> str:
    """The ``prefix`` label the metrics give ``key`` (``PG_LEASE_METRICS_KEY_LABEL``)."""
    instruments = _instruments
    return instruments.prefix(key) if instruments is not None else _labeller()(key)


# ---- the hooks the library calls -----------------------------------------------------------------

_NOT_MEASURED = _NotMeasured()


def granted(key: str) -> None:
    """The server granted ``key`` (an attempt's row said so), whichever call sent the attempt."""
    instruments = _instruments
    if instruments is not None:
        instruments.count(instruments.grants, key)


def refused(key: str) -> None:
    """A non-blocking acquire of ``key`` was refused: another owner holds it (``busy``)."""
    instruments = _instruments
    if instruments is not None:
        instruments.count(instruments.refusals, key, "busy")


def renewal_confirmed(key: str) -> None:
    """The server confirmed a renewal of ``key``."""
    instruments = _instruments
    if instruments is not None:
        instruments.count(instruments.renewals, key)


def release_confirmed(key: str) -> None:
    """The server confirmed a release of ``key`` (the key is free)."""
    instruments = _instruments
    if instruments is not None:
        instruments.count(instruments.releases, key)


def lost(key: str, reason: str) -> None:
    """A caller of ``Lease.objects`` learnt that its lease of ``key`` is lost (``reason``: the error's code).

    A hold's losses are counted from its ``lease_lost`` signal instead.
    """
    instruments = _instruments
    if instruments is not None:
        instruments.count(instruments.losses, key, reason)


def waiting(key: str) -> _Waiting | _NotMeasured:
    """Around a blocking acquire's whole wait: its time by outcome, and a timeout counted as a refusal.

    The grant itself is counted by the attempt that got it (`granted`).
    """
    instruments = _instruments
    if instruments is None:
        return _NOT_MEASURED
    return _Waiting(instruments, instruments.prefix(key))


def acquiring(key: str) -> _TracedAcquire | _NotMeasured:
    """Around a hold's acquire: its span, when tracing is on (its grant or refusal is counted below it).

    The holder calls ``granted(epoch)`` on what the ``with`` gives, once it has the grant.
    """
    return _TracedAcquire(key_label(key)) if _tracing else _NOT_MEASURED


def hold_renewed(key: str, epoch: int, sent_at: float, trusted_until: float) -> None:
    """A hold's renewal sent at ``sent_at`` (monotonic) was confirmed: its latency and slack, its span.

    ``trusted_until``: the trust window's end before it. The renewal itself is counted by `renewal_confirmed`.
    """
    instruments = _instruments
    if instruments is None and not _tracing:
        return
    try:
        now = time.monotonic()
        if instruments is not None:
            prefix = instruments.prefix(key)
            instruments.child(instruments.latency, prefix).observe(max(0.0, now - sent_at))
            instruments.child(instruments.slack, prefix).observe(max(0.0, trusted_until - now))
        if _tracing:
            tracing.record("pg_lease.renew", key_label(key), "renewed", epoch, began_seconds_ago=now - sent_at)
    except Exception:
        logger.exception("recording a renewal in the metrics failed")


def renewal_failed(key: str) -> None:
    """A renewal failed without a verdict (it is retried)."""
    instruments = _instruments
    if instruments is not None:
        instruments.child(instruments.renewal_errors, instruments.prefix(key)).inc()


def fenced_write_refused(key: str | None, reason: str) -> None:
    """The database refused a fenced write of this process (``reason``: the error's code)."""
    instruments = _instruments
    if instruments is not None:
        instruments.child(instruments.fenced_refused, instruments.prefix(key), reason).inc()


def campaigning(key: str, delta: int) -> None:
    """An election of this process started (+1) or stopped (-1) campaigning for ``key``."""
    instruments = _instruments
    if instruments is not None:
        instruments.child(instruments.elections, instruments.prefix(key)).inc(delta)


def leading(lease: HeldLease) -> None:
    """An election of this process started a term under ``lease``; it ends with the hold (released or lost)."""
    instruments = _instruments
    if instruments is not None:
        instruments.lead(lease)
