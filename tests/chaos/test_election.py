"""``elect()`` / ``aelect()``: leader election on ``hold()``.

In this process: a term's life (callbacks and their order, release on stop), a stop while
campaigning, a failing callback (step down, back off, campaign again), a loss (no rest), a hand-off;
the async twin's terms the same ways (a loss, a raise, a return, a hand-off, a cancellation).
In several processes (tests/children/election_child.py): leaders killed (SIGKILL) and frozen (SIGSTOP past
the TTL) and a hand-off, with the whole history checked: every leader writes fenced rows stamped
with the server clock, and the terms must be disjoint with strictly increasing epochs.

Waits are for events (a line from a child, a callback having run) with deadlines that only catch a
hang (HANG). How a term ended is read from the epochs, not from a stopwatch: a leader that released
(a stop, a hand-off) is followed at epoch + 2, a lease that lapsed (a kill, a freeze) at epoch + 1.
Where a slow path would fit within the hang guard (a stop noticed at a poll or a renewal), the test
sets intervals far beyond it. The failover and hand-off times are printed, and measured in `make bench`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings

from devkit.testapp.models import Entry
from pg_lease_django import Election, HeldLease, InvalidInputError, Lease, aelect, conf, current_election, elect
from pg_lease_django import election as election_hooks
from tests.children.election_child import Campaigner
from tests.helpers import held, url_of_test_database, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TTL = 3.0
#: A hang guard, not a latency bound: far beyond any stall of a loaded shared machine.
HANG = 30.0
#: A poll interval and a TTL whose renew interval (TTL / 3) are far beyond HANG: what is woken by
#: an event must not wait for them.
NEVER = 120.0


def leader_until_stopped(lease: HeldLease) -> None:
    """A leader callback doing nothing until its term must end."""
    election = current_election()
    assert election is not None
    election.wait_stop()


# ---- in this process -----------------------------------------------------------------------------


def test_a_term_starts_with_the_grant_and_ends_with_stop_and_the_release(key: str) -> None:
    calls: list[tuple[Any, ...]] = []

    def lead(lease: HeldLease) -> None:
        calls.append(("started", lease.epoch, current_election(), Lease.objects.inspect(key).owner))
        leader_until_stopped(lease)

    with (
        override_settings(PG_LEASE_POLL_INTERVAL=NEVER),
        elect(
            key,
            ttl=NEVER,
            on_started_leading=lead,
            on_stopped_leading=lambda: calls.append(("stopped", Lease.objects.inspect(key).status)),
            on_new_leader=lambda identity: calls.append(("leader", identity)),
        ) as election,
    ):
        wait_until(lambda: len(calls) == 2, what="the term to start")
        assert election.leading and election.leader == election.owner
        assert election.lease is not None and Lease.objects.inspect(key).epoch == election.lease.epoch
        stopping = time.monotonic()
    stopped_in = time.monotonic() - stopping
    epoch = calls[1][1]
    assert calls == [
        ("leader", election.owner),
        ("started", epoch, election, election.owner),
        ("stopped", "free"),  # on_stopped_leading comes after the release
    ]
    assert not election.leading and election.lease is None and current_election() is None
    # The stop wakes the leader's callback: no poll (NEVER) or renewal (NEVER / 3) is waited for.
    assert stopped_in < HANG, f"stop, release and join took {stopped_in:.3f}s"


def test_a_stop_while_campaigning_ends_the_campaign_at_once(key: str) -> None:
    held(key, "incumbent", ttl=300)
    seen: list[str] = []
    with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):  # its next attempt: in 120 s
        election = elect(
            key,
            ttl=TTL,
            on_started_leading=leader_until_stopped,
            on_stopped_leading=lambda: None,
            on_new_leader=seen.append,
        )
        wait_until(lambda: seen == ["incumbent"], what="the campaigner to see the incumbent")
        assert election.leader == "incumbent" and not election.leading
        election.stop()
        # It sleeps on an event between attempts, not in time.sleep: it ends long before its next attempt.
        assert election.join(timeout=HANG)
    assert Lease.objects.inspect(key).owner == "incumbent"


def test_a_failing_callback_steps_down_and_campaigns_again_after_a_growing_back_off(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    starts: list[tuple[float, int]] = []
    stops: list[float] = []

    def lead(lease: HeldLease) -> None:
        starts.append((time.monotonic(), lease.epoch))
        if len(starts) <= 2:
            raise RuntimeError("boom")
        leader_until_stopped(lease)

    stopped = lambda: stops.append(time.monotonic())  # noqa: E731
    with (
        caplog.at_level(logging.ERROR, logger="pg_lease_django.election"),
        elect(key, ttl=TTL, on_started_leading=lead, on_stopped_leading=stopped),
    ):
        wait_until(lambda: len(starts) == 3, what="the third term")
    poll = conf.poll_interval()
    assert len(stops) == 3
    assert starts[1][0] - stops[0] >= poll  # first back-off: one poll interval
    assert starts[2][0] - stops[1] >= 2 * poll  # then doubling (up to one TTL)
    assert starts[0][1] < starts[1][1] < starts[2][1]
    failures = [r for r in caplog.records if "on_started_leading failed" in r.getMessage()]
    assert len(failures) == 2 and all("boom" in r.getMessage() for r in failures)
    assert Lease.objects.inspect(key).status == "free"


def test_the_supervisors_hooks_wake_it_when_a_term_must_end_and_back_off_a_failed_term(key: str) -> None:
    """``leases run --campaign``'s hooks (`election.start`, `election.fail_term`): a term failed without
    raising backs off as a raised one does, and ``wake`` is called when a term must end (a hand-off)."""
    starts: list[float] = []
    stops: list[float] = []
    woken = threading.Event()

    def lead(lease: HeldLease) -> None:
        starts.append(time.monotonic())
        if len(starts) <= 2:
            election_hooks.fail_term(campaign)  # as a COMMAND that exited with an error: no traceback
            return
        leader_until_stopped(lease)

    campaign = Election(
        key, ttl=TTL, on_started_leading=lead, on_stopped_leading=lambda: stops.append(time.monotonic())
    )
    with election_hooks.start(campaign, wake=woken.set):
        wait_until(lambda: len(starts) == 3, what="the third term")
        assert not woken.is_set()  # failed terms end by returning: nothing had to be woken
        Lease.objects.request_handoff(key)
        wait_until(woken.is_set, what="the wake of the hand-off")
    poll = conf.poll_interval()
    assert starts[1] - stops[0] >= poll  # backing off: one poll interval
    assert starts[2] - stops[1] >= 2 * poll  # then doubling (a returned term rests one poll interval)
    assert Lease.objects.inspect(key).status == "free"


def test_a_handoff_passes_leadership_to_another_campaigner_which_the_old_leader_sees(key: str) -> None:
    leaders: dict[str, list[str]] = {"a": [], "b": []}
    led = {"a": threading.Event(), "b": threading.Event()}

    def campaign(name: str) -> Election:
        def lead(lease: HeldLease) -> None:
            led[name].set()
            leader_until_stopped(lease)

        return elect(
            key,
            ttl=TTL,
            owner=name,
            on_started_leading=lead,
            on_stopped_leading=lambda: None,
            on_new_leader=leaders[name].append,
        )

    with campaign("a") as a:
        assert led["a"].wait(HANG)
        assert a.lease is not None
        a_epoch = a.lease.epoch
        with campaign("b") as b:
            wait_until(lambda: leaders["b"] == ["a"], what="b to see a leading")
            asked = time.monotonic()
            Lease.objects.request_handoff(key)
            assert led["b"].wait(HANG)
            took = time.monotonic() - asked
            wait_until(lambda: leaders["a"] == ["a", "b"], what="a to see b leading")
            assert b.leading and not a.leading and a.leader == "b"
            assert b.lease is not None
            b_epoch = b.lease.epoch
    # The leader learned of it at a renewal and released (epoch + 1); b's next attempt won (+ 2). Had
    # a let its lease lapse instead, b would hold epoch + 1.
    assert b_epoch == a_epoch + 2, (a_epoch, b_epoch)
    print(f"\nhand-off took {took:.2f}s")


def test_invalid_arguments_are_refused_before_anything_starts(key: str) -> None:
    with pytest.raises(InvalidInputError):
        elect("", ttl=TTL, on_started_leading=leader_until_stopped, on_stopped_leading=lambda: None)
    with pytest.raises(InvalidInputError):
        elect(key, ttl=0, on_started_leading=leader_until_stopped, on_stopped_leading=lambda: None)
    with pytest.raises(InvalidInputError, match="on_stopped_leading must be callable"):
        elect(key, ttl=TTL, on_started_leading=leader_until_stopped, on_stopped_leading=3)  # type: ignore[arg-type]
    campaign = aelect(key, ttl=TTL, on_started_leading=leader_until_stopped, on_stopped_leading=lambda: None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="coroutine function"):
        asyncio.run(campaign)
    assert not Lease.objects.filter(key=key).exists()


def test_aelect_leads_in_a_task_cancelled_on_handoff_and_steps_down_on_cancellation(key: str) -> None:
    events: list[tuple[Any, ...]] = []

    async def lead(lease: HeldLease) -> None:
        events.append(("started", lease.epoch))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append(("cancelled", lease.handoff_requested))
            raise

    async def stopped() -> None:
        events.append(("stopped", (await Lease.objects.ainspect(key)).status))

    async def scenario() -> None:
        campaign = asyncio.ensure_future(
            aelect(key, ttl=TTL, owner="me", on_started_leading=lead, on_stopped_leading=stopped)
        )
        while len(events) < 1:
            await asyncio.sleep(0.01)
        await Lease.objects.arequest_handoff(key)
        while len(events) < 3:  # cancelled on the hand-off, stepped down; then it rests one TTL
            await asyncio.sleep(0.01)
        other = await Lease.objects.aacquire(key, "other", ttl=1)  # taken while it rests
        assert other is not None
        while len(events) < 4:  # "other" lapses; the campaign takes the lease again
            await asyncio.sleep(0.01)
        campaign.cancel()
        with pytest.raises(asyncio.CancelledError):
            await campaign

    async_to_sync(scenario)()
    first, second = events[0][1], events[3][1]
    assert events == [
        ("started", first),
        ("cancelled", True),
        ("stopped", "free"),
        ("started", second),
        ("cancelled", False),
        ("stopped", "free"),
    ]
    assert second > first + 1


def test_a_lost_lease_ends_the_term_and_the_campaign_goes_on_without_resting(key: str) -> None:
    """A loss (here a force release, learned at the next renewal) wakes the leader, steps down, and the
    next attempt follows at once: no rest after a loss (the poll interval is NEVER)."""
    calls: list[tuple[Any, ...]] = []

    def lead(lease: HeldLease) -> None:
        calls.append(("started", lease.epoch))
        leader_until_stopped(lease)
        calls.append(("returned", lease.lost))

    with (
        override_settings(PG_LEASE_POLL_INTERVAL=NEVER),
        elect(key, ttl=TTL, on_started_leading=lead, on_stopped_leading=lambda: calls.append(("stopped",))),
    ):
        wait_until(lambda: len(calls) == 1, timeout=HANG, what="the first term")
        forced = Lease.objects.force_release(key)
        wait_until(lambda: len(calls) == 4, timeout=HANG, what="the term after the loss")
    first = calls[0][1]
    assert calls[:4] == [("started", first), ("returned", True), ("stopped",), ("started", calls[3][1])]
    assert calls[3][1] > forced > first
    assert calls[4:] == [("returned", False), ("stopped",)]


def test_aelect_steps_down_after_a_loss_a_failure_and_a_return_and_campaigns_again(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aelect's terms: a loss cancels the leader's task (no rest), a raise is logged and backs off, a
    return rests one poll interval; async ``on_new_leader`` and ``on_stopped_leading`` are awaited,
    and ``current_election()`` is None in the leader's task."""
    events: list[tuple[Any, ...]] = []
    seen: list[str] = []

    async def lead(lease: HeldLease) -> None:
        events.append(("started", lease.epoch, current_election(), time.monotonic()))
        terms = sum(1 for event in events if event[0] == "started")
        if terms == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                events.append(("cancelled", lease.lost))
                raise
        if terms == 2:
            raise RuntimeError("boom")
        if terms == 4:
            await asyncio.Event().wait()

    async def new_leader(identity: str) -> None:
        seen.append(identity)

    async def stopped() -> None:
        events.append(("stopped", time.monotonic()))

    async def scenario() -> None:
        campaign = asyncio.ensure_future(
            aelect(
                key, ttl=TTL, owner="me", on_started_leading=lead, on_stopped_leading=stopped, on_new_leader=new_leader
            )
        )
        while len(events) < 1:
            await asyncio.sleep(0.01)
        await Lease.objects.aforce_release(key)
        while sum(1 for event in events if event[0] == "started") < 4:
            await asyncio.sleep(0.01)
        campaign.cancel()
        with pytest.raises(asyncio.CancelledError):
            await campaign

    with caplog.at_level(logging.ERROR, logger="pg_lease_django.election"):
        async_to_sync(scenario)()
    kinds = [event[0] for event in events]
    assert kinds == ["started", "cancelled", "stopped", *["started", "stopped"] * 3]
    assert events[1] == ("cancelled", True)
    starts = [event for event in events if event[0] == "started"]
    stops = [event[1] for event in events if event[0] == "stopped"]
    assert all(start[2] is None for start in starts)
    assert starts[0][1] < starts[1][1] < starts[2][1] < starts[3][1]
    poll = conf.poll_interval()
    assert starts[2][3] - stops[1] >= poll  # after the raise: the back-off (one poll interval)
    assert starts[3][3] - stops[2] >= poll  # after the return: one poll interval
    assert seen == ["me"]  # once per change
    failures = [r for r in caplog.records if "on_started_leading failed" in r.getMessage()]
    assert len(failures) == 1 and "boom" in failures[0].getMessage()
    assert Lease.objects.inspect(key).status == "free"


