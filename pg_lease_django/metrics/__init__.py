"""The metrics: `hooks` (the process's Prometheus metrics), `push`, `database_view`, `tracing`."""

from .hooks import whole_key

__all__ = ["whole_key"]
