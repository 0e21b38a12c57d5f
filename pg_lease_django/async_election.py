"""``aelect()``: an election's campaign driven by the event loop (`AsyncElection`).

The campaign's decisions are `pg_lease_django.election_plan`'s, as for ``elect()``'s thread
(`Election._run`); what is the event loop's own is here: a term's callback runs as a task,
cancelled when the lease is lost, a hand-off is requested, or the campaign is cancelled, and the
database calls run in worker threads (``hold()``'s ``async with``, ``ainspect``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction

from .election import Election, logger
from .election_plan import (
    Announce,
    CampaignFailed,
    ReadLeader,
    Refused,
    Rest,
    RunTerm,
    Served,
    Step,
    StepDown,
    TermEnd,
    TermOutcome,
)
from .exceptions import InvalidInputError, LeaseLostError, NotAcquirableError
from .holds.lease import HeldLease
from .metrics import hooks as metrics
from .validation import Seconds

__all__ = ["AsyncElection", "aelect"]


class AsyncElection(Election):
    """An `Election` whose campaign is a coroutine (``aelect()``) rather than a thread."""

    async def _acampaign(self) -> None:
        """The event loop's driver of the campaign's plan, until cancelled."""
        metrics.campaigning(self.key, 1)
        try:
            plan = self._campaign.plan()
            step = next(plan)
            while True:
                step = plan.send(await self._ado(step))
        finally:
            metrics.campaigning(self.key, -1)

    async def _ado(self, step: Step) -> Any:
        from .models import Lease

        match step:
            case RunTerm():
                return await self._aterm()
            case Rest(seconds):
                await asyncio.sleep(seconds)
            case ReadLeader():
                try:
                    return self._holder(await Lease.objects.db_manager(self._using).ainspect(self.key))
                except Exception as exc:
                    logger.warning("election %r: reading the lease failed: %r", self.key, exc)
            case Announce(identity):
                await self._finish(self._announce(identity), self._on_new_leader)
            case StepDown():
                await self._finish(self._call(self._on_stopped_leading), self._on_stopped_leading)
        return None

    async def _finish(self, result: Any, callback: Callable[..., Any] | None) -> None:
        """Await what ``callback`` returned, if awaitable (an async callback); its exception is logged."""
        if inspect.isawaitable(result):
            try:
                await result
            except Exception as exc:
                self._log_failure(getattr(callback, "__name__", "a callback"), exc)

    async def _aterm(self) -> TermOutcome:
        """One campaign attempt, and the term it wins, as a task: the callback is cancelled to end it."""
        loop = asyncio.get_running_loop()
        step_down = asyncio.Event()

        def handoff(lease: HeldLease) -> None:  # a heartbeat worker thread; a loss cancels this task through the hold
            loop.call_soon_threadsafe(step_down.set)

        started = False
        held: HeldLease | None = None
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            async with self._hold(None, handoff) as lease:
                held = lease
                self._start_term(lease)
                await self._finish(self._announce(self.owner), self._on_new_leader)
                started = True
                leader: asyncio.Future[Any] = asyncio.ensure_future(self._on_started_leading(lease))
                stepping = asyncio.ensure_future(step_down.wait())
                try:
                    await asyncio.wait({leader, stepping}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when this task is cancelled: by the hold on a loss, or from outside
                    self._lease = None
                    stepping.cancel()
                    if not leader.done():
                        leader.cancel()
                        await asyncio.wait({leader})
                if leader.cancelled():
                    ended = TermEnd.RETURNED  # by the hand-off (see term_end)
                elif (exc := leader.exception()) is not None:
                    self._log_failure("on_started_leading", exc)
                    ended = TermEnd.FAILED
                else:
                    ended = TermEnd.RETURNED
        except NotAcquirableError as busy:
            return Refused(busy.holder)
        except LeaseLostError:  # the hold cancelled this task on the loss, and turned that into this error
            return Served(TermEnd.LOST, led=started)
        except asyncio.CancelledError:
            # The hold's own cancellation on a loss normally comes back as LeaseLostError; one that lands
            # as the hold is being left escapes unconverted. It is ours if it is the only one pending.
            if task is not None and held is not None and held.lost and task.cancelling() == cancelling + 1:
                task.uncancel()
                return Served(TermEnd.LOST, led=started)
            if started:  # cancelled from outside while leading: the hold has released; step down, then go
                await self._finish(self._call(self._on_stopped_leading), self._on_stopped_leading)
            raise
        except Exception as exc:  # the database, while acquiring or leaving: keep campaigning, backing off
            self._log_campaign_failure(exc)
            return CampaignFailed(led=started)
        return self._served(lease, ended)


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
    election = AsyncElection(
        key,
        ttl=ttl,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
        on_new_leader=on_new_leader,
        owner=owner,
        using=using,
    )
    await election._acampaign()  # noqa: SLF001 (AsyncElection is of this module)
