"""OpenTelemetry spans of the lease operations of holds, where ``opentelemetry-api`` is installed.

A no-op otherwise: nothing is imported after the first look. With the API but no SDK configured,
OpenTelemetry's own no-op tracer answers. The spans come from the tracer ``pg_lease_django``. Each
has the attributes ``pg_lease.prefix``, ``pg_lease.outcome`` and, once known, ``pg_lease.epoch``.
The prefix is the key's label, by `pg_lease_django.metrics.hooks.key_label`'s rule.

- ``pg_lease.acquire``: a hold's acquire, blocking wait included; outcome ``granted``, ``busy``,
  ``timeout`` or ``error``.
- ``pg_lease.renew``: a confirmed renewal, from sending it to its confirmation; outcome ``renewed``.
- ``pg_lease.release`` / ``pg_lease.lost``: the end of a hold, with no duration, since the signal
  that says so comes after it; outcome ``freed`` / ``kept``, or the loss's error code.

Called by `pg_lease_django.metrics.hooks`' hooks and receivers, with `TracedAcquire` around a
hold's acquire; nothing here is public API.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pg_lease_django.exceptions import LeaseTimeoutError, NotAcquirableError

logger = logging.getLogger(__name__)

_UNKNOWN: Any = object()
_tracer: Any = _UNKNOWN


def tracer() -> Any:
    """The ``pg_lease_django`` tracer, or None without opentelemetry-api (looked up once)."""
    global _tracer
    if _tracer is _UNKNOWN:
        try:
            from opentelemetry.trace import get_tracer
        except ImportError:
            _tracer = None
        else:
            _tracer = get_tracer("pg_lease_django")
    return _tracer


def start(name: str, prefix: str) -> Any:
    """Start a span (None without OpenTelemetry); end it with `finish`."""
    found = tracer()
    if found is None:
        return None
    return found.start_span(name, attributes={"pg_lease.prefix": prefix})


def finish(span: Any, outcome: str, epoch: int | None = None) -> None:
    """Set the outcome (and epoch) of ``span`` and end it."""
    if span is None:
        return
    span.set_attribute("pg_lease.outcome", outcome)
    if epoch is not None:
        span.set_attribute("pg_lease.epoch", epoch)
    span.end()


def record(name: str, prefix: str, outcome: str, epoch: int | None, *, began_seconds_ago: float = 0.0) -> None:
    """A span that already happened: it began ``began_seconds_ago`` and ends now."""
    found = tracer()
    if found is None:
        return
    start_ns = time.time_ns() - int(max(began_seconds_ago, 0.0) * 1e9)
    attributes: dict[str, Any] = {"pg_lease.prefix": prefix, "pg_lease.outcome": outcome}
    if epoch is not None:
        attributes["pg_lease.epoch"] = epoch
    found.start_span(name, attributes=attributes, start_time=start_ns).end()


class TracedAcquire:
    """Around one acquire of a hold: its span (outcome, epoch)."""

    __slots__ = ("epoch", "prefix", "span")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.epoch: int | None = None
        self.span: Any = None

    def granted(self, epoch: int) -> None:
        """The acquire was granted at ``epoch`` (for its span)."""
        self.epoch = epoch

    def __enter__(self) -> TracedAcquire:
        self.span = start("pg_lease.acquire", self.prefix)
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
            finish(self.span, outcome, self.epoch)
        except Exception:
            logger.exception("tracing an acquire failed")