def test_aelect_cancelled_while_campaigning_ends_at_once_without_stepping_down(key: str) -> None:
    held(key, "incumbent", ttl=300)
    seen: list[str] = []
    stopped: list[bool] = []

    async def lead(lease: HeldLease) -> None:
        raise AssertionError("never elected")

    async def scenario() -> None:
        with override_settings(PG_LEASE_POLL_INTERVAL=NEVER):
            campaign = asyncio.ensure_future(
                aelect(
                    key,
                    ttl=TTL,
                    on_started_leading=lead,
                    on_stopped_leading=lambda: stopped.append(True),
                    on_new_leader=seen.append,
                )
            )
            while not seen:
                await asyncio.sleep(0.01)
            campaign.cancel()  # resting: its next attempt is in NEVER seconds
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(campaign, HANG)

    async_to_sync(scenario)()
    assert seen == ["incumbent"] and not stopped
    assert Lease.objects.inspect(key).owner == "incumbent"


def test_aelect_cancelled_while_announcing_its_win_releases_without_leading(key: str) -> None:
    """Cancelled in the term's first step (an async ``on_new_leader``): the callback never starts, so
    there is no ``on_stopped_leading``; the hold is released and the CancelledError goes on."""
    announced = asyncio.Event()
    calls: list[str] = []

    async def lead(lease: HeldLease) -> None:
        calls.append("started")

    async def new_leader(identity: str) -> None:
        calls.append(f"leader {identity}")
        announced.set()
        await asyncio.Event().wait()

    async def scenario() -> None:
        campaign = asyncio.ensure_future(
            aelect(
                key,
                ttl=TTL,
                owner="me",
                on_started_leading=lead,
                on_stopped_leading=lambda: calls.append("stopped"),
                on_new_leader=new_leader,
            )
        )
        await asyncio.wait_for(announced.wait(), HANG)
        assert (await Lease.objects.ainspect(key)).owner == "me"
        campaign.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(campaign, HANG)

    async_to_sync(scenario)()
    assert calls == ["leader me"]
    assert Lease.objects.inspect(key).status == "free"


