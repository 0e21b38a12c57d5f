"""What both drivers of an election share: the candidate, meaning who campaigns, its callbacks and what it saw.

`Election` runs in a thread, in `pg_lease_django.election.threaded`. `AsyncElection` runs as a
task, in `pg_lease_django.election.aio`. Each owns a `Candidate` and adds only what its way of
running needs: events and a thread for one, a task's cancellations for the other. Nothing here
blocks or awaits, so neither driver inherits the other's machinery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pg_lease_django import conf
from pg_lease_django.exceptions import InvalidInputError, NotAcquirableError
from pg_lease_django.holds.holding import Holding, hold
from pg_lease_django.holds.lease import HeldLease
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.operations import LeaseState
from pg_lease_django.owners import default_owner
from pg_lease_django.validation import Seconds, check_name, check_ttl

from .plan import Campaign, Failed, Refused

# The documented logger of elections (docs/leader-election.md), whichever module of the package logs.
logger = logging.getLogger("pg_lease_django.election")


@dataclass(frozen=True)
class Term:
    """A term's hold, entered by the plan's `Stand` and left by its `Leave`, and the lease it holds."""

    holding: Holding
    lease: HeldLease


def leader_in(state: LeaseState) -> str | None:
    """The leader a lease's state names: its holder, None when nobody holds it."""
    return state.owner if state.held and state.owner else None


class Candidate:
    """One campaigner for ``key``: its checked arguments, its callbacks, the leader seen, the term's lease.

    Attributes:
        key, owner: the lease key and this campaigner's identity for every term.
        campaign: the plan's decisions, a `Campaign`, with its back-off.
        leader: the last leader identity seen, which is ``owner`` when elected; or None.
        lease: the current term's lease while its leader callback runs, else None.
    """

    def __init__(
        self,
        key: str,
        *,
        ttl: Seconds,
        on_started_leading: Callable[[HeldLease], Any],
        on_stopped_leading: Callable[[], Any],
        on_new_leader: Callable[[str], Any] | None = None,
        owner: str | None = None,
        using: str | None = None,
    ) -> None:
        self.key = check_name("key", key)
        self.ttl = check_ttl(ttl)
        self.owner = check_name("owner", owner if owner is not None else default_owner())
        for name, callback in (
            ("on_started_leading", on_started_leading),
            ("on_stopped_leading", on_stopped_leading),
            ("on_new_leader", on_new_leader),
        ):
            if callback is not None and not callable(callback):
                raise InvalidInputError(f"{name} must be callable, not {type(callback).__name__}")
        if using is not None and not isinstance(using, str):
            raise InvalidInputError(f"using must be a database alias, not {type(using).__name__}")
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.on_new_leader = on_new_leader
        self.using = using
        self.campaign = Campaign(self.owner, self.ttl.total_seconds(), poll_interval=conf.poll_interval)
        self.leader: str | None = None
        self.lease: HeldLease | None = None

    def hold(self, on_lost: Callable[[HeldLease], Any] | None, on_handoff: Callable[[HeldLease], Any]) -> Holding:
        """A hold of the key for one term (entered and left by a driver)."""
        return hold(self.key, self.ttl, owner=self.owner, on_lost=on_lost, on_handoff=on_handoff, using=self.using)

    def begin_term(self, lease: HeldLease) -> None:
        """The term's hold is entered: this campaigner leads under ``lease`` (counted in the metrics)."""
        self.lease = lease
        metrics.leading(lease)

    def call(self, callback: Callable[..., Any] | None, *args: Any) -> Any:
        """Call one of the user's callbacks; an exception from it is logged, never raised. Returns its
        result (an awaitable for the async driver to await)."""
        if callback is None:
            return None
        try:
            return callback(*args)
        except Exception as exc:
            self.log_failure(getattr(callback, "__name__", "a callback"), exc)
            return None

    def announce(self, identity: str) -> Any:
        """Record ``identity`` as the leader; on a change, call ``on_new_leader`` (`call`'s result)."""
        if identity == self.leader:
            return None
        self.leader = identity
        return self.call(self.on_new_leader, identity)

    def refused_or_failed(self, exc: Exception, *, stopping: bool) -> Refused | Failed:
        """The answer to an attempt that raised ``exc``: refused by the holder it names, else `failed`."""
        if isinstance(exc, NotAcquirableError):
            return Refused(exc.holder)
        return self.failed(exc, stopping=stopping)

    def failed(self, exc: Exception, *, stopping: bool) -> Failed:
        """The database failed an attempt or the leaving of a hold: the campaign goes on, backing off.
        Logged unless ``stopping`` (a stop interrupts an attempt in flight, which is then settled)."""
        if not stopping:
            self.log_campaign_failure(exc)
        return Failed()

    def log_failure(self, what: str, exc: BaseException) -> None:
        """A callback of the user's failed: logged with its traceback."""
        logger.error("election %r (%s): %s failed: %r", self.key, self.owner, what, exc, exc_info=exc)

    def log_campaign_failure(self, exc: BaseException) -> None:
        """The database failed a step of the campaign (logged at WARNING, without a traceback)."""
        logger.warning("election %r (%s): campaigning failed: %r", self.key, self.owner, exc)

    def log_read_failure(self, exc: BaseException) -> None:
        """Reading the leader while looking for a new one after a hand-off failed: the look goes on."""
        logger.warning("election %r: reading the lease failed: %r", self.key, exc)
