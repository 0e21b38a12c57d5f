"""``aelect()``: an election driven by the event loop, `AsyncElection`, standing on its own.

The campaign's task performs the steps of `pg_lease_django.election.plan` with awaits. Every
decision is the plan's, as for ``elect()``'s thread. What is the event loop's own is here. The
database calls run in worker threads, through ``hold()``'s ``async with`` halves and ``ainspect``.
The leader callback runs as a task of its own, cancelled when the term must end. That happens on
a hand-off, through the hold's ``on_handoff``; on a loss, when the hold cancels the campaign's
task; or when ``aelect()`` itself is cancelled.

A cancellation that lands in a term is kept until the term has ended as every term does: the hold
left and ``on_stopped_leading`` called. It then goes on at the plan's next `ENDED_BY_STOP` step.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction

from pg_lease_django.exceptions import InvalidInputError, LeaseLostError
from pg_lease_django.holds.lease import HeldLease
from pg_lease_django.metrics import hooks as metrics
from pg_lease_django.plans import Pause, adrive
from pg_lease_django.validation import Seconds

from .candidate import Candidate, Term, leader_in
from .plan import (
    ENDED_BY_STOP,
    Announce,
    Failed,
    Lead,
    Leave,
    Left,
    ReadLeader,
    Refused,
    Stand,
    Step,
    StepDown,
    TermEnd,
    Won,
)

__all__ = ["AsyncElection", "aelect"]


class AsyncElection:
    """The campaign ``aelect()`` runs for one `Candidate`, until it is cancelled."""

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate
        self._term: Term | None = None  # entered by the plan's Stand, left by its Leave
        self._handoff = asyncio.Event()  # the term's: set when a hand-off is requested
        self._cancelling = 0  # this task's cancellations pending when the term's hold was entered
        #: The cancellation that cut the current term short: the hold's on a loss, or one from outside.
        self._interrupted: asyncio.CancelledError | None = None
        #: A cancellation from outside, raised at the plan's next step of `ENDED_BY_STOP`.
        self._cancelled: asyncio.CancelledError | None = None

    async def run(self) -> None:
        """Perform the plan's steps until cancelled (a term in progress ends first)."""
        key = self.candidate.key
        metrics.campaigning(key, 1)
        try:
            await adrive(self.candidate.campaign.plan(), self._perform)
        except BaseException as exc:
            await self._abandon_term(exc)
            raise
        finally:
            metrics.campaigning(key, -1)

    async def _perform(self, step: Step) -> Any:
        from pg_lease_django.models import Lease

        candidate = self.candidate
        if self._cancelled is not None and isinstance(step, ENDED_BY_STOP):
            raise self._cancelled
        match step:
            case Stand():
                return await self._attempt()
            case Announce(identity):
                await self._announce(identity)
            case Lead():
                return await self._lead()
            case Leave():
                return await self._leave()
            case StepDown():
                await self._finish(candidate.call(candidate.on_stopped_leading), candidate.on_stopped_leading)
            case Pause(seconds):
                await asyncio.sleep(seconds)
            case ReadLeader():
                try:
                    return leader_in(await Lease.objects.db_manager(candidate.using).ainspect(candidate.key))
                except Exception as exc:
                    candidate.log_read_failure(exc)
        return None

    async def _finish(self, result: Any, callback: Callable[..., Any] | None) -> None:
        """Await what ``callback`` returned, if awaitable (an async callback); its exception is logged."""
        if inspect.isawaitable(result):
            try:
                await result
            except Exception as exc:
                self.candidate.log_failure(getattr(callback, "__name__", "a callback"), exc)

    async def _attempt(self) -> Won | Refused | Failed:
        """Enter a hold of the key without waiting; from then on a loss cancels this task (the hold's
        doing) and a hand-off sets the term's event."""
        loop = asyncio.get_running_loop()
        handoff = self._handoff = asyncio.Event()

        def handoff_requested(lease: HeldLease) -> None:  # a heartbeat worker thread
            loop.call_soon_threadsafe(handoff.set)

        holding = self.candidate.hold(None, handoff_requested)
        task = asyncio.current_task()
        self._cancelling = task.cancelling() if task is not None else 0
        try:
            lease = await holding.__aenter__()
        except Exception as exc:  # refused, or the database
            return self.candidate.refused_or_failed(exc, stopping=self._cancelled is not None)
        self._term = Term(holding, lease)
        self.candidate.begin_term(lease)
        return Won()

    async def _announce(self, identity: str) -> None:
        """Record ``identity``, awaiting ``on_new_leader``; a cancellation landing in a term is kept for `_leave`."""
        try:
            await self._finish(self.candidate.announce(identity), self.candidate.on_new_leader)
        except asyncio.CancelledError as exc:
            if self._term is None:
                raise
            self._interrupted = exc

    async def _lead(self) -> TermEnd | None:
        """Run the leader callback as a task of its own until it ends or the term must end (then cancel it)."""
        candidate, term = self.candidate, self._term
        assert term is not None  # the plan leads only after a won attempt
        if self._interrupted is not None:
            candidate.lease = None
            return None  # cancelled while announcing: the callback never starts
        leader: asyncio.Future[Any] = asyncio.ensure_future(candidate.on_started_leading(term.lease))
        handoff = asyncio.ensure_future(self._handoff.wait())
        try:
            await asyncio.wait({leader, handoff}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError as exc:  # the hold's on a loss, or from outside: `_leave` tells which
            self._interrupted = exc
        finally:
            candidate.lease = None
            handoff.cancel()
            if not leader.done():
                leader.cancel()
                await self._wait_cancelled(leader)
        if leader.done() and not leader.cancelled() and (raised := leader.exception()) is not None:
            candidate.log_failure("on_started_leading", raised)
            return TermEnd.FAILED
        return TermEnd.RETURNED

    async def _wait_cancelled(self, leader: asyncio.Future[Any]) -> None:
        """Wait for the cancelled leader callback to end; cancelled again meanwhile, it is left to end alone."""
        try:
            await asyncio.wait({leader})
        except asyncio.CancelledError as exc:
            self._interrupted = self._interrupted or exc

    async def _leave(self) -> Left | Failed:
        """Leave the term's hold, handing it the cancellation that cut the term short.

        On a loss, the hold takes back its own cancellation and raises LeaseLostError. A cancellation
        from outside is kept, through `_cancelled`.
        """
        term, self._term = self._term, None
        interrupted, self._interrupted = self._interrupted, None
        assert term is not None  # the plan leaves only after a won attempt
        try:
            if interrupted is None:
                await term.holding.__aexit__(None, None, None)
            else:
                await term.holding.__aexit__(type(interrupted), interrupted, interrupted.__traceback__)
        except LeaseLostError:
            pass  # the loss, which the hold told from its cancellation of this task
        except asyncio.CancelledError as exc:  # landed while the hold was being left
            self._keep_unless_the_holds(exc, term.lease)
        except Exception as exc:  # the database: keep campaigning, backing off
            if interrupted is not None:
                self._keep_unless_the_holds(interrupted, term.lease)
            return self.candidate.failed(exc, stopping=self._cancelled is not None)
        else:
            self._cancelled = self._cancelled or interrupted  # not the hold's: it would have raised
        return Left(lost=term.lease.lost, handoff_requested=term.lease.handoff_requested)

    def _keep_unless_the_holds(self, cancelled: asyncio.CancelledError, lease: HeldLease) -> None:
        """A cancellation the hold could not tell apart: taken back if it is the hold's own, else kept.

        It is the hold's own on a loss when it is the only one pending. Otherwise it came from outside.
        """
        task = asyncio.current_task()
        if task is not None and lease.lost and task.cancelling() == self._cancelling + 1:
            task.uncancel()
        else:
            self._cancelled = cancelled

    async def _abandon_term(self, exc: BaseException) -> None:
        """Leave the hold of a term that ``exc`` (raised through a step, ending the campaign) cut short."""
        term, self._term = self._term, None
        self.candidate.lease = None
        if term is not None:
            try:
                await term.holding.__aexit__(type(exc), exc, exc.__traceback__)
            except Exception as error:
                self.candidate.log_campaign_failure(error)


async def aelect(
    key: str,
    *,
    ttl: Seconds,
    on_started_leading: Callable[[HeldLease], Awaitable[Any]],
    on_stopped_leading: Callable[[], Any],
    on_new_leader: Callable[[str], Any] | None = None,
    owner: str | None = None,
    using: str | None = None,
) -> None:
    """`elect` for the event loop: campaign for ``key`` until this coroutine is cancelled.

    ``on_started_leading(lease)`` is a coroutine function, run as a task of its own for each term;
    the task is cancelled when the lease is lost, a hand-off is requested, or this coroutine is
    cancelled (the term then ends as in `elect`: release, ``on_stopped_leading()``, and, on
    cancellation, the CancelledError goes on). ``on_stopped_leading`` and ``on_new_leader`` may be
    plain or coroutine functions. Arguments as for `elect`; the database calls run in worker threads.

    Raises:
        InvalidInputError: a bad argument.
    """
    if not iscoroutinefunction(on_started_leading):
        raise InvalidInputError("on_started_leading of aelect() must be a coroutine function (async def)")
    candidate = Candidate(
        key,
        ttl=ttl,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
        on_new_leader=on_new_leader,
        owner=owner,
        using=using,
    )
    await AsyncElection(candidate).run()
