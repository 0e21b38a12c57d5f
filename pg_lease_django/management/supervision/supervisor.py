"""``leases run``: run a command while holding a lease, as ``flock`` does on one machine, for a whole cluster.

`Supervisor` acquires the lease with `hold()`, runs COMMAND with the lease in its environment,
signals COMMAND if the lease is lost, passes signals on, and releases at the end. ``manage.py
leases run`` is its command line; it needs nothing from the command and can be driven directly::

    status = Supervisor("jobs:reindex", ["./reindex.sh"], ttl=30).run()  # raises RunError for 75-77, 126, 127

`CampaignSupervisor` of ``leases run --campaign``, a `Supervisor` too, keeps COMMAND running on
exactly one machine of many.

``grace`` bounds every SIGTERM, the one sent on a loss and a deploy's from systemd or the kubelet:
COMMAND's group is SIGKILLed ``grace`` seconds after the first, then the lease is released, before
the platform's own SIGKILL would end the supervisor too and leave the lease to lapse.

`ExitCode` in `pg_lease_django.management.exit_codes` is the exit-code table of the whole
``manage.py leases`` command; ``run``'s own codes are the supervisor's outcomes, raised as `RunError`.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from types import FrameType
from typing import Any

from django.core.management.base import OutputWrapper
from django.db import connections, router

from pg_lease_django.display import printable
from pg_lease_django.exceptions import LeaseTimeoutError, NotAcquirableError
from pg_lease_django.holds.holding import hold
from pg_lease_django.holds.lease import HeldLease
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.models import Lease
from pg_lease_django.operations import LeaseState

from .child_process import Child, describe_exit, signal_name, terminal_foreground
from .status_line import StatusLine, expiry_of

__all__ = ["DEFAULT_GRACE", "FORWARDED_SIGNALS", "RunError", "Supervisor", "quoted"]

logger = logging.getLogger(__name__)

#: Seconds between a SIGTERM (sent to COMMAND when the lease is lost, or received and passed on)
#: and the SIGKILL that follows if COMMAND still runs.
DEFAULT_GRACE = 10.0
#: Signals the supervisor passes on to COMMAND.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class RunError(Exception):
    """The run ended without COMMAND's status deciding it: busy, lost, timed out, or COMMAND not runnable.

    Attributes:
        exit_code: what to exit with (`ExitCode.BUSY`, ``LOST``, ``TIMED_OUT``, ``CANNOT_EXECUTE``
            or ``COMMAND_NOT_FOUND``).
    """

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def quoted(text: str) -> str:
    """A key, an owner: chosen by others, shown quoted and escaped (`printable`), never obeyed by a terminal."""
    return f"'{printable(text)}'"


class _Interrupted(BaseException):
    """A forwarded signal arrived before COMMAND started: stop waiting, release, exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Supervisor:
    """One run: acquire with ``hold()``, run COMMAND, supervise it, release.

    The lease is held with `pg_lease_django.hold`, whose heartbeat renews it on a connection of the
    lease's own; this class only watches ``HeldLease.lost`` and the child. The main thread sleeps in
    one ``select()`` on the child's pidfd, which becomes readable when the child exits, and on a pipe
    the hold's ``on_lost`` writes to. Its timeout is the end of the trust window or of the grace
    period. Signals are handled in the main thread: before COMMAND starts they interrupt the wait;
    afterwards they are passed on to COMMAND. So `run` must be called from the main thread, once
    per Supervisor.

    Args:
        key: the lease key.
        argv: COMMAND and its arguments.
        ttl: seconds each grant and renewal lasts.
        wait: wait up to this many seconds for the lease; None does not wait, and busy is `ExitCode.BUSY`.
        grace: seconds COMMAND gets after a SIGTERM before SIGKILL. The SIGTERM is one sent because the
            lease was lost or, campaigning, handed off, or the first one this process received.
        owner: the owner identity; default ``host:pid:random``, new for every run.
        using: the database alias; default where the router sends writes of leases.
        verbosity: 0 says nothing, 1 reports signals and losses, 2 the grant and the release too.
        stdout, stderr: stderr gets the messages; both are flushed before COMMAND starts.
    """

    def __init__(
        self,
        key: str,
        argv: Sequence[str],
        *,
        ttl: float,
        wait: float | None = None,
        grace: float = DEFAULT_GRACE,
        owner: str | None = None,
        using: str | None = None,
        verbosity: int = 1,
        stdout: OutputWrapper | None = None,
        stderr: OutputWrapper | None = None,
    ) -> None:
        self.key, self.argv = key, list(argv)
        self._key = quoted(key)  # as messages show it
        self.using = using or router.db_for_write(Lease)
        self.verbosity = verbosity
        self.ttl, self.wait, self.grace, self.owner = ttl, wait, grace, owner
        self.stdout = stdout or OutputWrapper(sys.stdout)
        self.stderr = stderr or OutputWrapper(sys.stderr)
        self.child: Child | None = None
        self._started = False  # from here on signals are forwarded, not raised
        self._interrupted = False  # a signal already stopped the wait: further ones must not cut the release short
        self._terminated_at_loss = False
        self._sigterm_at: float | None = None  # the first SIGTERM received while COMMAND runs (monotonic)
        self._pending: list[int] = []  # forwarded signals that arrived while COMMAND was being started
        self._wake_lock = threading.Lock()
        self._wake_r = self._wake_w = -1  # a pipe while running: the hold's on_lost wakes the main thread

    def read_lease(self) -> LeaseState:
        """The lease as ``pg_lease_inspect`` sees it, on this thread's connection: what a worker may
        read of its own keys (the lease table is the operators'), so busy and timed out stay 75 and 77
        from every seat that may hold the key."""
        return Lease.objects.db_manager(self.using).inspect(self.key)

    # -- messages ------------------------------------------------------------------------------------

    def _say(self, text: str, *, level: int = 1) -> None:
        if self.verbosity >= level:
            self.stderr.write(f"leases run: {text}")
            self.stderr.flush()

    @property
    def _name(self) -> str:
        return printable(os.path.basename(self.argv[0]) or self.argv[0])

    # -- signals -------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._started:
            if not self._interrupted:
                self._interrupted = True
                raise _Interrupted(signum)
            return
        if signum == signal.SIGTERM and self._sigterm_at is None:
            # A deploy's stop: --grace runs from here, whoever sent it. _watch takes it into account.
            self._sigterm_at = time.monotonic()
            self._wake()
        if self.child is None:
            self._pending.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self.child
        # returncode is set only by poll()/wait() in this (the main) thread, where this handler
        # runs too: while it is None the child has not been reaped, so its pid is still its own.
        # Once reaped, its process group (pgid = its pid, never reused while the group lives) may
        # still hold the processes it left running: they get the signal while the lease is held.
        if child is None or (child.popen.returncode is not None and not child.group_left()):
            return
        if signum == signal.SIGINT and not child.own_group and terminal_foreground():
            return  # Ctrl-C: the terminal sent it to COMMAND as well (same process group)
        child.signal(signum)

    def _wake(self, lease: HeldLease | None = None) -> None:
        # on_lost of the hold, called once from a heartbeat worker thread (and, campaigning, the
        # election's: the lease was lost, a hand-off was requested, or the campaign was stopped).
        with self._wake_lock, suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    # -- the run -------------------------------------------------------------------------------------

    def run(self) -> int:
        """Acquire, run COMMAND, release; return the exit status: COMMAND's, or 128 + N for a signal.

        Raises:
            RunError: busy, timed out, lease lost, or COMMAND could not be run; ``exit_code`` says which.
            NotAcquirableError and LeaseTimeoutError never escape; database errors do.
        """
        previous: dict[int, Any] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            for signum in FORWARDED_SIGNALS:
                handler = signal.getsignal(signum)
                if handler == signal.SIG_IGN:
                    continue  # ignored when we started: stays ignored, for COMMAND too (as in a shell)
                previous[signum] = handler
                signal.signal(signum, self._on_signal)
            try:
                return self._main()
            except _Interrupted as exc:
                self._say(self._not_run(exc.signum))
                return 128 + exc.signum
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _main(self) -> int:
        """The run, its signal handlers in place: hold the lease, run COMMAND once (`CampaignSupervisor`: per term)."""
        return self._hold_and_run()

    def _not_run(self, signum: int) -> str:
        """What to say when signal ``signum`` stopped the run while COMMAND was not running."""
        return f"{signal_name(signum)} before {self._name} started: not run, lease not held"

    def _hold_and_run(self) -> int:
        holding = hold(
            self.key,
            self.ttl,
            owner=self.owner,
            blocking=self.wait is not None,
            timeout=self.wait,
            on_lost=self._wake,
            using=self.using,
        )
        status: StatusLine | None = None
        if self.wait is not None and self.stderr.isatty():
            status = StatusLine(self.key, self.read_lease, self.stderr, self.wait)
            status.start()
        try:
            with holding as lease:
                if status is not None:
                    status.stop()
                returncode = self._supervise(lease)
        except NotAcquirableError:
            raise RunError(f"{self._holder()}; {self._name} was not run", ExitCode.BUSY) from None
        except LeaseTimeoutError:
            raise RunError(
                f"timed out after waiting {self.wait:g}s: {self._holder()}; {self._name} was not run",
                ExitCode.TIMED_OUT,
            ) from None
        finally:
            if status is not None:
                status.stop()
                status.join(timeout=1.0)

        # The hold has ended: released, or found lost (a release refused at exit counts as a loss).
        error = lease.error
        if error is not None:
            what = (
                f"{self._name} {describe_exit(returncode)}"
                if not self._terminated_at_loss
                else self._kill_report(returncode)
            )
            raise RunError(
                f"lease {self._key} (epoch {lease.epoch}) was lost while {self._name} ran ({error.code}): {what}",
                ExitCode.LOST,
            )
        if lease.released:
            self._say(f"released {self._key} (epoch {lease.epoch}); {self._name} {describe_exit(returncode)}", level=2)
        else:  # the release did not commit (the database did not answer in time): say so, never "released"
            self._say(
                f"{self._name} {describe_exit(returncode)}; the release of {self._key} (epoch {lease.epoch}) did not "
                f"complete: the lease lapses at {lease.expires_at.isoformat(timespec='milliseconds')} (server clock)"
            )
        return returncode if returncode >= 0 else 128 - returncode

    def _holder(self) -> str:
        state = self.read_lease()
        connections[self.using].close()  # no idle connection left behind by a status query
        if not state.held or state.owner is None:
            return f"lease {self._key} was held by another owner"
        return f"lease {self._key} is held by {quoted(state.owner)} (epoch {state.epoch}, expires {expiry_of(state)})"

    def _supervise(self, lease: HeldLease) -> int:
        """Start COMMAND and wait for it, signalling it if the lease is lost; its Popen return code."""
        if lease.lost:
            raise RunError(
                f"lease {self._key} (epoch {lease.epoch}) was lost before {self._name} started; it was not run",
                ExitCode.LOST,
            )
        env = {
            **os.environ,
            "PG_LEASE_KEY": lease.key,
            "PG_LEASE_OWNER": lease.owner,
            "PG_LEASE_EPOCH": str(lease.epoch),
        }
        self._say(
            f"acquired {self._key} as {quoted(lease.owner)} at epoch {lease.epoch}; running {self._name}", level=2
        )
        connections.close_all()  # the hold has a connection of its own: keep no idle one for COMMAND's lifetime
        self.stdout.flush()
        self.stderr.flush()
        self._started = True
        try:
            self.child = Child(self.argv, env, self.grace)
        except FileNotFoundError:
            raise RunError(f"{printable(self.argv[0])}: command not found", ExitCode.COMMAND_NOT_FOUND) from None
        except OSError as exc:
            raise RunError(
                f"{printable(self.argv[0])}: cannot execute: {exc.strerror or exc}", ExitCode.CANNOT_EXECUTE
            ) from None
        for signum in self._pending:
            self._forward(signum)
        return self._watch(lease, self.child)

    def _watch(self, lease: HeldLease, child: Child) -> int:
        terminated_at: float | None = None  # when the lease's loss (or a hand-off) made us send SIGTERM
        received = False  # a SIGTERM sent to this process (see _on_signal) has been taken into account
        lingering = False  # COMMAND has exited; processes it left in its group still run
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._wake_r, selectors.EVENT_READ)
                if child.pidfd >= 0:
                    selector.register(child.pidfd, selectors.EVENT_READ)
                # As flock(1): the lease is held until COMMAND and every process it left in its
                # own process group have exited (a shell script's `cmd &`); the group gets
                # forwarded signals, and on a loss SIGTERM, then SIGKILL, as COMMAND does.
                while child.popen.poll() is None or (lingering := child.group_left()):
                    if lingering and child.pidfd >= 0:
                        selector.unregister(child.pidfd)  # readable for good once COMMAND exited
                        child.close()
                        self._say(f"{self._name} exited; waiting for the processes it left running", level=2)
                    now = time.monotonic()
                    if terminated_at is None and (why := self._why_stop(lease)) is not None:
                        terminated_at = now
                        self._say(
                            f"{why}: sending SIGTERM to {self._name} (pid {child.pid}), SIGKILL in {self.grace:g}s"
                        )
                        child.terminated(now)
                        child.signal(signal.SIGTERM)
                    if not received and self._sigterm_at is not None:  # a deploy's, passed on
                        received = True
                        child.terminated(self._sigterm_at)
                        self._say(f"SIGTERM passed on to {self._name}: SIGKILL in {self.grace:g}s if it runs", level=2)
                    if child.until_kill(now) == 0:
                        self._say(
                            f"{self._name} (pid {child.pid}) still running {self.grace:g}s after SIGTERM: SIGKILL"
                        )
                        child.kill()
                    waits = [] if terminated_at is not None else [max(lease.trust_remaining, 0.001)]  # trust's end
                    if (kill_in := child.until_kill(now)) is not None:
                        waits.append(kill_in)
                    timeout = min(waits, default=None)
                    if child.pidfd < 0:  # no pidfd: poll the child
                        timeout = 0.05 if timeout is None else min(timeout, 0.05)
                    for ready, _events in selector.select(timeout):
                        if ready.fd == self._wake_r:
                            with suppress(BlockingIOError):
                                os.read(self._wake_r, 64)
            if terminated_at is not None and child.own_group:
                # The lease is gone and COMMAND has ended: whatever it left behind in its group
                # must not go on working without the lease either.
                child.signal(signal.SIGKILL)
        finally:
            child.close()
        assert child.popen.returncode is not None
        return child.popen.returncode

    def _why_stop(self, lease: HeldLease) -> str | None:
        """Why COMMAND must stop now, or None: the lease was lost, or a campaign's hand-off was asked for."""
        error = lease.error
        if error is not None:
            self._terminated_at_loss = True
            return f"lease {self._key} lost ({error.code})"
        return None

    def _kill_report(self, returncode: int) -> str:
        killed = self.child is not None and self.child.killed
        sent = f"sent {self._name} SIGTERM" + (f", then SIGKILL after {self.grace:g}s" if killed else "")
        return f"{sent}; it {describe_exit(returncode)}"
