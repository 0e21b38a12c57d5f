"""The renewal side of ``hold()``: one scheduler per process that runs every hold's `Heartbeat`.

Nothing here is public API; `pg_lease_django` is.

- **Renewals**: `Scheduler` is one thread per process. It keeps the due time of every hold, which
  is its next renewal and the end of its trust window. It hands each renewal to a bounded set of
  worker threads, at most ``PG_LEASE_HOLD_CONNECTIONS``, each sending on a connection of its own.
  These are workers rather than non-blocking I/O for two reasons. The calls go through Django's
  backend, with its error mapping, its ``OPTIONS`` and ``assume_role``, and that is blocking. And a
  thread per renewal in flight keeps one slow renewal, stuck on a locked row or a dying network,
  from delaying any other hold's renewal. Idle workers and the scheduler exit after ``IDLE_EXIT``
  seconds without work, and the idle connections are closed then too.
- **Fork**: a child never uses its parent's scheduler or workers; it gets its own.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from django.db import connections

from pg_lease_django import conf

from . import lease_pool
from .lease import HeldLease

if TYPE_CHECKING:
    from .heartbeat import Heartbeat

logger = logging.getLogger(__name__)

#: Seconds an idle worker thread, and the scheduler with no hold left, wait before they exit
#: (the scheduler then closes the idle pooled connections).
IDLE_EXIT = 2.0


class Scheduler:
    """One thread per process that wakes at each hold's due time, and a bounded set of workers."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._beats: set[Heartbeat] = set()
        self._thread: threading.Thread | None = None
        self._jobs: deque[Callable[[], None]] = deque()
        self._workers = 0
        self._idle_workers = 0

    def add(self, beat: Heartbeat) -> None:
        with self._cond:
            self._beats.add(beat)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pg_lease heartbeat scheduler", daemon=True)
                self._thread.start()

    def remove(self, beat: Heartbeat) -> None:
        with self._cond:
            self._beats.discard(beat)
            self._cond.notify_all()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the scheduler thread at ``when`` (monotonic): it must not block."""
        with self._cond:
            first = not self._heap or when < self._heap[0][0]
            heapq.heappush(self._heap, (when, next(self._seq), callback))
            if first:
                self._cond.notify_all()

    def submit(self, job: Callable[[], None], *, beyond_limit: bool = False) -> None:
        """Hand ``job`` to a worker. ``beyond_limit``: when no worker is idle, on a thread of its own
        at once, past the bound and the queue (declaring a loss must not wait for hung renewals)."""
        with self._cond:
            if beyond_limit and self._idle_workers <= len(self._jobs):
                threading.Thread(target=run_job, args=(job,), name="pg_lease heartbeat job", daemon=True).start()
                return
            self._jobs.append(job)
            # A worker per job waiting, up to the bound: a renewal that hangs never holds up another.
            if len(self._jobs) > self._idle_workers and self._workers < _worker_limit():
                self._workers += 1
                threading.Thread(target=self._work, name="pg_lease heartbeat worker", daemon=True).start()
            else:
                self._cond.notify_all()

    def leases(self) -> list[HeldLease]:
        """The leases of the holds registered now."""
        with self._cond:
            return [beat.lease for beat in self._beats]

    def stalled(self) -> bool:
        """Holds are registered but the scheduler thread that renews them is gone: they will be lost."""
        with self._cond:
            return bool(self._beats) and (self._thread is None or not self._thread.is_alive())

    def threads(self) -> int:
        """The scheduler thread (if running) and the worker threads."""
        with self._cond:
            return self._workers + (self._thread is not None)

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._next_due()
                if due is None:
                    self._thread = None
            if due is None:
                lease_pool.close_connections()  # no hold left for a while: no idle connection kept either
                return
            try:
                due()
            except BaseException:
                logger.exception("the heartbeat scheduler failed")

    def _next_due(self) -> Callable[[], None] | None:  # with self._cond held; None: time to exit
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            if self._heap and self._heap[0][0] <= now:
                _when, _seq, callback = heapq.heappop(self._heap)
                return callback
            if self._beats:
                idle_since = None
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
                continue
            self._heap.clear()  # stale due times of ended holds
            if idle_since is None:
                idle_since = now
            elif now - idle_since >= IDLE_EXIT:
                return None
            self._cond.wait(max(0.0, IDLE_EXIT - (now - idle_since)))

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle_workers += 1
                deadline = time.monotonic() + IDLE_EXIT
                while not self._jobs:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._idle_workers -= 1
                        self._workers -= 1
                        return
                    self._cond.wait(remaining)
                self._idle_workers -= 1
                job = self._jobs.popleft()
            run_job(job)


def run_job(job: Callable[[], None]) -> None:
    """Run ``job`` on this thread: log what it raises, close the Django connections it opened."""
    try:
        job()
    except BaseException:
        logger.exception("a heartbeat job failed")
    finally:
        # Django connections a job opened (an on_lost callback or a lease_lost receiver that queried
        # the database) are this thread's to close.
        for conn in connections.all(initialized_only=True):
            with suppress(Exception):
                conn.close()


def _worker_limit() -> int:
    try:
        return conf.hold_connections()
    except Exception:  # a setting broken while holds run: their renewals still go on
        logger.exception("PG_LEASE_HOLD_CONNECTIONS is invalid; renewing on one worker thread")
        return 1


_the_scheduler: Scheduler | None = None
_scheduler_lock = threading.Lock()
_fork_hook_registered = False


def process_scheduler() -> Scheduler:
    """The scheduler of this process (a new one after a fork); registers the at-fork hook the first time."""
    global _the_scheduler, _fork_hook_registered
    with _scheduler_lock:
        if not _fork_hook_registered:  # with the first scheduler, not at import
            _fork_hook_registered = True
            os.register_at_fork(after_in_child=_at_fork_child)
        if _the_scheduler is None or _the_scheduler.pid != os.getpid():
            _the_scheduler = Scheduler()
        return _the_scheduler


def scheduler_threads() -> int:
    """Threads the scheduler of this process runs now (itself and its workers)."""
    scheduler = _the_scheduler
    return 0 if scheduler is None or scheduler.pid != os.getpid() else scheduler.threads()


def scheduler_stalled() -> bool:
    """Whether this process's holds have lost their renewals' thread (a wedged process: restart it)."""
    scheduler = _the_scheduler
    return scheduler is not None and scheduler.pid == os.getpid() and scheduler.stalled()


def _at_fork_child() -> None:
    global _the_scheduler, _scheduler_lock
    _scheduler_lock = threading.Lock()  # a lock held by another thread at fork time stays held in the child
    _the_scheduler = None  # the child's holds get a scheduler of their own


def active_holds() -> list[HeldLease]:
    """The leases this process holds now through ``hold()`` / ``@leased`` / ``elect()``, in no order."""
    scheduler = _the_scheduler
    if scheduler is None or scheduler.pid != os.getpid():
        return []
    return scheduler.leases()
