"""Patroni's hook for the asynchronous gap: ``python -m pg_lease_django.patroni``.

A failover may lose acknowledged writes, with asynchronous replication or a manual failover to a
lagging standby. The promoted server would then grant again the epochs the lost primary
acknowledged. The remedy is ``leases advance-epochs --by N`` on the promoted server **before any
client gets in**, as docs/high-availability.md explains. This module runs it from Patroni, in two
steps, because Patroni runs ``on_role_change`` without waiting for it, after the promotion, when
clients may already be connecting:

1. ``pre_promote`` decides whether the promotion is a clean hand-over. Patroni runs it and waits,
   after taking the leader key and before ``pg_ctl promote``; a non-zero exit cancels the
   promotion. The hand-over is clean when the last WAL record this standby has is the old
   primary's **shutdown checkpoint**: a primary writes nothing after it, so the standby has
   everything the old primary acknowledged. A ``patronictl switchover`` is such a hand-over, and
   so is a failover while the old leader was shut down cleanly. Anything else may have lost
   writes, whether a crash, a stall, a lost network or a record that cannot be read. Then the hook
   **closes the gate** on the standby with ``ALTER SYSTEM SET default_transaction_read_only = on``
   and a reload, and waits until new sessions see it. The promoted server then refuses every
   client write: libpq's ``target_session_attrs=read-write`` passes it over, and a client through
   HAProxy gets "cannot execute ... in a read-only transaction", so nothing is granted. On a clean
   hand-over it opens a gate left closed by an earlier failover instead.
2. ``on_role_change`` or ``on_start`` with the role ``master`` or ``primary``: when the gate is
   closed, it advances the epochs by ``--by`` in every database with the lease table, or in those
   named with ``--dbname``. It does so in sessions that turn ``default_transaction_read_only`` off
   for themselves, then opens the gate with ``ALTER SYSTEM RESET`` and a reload. It retries until
   it has done so. With the gate open after a clean hand-over, it does nothing.

Patroni's configuration goes in the ``postgresql`` section of each node. Patroni appends
``on_role_change ROLE SCOPE`` to a callback, and nothing to ``pre_promote``. Below, HOOK stands for
``/srv/app/.venv/bin/python -m pg_lease_django.patroni --conninfo 'host=127.0.0.1 port=5432
user=postgres dbname=postgres' --bindir /usr/lib/postgresql/15/bin --by 1000000``, on one line::

    pre_promote: HOOK pre_promote
    callbacks:
      on_role_change: HOOK
      on_start: HOOK

``--conninfo`` reaches this node's own server as a role that may run ``ALTER SYSTEM`` and
``pg_lease_advance_epochs``, such as Patroni's superuser; ``--bindir`` holds ``pg_waldump``. It
needs no Django settings: it calls the SQL function the ``leases advance-epochs`` command calls.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from pg_lease_django.sql import run, statements

logger = logging.getLogger(__name__)

#: Options of the hook's own sessions on a gated server: read-write for them alone.
WRITE_THROUGH_GATE = "-c default_transaction_read_only=off"
#: How far back from the end of the standby's WAL ``pg_waldump`` starts looking for the last record
#: (it skips to the first record boundary; a last record longer than this reads as "not clean").
WAL_WINDOW = 256 * 1024
_RECORD = re.compile(
    r"^rmgr: (\S+)\s+len \(rec/tot\):\s+\d+/\s*\d+, tx:\s+\d+, lsn: ([0-9A-F]+/[0-9A-F]+), .*desc: (\S+)"
)


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def _connect(conninfo: str, *, through_gate: bool = False, dbname: str | None = None) -> psycopg.Connection:
    extra: dict[str, str] = {}
    if through_gate:
        extra["options"] = WRITE_THROUGH_GATE
    if dbname is not None:
        extra["dbname"] = dbname
    return psycopg.connect(psycopg.conninfo.make_conninfo(conninfo, **extra), autocommit=True, connect_timeout=10)


def last_record(conninfo: str, bindir: Path | None) -> tuple[str | None, str]:
    """The type of the last WAL record a standby has (``pg_waldump``'s desc, e.g.
    ``CHECKPOINT_SHUTDOWN``), or None when it cannot be read; and why."""
    with _connect(conninfo) as conn:
        [state] = run.on_psycopg(conn, statements.RECOVERY_STATE)
    if not state.in_recovery:
        return None, "not a standby"
    ends = [_lsn(lsn) for lsn in (state.received, state.replayed) if lsn]
    if not ends:
        return None, "no WAL position"
    end = max(ends)
    waldump = shutil.which("pg_waldump", path=str(bindir) if bindir else None)
    if waldump is None:
        return None, "pg_waldump not found (--bindir)"
    segment = (end - 1) // state.segment_size
    per_id = 0x100000000 // state.segment_size
    suffix = f"{segment // per_id:08X}{segment % per_id:08X}"
    wal = Path(state.data_directory) / "pg_wal"
    files = sorted(p.name for p in wal.iterdir() if len(p.name) == 24 and p.name.endswith(suffix))
    if not files:
        return None, f"no WAL segment for {_lsn_text(end)}"
    timeline = int(files[-1][:8], 16)
    start = max(segment * state.segment_size, end - WAL_WINDOW)
    done = subprocess.run(
        [waldump, "--path", str(wal), "--timeline", str(timeline), "--start", _lsn_text(start)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    records = [m for m in map(_RECORD.match, done.stdout.splitlines()) if m]
    if not records:
        return None, f"pg_waldump read no record from {_lsn_text(start)}: {done.stderr.strip()[:200]}"
    rmgr, lsn, desc = records[-1].groups()
    return f"{rmgr}:{desc}", f"last record at {lsn} on timeline {timeline}"


def is_clean_handover(conninfo: str, bindir: Path | None) -> tuple[bool, str]:
    """Whether the last record the standby has is the old primary's shutdown checkpoint; and why."""
    try:
        record, why = last_record(conninfo, bindir)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"could not read the WAL: {exc}"
    return record == "XLOG:CHECKPOINT_SHUTDOWN", f"{record or 'unknown'} ({why})"