# ---- several processes ---------------------------------------------------------------------------


@pytest.fixture
def campaigners(key: str) -> Iterator[list[Campaigner]]:
    """Start campaigner processes with ``start(mode, name)``; every one is closed at the end."""
    started: list[Campaigner] = []
    yield started
    for child in started:
        child.close()


def start(started: list[Campaigner], mode: str, key: str, *names: str) -> list[Campaigner]:
    children = [Campaigner(mode, key, TTL, name, url_of_test_database()) for name in names]
    started.extend(children)
    for child in children:
        child.expect("ready")
    return children


def next_leader(children: list[Campaigner], terms: int, timeout: float = HANG) -> dict[str, Any]:
    """The ``terms``-th ``leading`` event among ``children`` (by time), once that leader has written."""
    deadline = time.monotonic() + timeout
    while True:
        events = sorted((e for c in children for e in c.of("leading")), key=lambda e: e["at"])
        if len(events) >= terms:
            term = events[terms - 1]
            child = next(c for c in children if c.name == term["name"])
            wrote = [e for e in child.of("wrote") if e["epoch"] == term["epoch"]]
            if wrote:
                return term
        assert time.monotonic() < deadline, f"no term #{terms} with a write: {events}"
        time.sleep(0.01)


def check_history(key: str, children: list[Campaigner]) -> list[tuple[int, str]]:
    """The terms of ``key`` as written: disjoint on the server clock, epochs strictly increasing.

    Returns ``(epoch, writer)`` per term, in order.
    """
    rows = list(
        Entry.objects.filter(account=key).order_by("ticket", "id").values_list("ticket", "writer", "lease_epoch")
    )
    assert rows and all(ticket is not None for ticket, _, _ in rows)
    terms: list[tuple[int, str]] = []
    for _ticket, writer, epoch in rows:
        assert epoch is not None
        if terms and terms[-1][0] == epoch:
            assert terms[-1][1] == writer, f"two writers at epoch {epoch}"
            continue
        assert not terms or epoch > terms[-1][0], f"epoch {epoch} by {writer} after {terms[-1]}: terms overlap"
        terms.append((epoch, writer))
    started = sorted((e["epoch"], e["name"]) for c in children for e in c.of("leading"))
    assert terms == [term for term in started if term in terms]  # every written term was announced
    for child in children:  # on_new_leader: once per change
        seen = [e["identity"] for e in child.of("leader")]
        assert all(a != b for a, b in itertools.pairwise(seen)), seen
    return terms


