"""A process of its own for tests/db/test_metrics.py: tracing with an in-memory exporter, or no optional package.

    python -m tests.children.observability_child spans KEY     (DATABASE_URL: the test database)
    python -m tests.children.observability_child without KEY

``spans``: installs OpenTelemetry's SDK with an in-memory exporter before Django starts, then holds
KEY until one renewal is traced, is refused KEY from another thread meanwhile, releases it, and
prints every span as a JSON line. ``without``: hides prometheus_client, rich and opentelemetry (an
import of them fails, as when they are not installed), holds KEY and prints what was installed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable


def _hold_and_refuse(key: str, until: Callable[[], bool]) -> None:
    from pg_lease_django import NotAcquirableError, hold

    with hold(key, ttl=0.6):
        refused: list[BaseException] = []

        def other() -> None:
            try:
                with hold(key, ttl=0.6):
                    pass
            except NotAcquirableError as exc:
                refused.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert refused, "the second hold was not refused"
        deadline = time.monotonic() + 60  # a hang guard
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)


def main() -> None:
    mode, key = sys.argv[1:]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    if mode == "without":
        for name in ("prometheus_client", "rich", "opentelemetry"):
            # None in sys.modules: an import of it fails, as when it is not installed.
            sys.modules[name] = None  # type: ignore[assignment]
        import django

        django.setup()
        from pg_lease_django import hold
        from pg_lease_django.management.leases import live_view
        from pg_lease_django.metrics import hooks

        with hold(key, ttl=5) as lease:
            epoch = lease.epoch
        print(json.dumps({"metrics": hooks.installed(), "rich": live_view.rich_available(), "epoch": epoch}))
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    import django

    django.setup()
    _hold_and_refuse(key, lambda: any(s.name == "pg_lease.renew" for s in exporter.get_finished_spans()))
    for span in exporter.get_finished_spans():
        print(
            json.dumps(
                {
                    "name": span.name,
                    "attributes": dict(span.attributes or {}),
                    "duration_ns": (span.end_time or 0) - (span.start_time or 0),
                }
            )
        )


if __name__ == "__main__":
    main()