def gate_closed(conninfo: str) -> bool:
    """Whether new sessions of the server start read-only (the gate of this hook)."""
    with _connect(conninfo) as conn:
        return run.on_psycopg(conn, statements.READ_ONLY_GATE) == ["on"]


def set_gate(conninfo: str, closed: bool, *, timeout: float = 60) -> None:
    """Close (``default_transaction_read_only = on``) or open the gate, server-wide; return once new
    sessions see it."""
    with _connect(conninfo, through_gate=True) as conn:
        run.on_psycopg(conn, statements.CLOSE_READ_ONLY_GATE if closed else statements.OPEN_READ_ONLY_GATE)
        run.on_psycopg(conn, statements.RELOAD_CONFIGURATION)
    deadline = time.monotonic() + timeout
    while gate_closed(conninfo) != closed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not apply default_transaction_read_only={'on' if closed else 'off'}")
        time.sleep(0.05)


def lease_databases(conninfo: str) -> list[str]:
    """The databases of the server whose search_path reaches a lease table."""
    with _connect(conninfo) as conn:
        names = run.on_psycopg(conn, statements.DATABASES)
    found = []
    for name in names:
        with _connect(conninfo, dbname=name) as conn:
            if run.on_psycopg(conn, statements.SCHEMA_LOOKUP):
                found.append(name)
    return found


def advance_epochs(conninfo: str, dbname: str, by: int) -> tuple[int, int]:
    """``pg_lease_advance_epochs(by)`` in ``dbname``, through the gate; (leases advanced, highest epoch)."""
    with _connect(conninfo, through_gate=True, dbname=dbname) as conn:
        schemas = run.on_psycopg(conn, statements.SCHEMA_LOOKUP)
        if len(schemas) != 1:
            raise RuntimeError(f"database {dbname!r}: {len(schemas)} schemas with a lease table on the search_path")
        [done] = run.on_psycopg(conn, statements.ADVANCE_EPOCHS, schema=schemas[0], by=by, dry_run=False)
    return done.leases, done.max_epoch


def pre_promote(args: argparse.Namespace) -> int:
    """Close the gate unless the promotion is a clean hand-over (open it then)."""
    clean, why = (False, "--always") if args.always else is_clean_handover(args.conninfo, args.bindir)
    set_gate(args.conninfo, not clean)
    if clean:
        logger.warning("pg_lease_django: clean hand-over (%s): epochs stay, gate open", why)
    else:
        logger.warning("pg_lease_django: promotion may have lost writes (%s): gate closed until the advance", why)
    return 0


def on_leader(args: argparse.Namespace) -> int:
    """With the gate closed: advance the epochs in every lease database, then open the gate; retry until done."""
    while True:
        try:
            if not gate_closed(args.conninfo):
                logger.warning("pg_lease_django: gate open, nothing to advance")
                return 0
            databases = args.dbname or lease_databases(args.conninfo)
            for dbname in databases:
                leases, highest = advance_epochs(args.conninfo, dbname, args.by)
                logger.warning(
                    "pg_lease_django: advanced %s lease(s) in %s by %s (highest epoch %s)",
                    leases,
                    dbname,
                    args.by,
                    highest,
                )
            set_gate(args.conninfo, False)
            logger.warning("pg_lease_django: gate open")
            return 0
        except (psycopg.Error, RuntimeError) as exc:
            logger.warning("pg_lease_django: advance failed, retrying: %s", exc)
            if _in_recovery(args.conninfo):  # demoted meanwhile: its next promotion decides again
                return 0
            time.sleep(1)


def _in_recovery(conninfo: str) -> bool:
    """Whether the server is a standby now (False when it does not answer)."""
    try:
        with _connect(conninfo) as conn:
            return run.on_psycopg(conn, statements.IN_RECOVERY) == [True]
    except psycopg.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m pg_lease_django.patroni [options] pre_promote | ACTION ROLE SCOPE`` (Patroni's arguments)."""
    parser = argparse.ArgumentParser(prog="python -m pg_lease_django.patroni", description=__doc__.split("\n\n")[0])
    parser.add_argument("--conninfo", required=True, help="libpq conninfo of this node's own server (a superuser)")
    parser.add_argument("--bindir", type=Path, default=None, help="directory of pg_waldump (default: PATH)")
    parser.add_argument("--by", type=int, default=1_000_000, help="the advance (default 1,000,000)")
    parser.add_argument("--dbname", action="append", default=None, help="a lease database (default: every one)")
    parser.add_argument("--always", action="store_true", help="treat every promotion as one that may have lost writes")
    parser.add_argument("action", help="pre_promote, or Patroni's callback action (on_role_change, on_start, ...)")
    parser.add_argument("role", nargs="?", default=None, help="Patroni's role (master, primary, replica, ...)")
    parser.add_argument("scope", nargs="?", default=None, help="Patroni's cluster name")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s: %(message)s", stream=sys.stderr)
    if not 1 <= args.by <= 2**62:
        parser.error("--by must be between 1 and 2**62")
    if args.action == "pre_promote":
        return pre_promote(args)
    if args.action in ("on_role_change", "on_start") and args.role in ("master", "primary"):
        return on_leader(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