def test_killed_and_frozen_leaders_are_replaced_within_ttl_plus_a_renew_interval_and_a_handoff_is_quick(
    key: str, campaigners: list[Campaigner]
) -> None:
    children = start(campaigners, "sync", key, "a", "b", "c")
    by_name = {child.name: child for child in children}
    first = next_leader(children, 1)

    # SIGKILL the leader: its lease lapses at most TTL after its last renewal.
    killed_at = time.monotonic()
    by_name[first["name"]].signal(signal.SIGKILL)
    second = next_leader(children, 2)
    after_kill = second["at"] - killed_at
    assert second["name"] != first["name"]
    assert second["epoch"] == first["epoch"] + 1, "taken over once the lease lapsed: nobody released it"

    # Freeze the next one (between two fenced writes) past its TTL, then let it go on.
    frozen = by_name[second["name"]]
    frozen.signal(signal.SIGUSR1)
    froze_at = frozen.expect("freezing")["at"]
    third = next_leader(children, 3)
    after_freeze = third["at"] - froze_at
    assert third["name"] not in (first["name"], second["name"])
    assert third["epoch"] == second["epoch"] + 1, "taken over once the frozen leader's lease lapsed"
    frozen.signal(signal.SIGCONT)
    stepping = frozen.expect("stepping")
    assert stepping["lost"] and stepping["epoch"] == second["epoch"]
    frozen.expect("stopped")
    wait_until(  # campaigning again, it sees the new leader
        lambda: any(e["identity"] == third["name"] and e["at"] > froze_at for e in frozen.of("leader")),
        what="the unfrozen leader to see the new one",
    )

    # A hand-off: the leader steps down at its next renewal, the other campaigner takes over.
    asked_at = time.monotonic()
    Lease.objects.request_handoff(key)
    fourth = next_leader(children, 4)
    after_handoff = fourth["at"] - asked_at
    assert fourth["name"] == second["name"]
    assert fourth["epoch"] == third["epoch"] + 2, "the leader released for the hand-off (a lapse: + 1)"
    assert by_name[third["name"]].expect("stepping", count=1)["handoff"]

    close_leader_last(children, fourth["name"])
    terms = check_history(key, children)
    assert [name for _epoch, name in terms] == [first["name"], second["name"], third["name"], fourth["name"]]
    assert Lease.objects.inspect(key).status == "free"  # the last leader released when stopped
    took = f"after SIGKILL {after_kill:.2f}s, after SIGSTOP {after_freeze:.2f}s, hand-off {after_handoff:.2f}s"
    print(f"\nsync: failover {took}")


