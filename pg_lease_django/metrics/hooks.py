"""The process's Prometheus metrics, installed once, and the hooks the library calls.

docs/observability.md lists the metrics. They are optional. They need ``prometheus_client``, which
the ``metrics`` extra installs, and ``PG_LEASE_METRICS`` on, the default. Then `install` registers
the metrics of `pg_lease_django.metrics.instruments` in prometheus_client's default registry when
Django starts, from ``PgLeaseConfig.ready``. So django-prometheus' ``/metrics`` or
prometheus_client's own server shows them with no user code. Without prometheus_client nothing is
imported and every hook below is one global read.

Every lease call is counted once, where its answer is read, whichever API made it:
``Lease.objects`` sync or async, ``hold()``, ``@leased``, elections, ``leases run``. `operations`
calls `granted`, `refused`, `renewal_confirmed` and `release_confirmed` as it decodes the
statement's row. The async blocking wait sends its own statements, and calls them as it decodes
its attempts. Both blocking waits run inside `waiting`, which counts a timeout and the wait's time.
A loss is counted where the holder learns of it: in ``Lease.objects.renew`` / ``release``, through
`lost`, or by a hold's ``lease_lost`` signal. The signals give the holds' gauges and lapses. A few
hooks say what no signal says: `hold_renewed` and `renewal_failed` a hold's renewal latency and
slack, `fenced_write_refused` a refused fenced write, `campaigning` and `leading` an election's
campaign and terms. A hook never raises.

Every metric has a ``prefix`` label: `key_label` of the key. That follows
``PG_LEASE_METRICS_KEY_LABEL``, bounded by the process's label cap, as `pg_lease_django.metrics`
says. `install_tracing` turns on spans of holds' operations, through
`pg_lease_django.metrics.tracing`, where opentelemetry-api is installed. What a short-lived process
counted leaves it at exit through `pg_lease_django.metrics.push`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pg_lease_django import conf
from pg_lease_django.exceptions import LeaseTimeoutError
from pg_lease_django.signals import lease_lost, lease_released

from . import labeller, tracing
from .instruments import Instruments
from .tracing import TracedAcquire

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pg_lease_django.holds.lease import HeldLease

__all__ = [
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
]

logger = logging.getLogger(__name__)


class _Waiting:
    """Around a blocking wait: its time by outcome, and a timeout counted as a refusal."""

    __slots__ = ("instruments", "prefix", "started")

    def __init__(self, instruments: Instruments, prefix: str) -> None:
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


_instruments: Instruments | None = None
_tracing = False  # install_tracing() found opentelemetry-api
_install_lock = threading.Lock()


def installed() -> bool:
    """True once `install` registered the metrics in this process."""
    return _instruments is not None


def collectors() -> list[Any]:
    """The process's metrics as prometheus_client collectors (none when not installed): what `push` sends."""
    instruments = _instruments
    return [] if instruments is None else instruments.collectors()


def install(registry: CollectorRegistry | None = None) -> bool:
    """Register the process's metrics once (the app's ``ready()`` then adds `database_view`'s collector).

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
    label = labeller()
    conf.metrics_max_labels()  # a bad value is reported now, not at the first lease call
    conf.metrics_pushgateway()
    with _install_lock:
        if _instruments is not None:
            return True
        target = prometheus_client.REGISTRY if registry is None else registry
        instruments = Instruments(target, label)
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
    """Trace the holds' lease operations when opentelemetry-api is installed.

    The spans are those of `pg_lease_django.metrics.tracing`. Called by the app's ``ready()``.
    Without opentelemetry-api it does nothing and returns False.
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
    return instruments.prefix(key) if instruments is not None else labeller()(key)


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


def acquiring(key: str) -> TracedAcquire | _NotMeasured:
    """Around a hold's acquire: its span, when tracing is on (its grant or refusal is counted below it).

    The holder calls ``granted(epoch)`` on what the ``with`` gives, once it has the grant.
    """
    return TracedAcquire(key_label(key)) if _tracing else _NOT_MEASURED


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
    """An election of this process started or stopped campaigning for ``key``: ``delta`` is +1 or -1."""
    instruments = _instruments
    if instruments is not None:
        instruments.child(instruments.elections, instruments.prefix(key)).inc(delta)


def leading(lease: HeldLease) -> None:
    """An election of this process started a term under ``lease``; it ends with the hold (released or lost)."""
    instruments = _instruments
    if instruments is not None:
        instruments.lead(lease)
