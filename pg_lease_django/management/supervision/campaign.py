"""``leases run --campaign``: `CampaignSupervisor` keeps COMMAND running on exactly one machine of many.

`CampaignSupervisor` is a `Supervisor` that campaigns with `pg_lease_django.elect`, through the
election's hooks for it, `election.start` and `election.fail_term`. It runs COMMAND while it leads,
and campaigns again when COMMAND exits or the lease is lost or handed off, until SIGTERM, SIGINT or
SIGHUP stops it. Each term's COMMAND is started, watched and signalled as a plain run's is.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Sequence
from types import FrameType

from django.core.management.base import OutputWrapper

from pg_lease_django import election as elections
from pg_lease_django.holds.lease import HeldLease
from pg_lease_django.management.exit_codes import ExitCode

from .child_process import describe_exit, signal_name
from .supervisor import DEFAULT_GRACE, RunError, Supervisor, _Interrupted, quoted

__all__ = ["STOPPING_SIGNALS", "CampaignSupervisor"]

#: Of the signals passed on to COMMAND (`supervisor.FORWARDED_SIGNALS`), the ones that also end a
#: campaign: COMMAND is not restarted after them.
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class CampaignSupervisor(Supervisor):
    """``leases run --campaign``: campaign, run COMMAND for each term, campaign again; until a signal stops it.

    Takes `Supervisor`'s arguments but ``wait``: a campaign waits for the lease as long as it
    takes. `run` returns COMMAND's status when a signal stopped the campaign while COMMAND ran
    (128 + N when signal N ended it), 128 + N when it arrived between terms.
    """

    def __init__(
        self,
        key: str,
        argv: Sequence[str],
        *,
        ttl: float,
        grace: float = DEFAULT_GRACE,
        owner: str | None = None,
        using: str | None = None,
        verbosity: int = 1,
        stdout: OutputWrapper | None = None,
        stderr: OutputWrapper | None = None,
    ) -> None:
        super().__init__(
            key,
            argv,
            ttl=ttl,
            grace=grace,
            owner=owner,
            using=using,
            verbosity=verbosity,
            stdout=stdout,
            stderr=stderr,
        )
        self._election: elections.Election | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._election is not None:
            if signum not in STOPPING_SIGNALS and not self._started:
                return  # campaigning, COMMAND not running: SIGUSR1/SIGUSR2 have no one to go to
            if signum in STOPPING_SIGNALS:
                self._election.stop()  # no new term after this one
        super()._on_signal(signum, frame)

    def _not_run(self, signum: int) -> str:
        return f"{signal_name(signum)} while {self._name} was not running: stopped campaigning"

    def _why_stop(self, lease: HeldLease) -> str | None:
        why = super()._why_stop(lease)
        if why is None and lease.handoff_requested:
            return f"hand-off of {self._key} requested"
        return why

    def _main(self) -> int:
        """Campaign; run COMMAND for each term; campaign again when it ends. Returns once a signal stops it.

        The election of `pg_lease_django.elect` runs in its own thread. Its leader callback hands
        each term's lease to the main thread, which starts, watches and signals COMMAND as a plain
        ``run`` does, then lets the callback return. The election then releases the lease, unless it
        was lost, and campaigns again. A signal that arrives while COMMAND runs is passed on, and
        SIGTERM, SIGINT or SIGHUP also stop the campaign: COMMAND is not restarted, and the status is
        COMMAND's. One that arrives between terms stops it at once with 128 + N. COMMAND ending with
        an error makes the election back off before the next term, doubling up to one TTL. After a
        hand-off it rests until another campaigner leads, or for one TTL.
        """
        terms: queue.Queue[HeldLease] = queue.Queue()
        term_over = threading.Event()

        def lead(lease: HeldLease) -> None:  # the election's thread
            term_over.clear()
            terms.put(lease)
            # A signal between terms stops the election, then sets term_over: if that set() came
            # before the clear() above (the term was won just as the signal arrived), waiting
            # would never end, and neither would join(). Stopped: give the lease back at once.
            if election.stopping:
                return
            term_over.wait()

        election = elections.Election(
            self.key,
            ttl=self.ttl,
            on_started_leading=lead,
            on_stopped_leading=lambda: None,
            on_new_leader=lambda identity: self._say(f"{self._key} is led by {quoted(identity)}", level=2),
            owner=self.owner,
            using=self.using,
        )
        self._election = election
        elections.start(election, wake=self._wake)
        try:
            while True:
                lease = terms.get()  # a signal here raises _Interrupted: stop campaigning
                try:
                    returncode = self._term(lease)
                finally:
                    term_over.set()
                if election.stopping:
                    if returncode is None:
                        return int(ExitCode.LOST)
                    return returncode if returncode >= 0 else 128 - returncode
        finally:
            election.stop()
            term_over.set()
            try:
                election.join()
            except _Interrupted:
                # A signal while the election leaves its term's hold: let it release (bounded) before
                # going on, or the process would exit under its daemon thread, the lease left to its TTL.
                election.join()
                raise

    def _term(self, lease: HeldLease) -> int | None:
        """COMMAND for one term: its Popen return code (None when the lease was lost before it started)."""
        self.child, self._pending, self._sigterm_at = None, [], None
        self._terminated_at_loss = False
        try:
            returncode = self._supervise(lease)
        except RunError as exc:
            if exc.exit_code != ExitCode.LOST:
                raise  # COMMAND cannot be run: no point in campaigning for it
            self._say(f"{exc}; campaigning again")
            return None
        finally:
            self._started = False  # from here a signal stops the campaign at once
        ended = f"{self._name} {describe_exit(returncode)}"
        if self._terminated_at_loss:
            self._say(f"lease {self._key} (epoch {lease.epoch}) was lost: {self._kill_report(returncode)}")
        elif lease.handoff_requested:
            self._say(f"stepped down from {self._key} (epoch {lease.epoch}) for a hand-off; {ended}")
        elif self._election is not None and not self._election.stopping:
            self._say(f"{ended}; stepping down from {self._key} (epoch {lease.epoch}), campaigning again")
            if returncode != 0:
                elections.fail_term(self._election)  # back off before the next term
        else:
            self._say(f"{ended}; releasing {self._key} (epoch {lease.epoch}), stopped campaigning", level=2)
        return returncode