def close_leader_last(children: list[Campaigner], leader: str) -> None:
    """Stop the campaigners, the leader last: closed first, it would hand the lease to one still
    campaigning (a term the test did not ask for; seen once under load, in xdist workers)."""
    for child in sorted(children, key=lambda child: child.name == leader):
        child.close()


def test_async_campaigners_fail_over_and_hand_off(key: str, campaigners: list[Campaigner]) -> None:
    children = start(campaigners, "async", key, "a", "b", "c")
    by_name = {child.name: child for child in children}
    first = next_leader(children, 1)

    killed_at = time.monotonic()
    by_name[first["name"]].signal(signal.SIGKILL)
    second = next_leader(children, 2)
    after_kill = second["at"] - killed_at
    assert second["name"] != first["name"]
    assert second["epoch"] == first["epoch"] + 1, "taken over once the lease lapsed: nobody released it"

    asked_at = time.monotonic()
    Lease.objects.request_handoff(key)
    third = next_leader(children, 3)
    after_handoff = third["at"] - asked_at
    assert third["name"] not in (first["name"], second["name"])
    assert third["epoch"] == second["epoch"] + 2, "the leader released for the hand-off (a lapse: + 1)"
    assert by_name[second["name"]].expect("stepping")["handoff"]  # its task was cancelled

    close_leader_last(children, third["name"])
    terms = check_history(key, children)
    assert [name for _epoch, name in terms] == [first["name"], second["name"], third["name"]]
    assert Lease.objects.inspect(key).status == "free"
    print(f"\nasync: failover after SIGKILL {after_kill:.2f}s, hand-off {after_handoff:.2f}s")
