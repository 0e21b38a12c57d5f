"""The line ``leases run --wait`` shows on a terminal while it waits for the lease (`StatusLine`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from django.core.management.base import OutputWrapper
from django.db import connections

from pg_lease_django.display import describe_expiry, format_duration, printable
from pg_lease_django.operations import LeaseState
from pg_lease_django.status import LeaseStatus

__all__ = ["StatusLine", "expiry_of"]

logger = logging.getLogger(__name__)

# How often the line is refreshed, and how long a wait must last before it first appears (an
# acquire that succeeds at once shows nothing).
_STATUS_REFRESH = 0.25


def expiry_of(state: LeaseState) -> str:
    """When the lease ``pg_lease_inspect`` saw expires, for people: ``in 29s``, ``lapsed 3s ago``, ``-``."""
    expires_in = None if state.expires_at is None else state.expires_at - state.server_time
    return describe_expiry(LeaseStatus(state.status), expires_in)


class StatusLine(threading.Thread):
    """On a terminal: one line on stderr, rewritten in place, while ``--wait`` waits for the lease.

    Reads the lease through ``pg_lease_inspect``, which is what a worker may read of its keys, on a
    connection of this thread's own; the waiting acquire has its own too. It never blocks the wait:
    any failure only ends the status line.
    The key and the holder are others' text: shown through `printable`, never obeyed by the terminal.
    """

    def __init__(self, key: str, read_lease: Callable[[], LeaseState], stderr: OutputWrapper, wait: float) -> None:
        super().__init__(name=f"leases run status {key}"[:100], daemon=True)
        self.key, self.read_lease, self.stderr, self.wait = key, read_lease, stderr, wait
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._shown = False

    def run(self) -> None:
        started = time.monotonic()
        key = printable(self.key)
        try:
            while not self._stopped.wait(_STATUS_REFRESH):
                state = self.read_lease()
                owner = printable(state.owner or "")
                waited = format_duration(timedelta(seconds=time.monotonic() - started))
                if state.status == LeaseStatus.FREE.value:
                    text = f"waiting for {key} (free now)"
                elif state.status == LeaseStatus.LAPSED.value:
                    text = f"waiting for {key} (lapsed, last held by {owner})"
                else:
                    text = f"waiting for {key} held by {owner}, expires {expiry_of(state)}"
                self._show(f"{text} (waited {waited} of {format_duration(timedelta(seconds=self.wait))})")
        except Exception:
            logger.debug("the wait status line for %r failed", self.key, exc_info=True)
        finally:
            connections.close_all()  # this thread's own

    def _show(self, text: str) -> None:
        with self._lock:
            if not self._stopped.is_set():
                self.stderr.write(f"\r\x1b[K{text}", style_func=str, ending="")
                self.stderr.flush()
                self._shown = True

    def stop(self) -> None:
        """Stop refreshing and erase the line (idempotent)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if self._shown:
                self.stderr.write("\r\x1b[K", style_func=str, ending="")
                self.stderr.flush()
