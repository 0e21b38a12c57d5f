"""Stage ``single``: the floor (hand-written SQL), the SQL functions and ``Lease.objects`` on one connection.

The floor is what an application would write by hand and send through Django's cursor (its
CursorWrapper and execute wrappers), a cursor per call as ``Lease.objects`` does, on a plain table of
the lease table's shape and fill factor with no triggers (``PLAIN_TABLE``): every ratio is against
it. The same statements on the lease table itself, its triggers firing, are a second line; the SQL
functions called on the raw psycopg connection show the functions' own cost. The floor's
statements live here; the scale-out stage runs them from several processes too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import (
    PLAIN_TABLE,
    TABLE,
    TTL,
    Cycle,
    Report,
    Row,
    Timer,
    acquire_epoch,
    block_rates,
    count_statements,
    interleave,
    op_p,
    plain_lease_table,
    ratio,
    raw_connection,
)

# ---- the floor: what one would write by hand, one statement per operation --------------------------
# Same rules as the SQL functions for an existing key (the steady state), without their input checks,
# the unlocked look before locking, the per-call synchronous_commit and the release notification.

FLOOR_ACQUIRE_ON = """
UPDATE {table} SET owner = %s, epoch = epoch + 1, acquired_at = clock_timestamp(),
                   expires_at = clock_timestamp() + %s
 WHERE key = %s AND (owner IS NULL OR expires_at <= clock_timestamp() OR owner = %s)
RETURNING epoch, expires_at"""
FLOOR_RENEW_ON = """
UPDATE {table} SET expires_at = clock_timestamp() + %s
 WHERE key = %s AND owner = %s AND epoch = %s AND expires_at > clock_timestamp()
RETURNING expires_at"""
FLOOR_RELEASE_ON = """
UPDATE {table} SET owner = NULL, epoch = epoch + 1, acquired_at = NULL, expires_at = NULL
 WHERE key = %s AND owner = %s AND epoch = %s AND expires_at > clock_timestamp()
RETURNING epoch"""
FLOOR_INSPECT_ON = "SELECT owner, epoch, expires_at, clock_timestamp() FROM {table} WHERE key = %s"

# The floor: on the plain table.
FLOOR_ACQUIRE = FLOOR_ACQUIRE_ON.format(table=PLAIN_TABLE)
FLOOR_RENEW = FLOOR_RENEW_ON.format(table=PLAIN_TABLE)
FLOOR_RELEASE = FLOOR_RELEASE_ON.format(table=PLAIN_TABLE)
# The floor's release plus the notification pg_lease_release sends (the scale-out stage compares both).
FLOOR_RELEASE_NOTIFY = FLOOR_RELEASE.replace("RETURNING epoch", "RETURNING epoch, pg_notify('pg_lease_django', key)")
FLOOR_INSPECT = FLOOR_INSPECT_ON.format(table=PLAIN_TABLE)


def through_django(statement: str, params: list[Any]) -> Any:
    """One hand-written statement sent as an application sends it: Django's cursor, its one row."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def run(report: Report, rounds: int, block: float, owner: str) -> dict[str, float]:
    """Floor vs SQL function vs manager on one connection; returns figures later sections reuse."""
    from pg_lease_django import Lease

    raw = raw_connection()
    section = "1 conn"

    # SELECT 1: the round trip.
    rt = interleave({"select1": lambda t: t("op", raw.execute, "SELECT 1")}, rounds, block / 2)["select1"]
    report.add(
        Row(section, "floor: SELECT 1 (raw psycopg)", rt.rate, rt.p("op", 0.5), rt.p("op", 0.99), note="round trip")
    )

    # Keys exist before timing (the floor's UPDATE needs the row; the steady state is an existing key).
    keys = {name: f"bench:{name}" for name in ("floor", "lease-table", "function", "manager", "hold")}
    for key in keys.values():
        grant = Lease.objects.acquire(key, owner, TTL)
        assert grant is not None, f"{key} is held by someone else"
        Lease.objects.release(key, owner, grant.epoch)
    plain_lease_table([keys["floor"]])
    on_lease_table = {
        "acquire": FLOOR_ACQUIRE_ON.format(table=TABLE),
        "release": FLOOR_RELEASE_ON.format(table=TABLE),
    }

    def floor_cycle(t: Timer) -> None:
        epoch, _ = t("acquire", through_django, FLOOR_ACQUIRE, [owner, TTL, keys["floor"], owner])
        row = t("release", through_django, FLOOR_RELEASE, [keys["floor"], owner, epoch])
        assert row is not None

    def lease_table_cycle(t: Timer) -> None:
        epoch, _ = t("acquire", through_django, on_lease_table["acquire"], [owner, TTL, keys["lease-table"], owner])
        row = t("release", through_django, on_lease_table["release"], [keys["lease-table"], owner, epoch])
        assert row is not None

    def function_cycle(t: Timer) -> None:
        granted, _k, _o, epoch, *_ = t(
            "acquire",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_acquire(%s, %s, %s)", [keys["function"], owner, TTL]
            ).fetchone(),
        )
        assert granted
        outcome, *_ = t(
            "release",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_release(%s, %s, %s)", [keys["function"], owner, epoch]
            ).fetchone(),
        )
        assert outcome == "ok"

    def manager_cycle(t: Timer) -> None:
        grant = t("acquire", Lease.objects.acquire, keys["manager"], owner, TTL)
        t("release", Lease.objects.release, keys["manager"], owner, grant.epoch)

    cycles: dict[str, Cycle] = {
        "floor": floor_cycle,
        "lease-table": lease_table_cycle,
        "function": function_cycle,
        "manager": manager_cycle,
    }
    grants: list[Any] = []
    statements = {
        "acquire": count_statements(lambda: grants.append(Lease.objects.acquire(keys["manager"], owner, TTL)))
    }
    statements["release"] = count_statements(lambda: Lease.objects.release(keys["manager"], owner, grants[0].epoch))

    hold_fn, hold_note = _hold_function()
    if hold_fn is not None:

        def hold_cycle(t: Timer) -> None:
            holding = hold_fn(keys["hold"], TTL, owner=owner)
            t("acquire", holding.__enter__)
            t("release", holding.__exit__, None, None, None)

        cycles["hold"] = hold_cycle

    series = interleave(cycles, rounds, block)
    floor, function, manager = series["floor"], series["function"], series["manager"]
    labels = {
        "floor": "floor: hand-written UPDATEs, plain table (Django cursor)",
        "lease-table": "  the same UPDATEs on the lease table (its triggers)",
        "function": "SQL functions (raw psycopg)",
    }
    for name in ("floor", "lease-table", "function"):
        s = series[name]
        report.add(
            Row(
                section,
                f"{labels[name]} acquire+release",
                s.rate,
                s.cycle_ms(0.5),
                s.cycle_ms(0.99),
                None if name == "floor" else ratio(s, floor),
                "" if name == "floor" else "floor (ops/s)",
            )
        )
    acquire_release_ratio = ratio(manager, floor)
    report.add(
        Row(
            section,
            "Lease.objects acquire+release",
            manager.rate,
            manager.cycle_ms(0.5),
            manager.cycle_ms(0.99),
            acquire_release_ratio,
            "floor (ops/s)",
            ">= 0.95x",
            acquire_release_ratio >= 0.95,
            f"{statements['acquire']}+{statements['release']} statements; "
            f"vs functions {ratio(manager, function):.2f}x; "
            f"p50 latency ratio {floor.cycle_ms(0.5) / manager.cycle_ms(0.5):.2f}x",
        )
    )
    for step in ("acquire", "release"):
        report.add(
            Row(
                section,
                f"  Lease.objects.{step} (latency)",
                None,
                manager.p(step, 0.5),
                manager.p(step, 0.99),
                note=f"floor p50 {floor.p(step, 0.5):.2f} ms, function p50 {function.p(step, 0.5):.2f} ms",
            )
        )
    if "hold" in series:
        held = series["hold"]
        report.add(
            Row(
                section,
                "hold() enter+exit",
                held.rate,
                held.cycle_ms(0.5),
                held.cycle_ms(0.99),
                ratio(held, manager),
                "manager acq+rel",
                ">= 0.5x",
                ratio(held, manager) >= 0.5,
                note=f"enter p50 {held.p('acquire', 0.5):.2f} ms, exit p50 {held.p('release', 0.5):.2f} ms",
            )
        )
    else:
        report.add(Row(section, "hold() enter+exit", note=f"skipped: {hold_note}"))

    # Renew and inspect: a held key each, renewed/inspected back to back.
    held_keys = {name: f"bench:renew:{name}" for name in ("floor", "function", "manager")}
    epochs = {name: acquire_epoch(key, owner, ttl=600) for name, key in held_keys.items()}
    # The floor's key is held on the plain table at the same epoch.
    plain_lease_table([held_keys["floor"]])
    through_django(
        f"UPDATE {PLAIN_TABLE} SET owner = %s, epoch = %s, acquired_at = clock_timestamp(), "
        "expires_at = clock_timestamp() + interval '600 s' WHERE key = %s RETURNING key",
        [owner, epochs["floor"], held_keys["floor"]],
    )

    def floor_renew(t: Timer) -> None:
        assert t("op", through_django, FLOOR_RENEW, [TTL, held_keys["floor"], owner, epochs["floor"]])

    def function_renew(t: Timer) -> None:
        row = t(
            "op",
            lambda: raw.execute(
                "SELECT * FROM pg_lease_renew(%s, %s, %s, %s)",
                [held_keys["function"], owner, epochs["function"], TTL],
            ).fetchone(),
        )
        assert row[0] == "ok"

    def manager_renew(t: Timer) -> None:
        t("op", Lease.objects.renew, held_keys["manager"], owner, epochs["manager"], TTL)

    renew_statements = count_statements(lambda: manager_renew(Timer()))
    renew = interleave({"floor": floor_renew, "function": function_renew, "manager": manager_renew}, rounds, block)
    renew_ratio = ratio(renew["manager"], renew["floor"])
    report.add(
        Row(section, "floor: hand-written renew UPDATE (Django cursor)", renew["floor"].rate, *op_p(renew["floor"]))
    )
    report.add(Row(section, "SQL function renew (raw psycopg)", renew["function"].rate, *op_p(renew["function"])))
    report.add(
        Row(
            section,
            "Lease.objects.renew",
            renew["manager"].rate,
            *op_p(renew["manager"]),
            renew_ratio,
            "floor (ops/s)",
            ">= 0.95x",
            renew_ratio >= 0.95,
            f"{renew_statements} statement; vs function {ratio(renew['manager'], renew['function']):.2f}x; "
            f"p50 latency ratio {renew['floor'].p('op', 0.5) / renew['manager'].p('op', 0.5):.2f}x",
        )
    )

    def floor_inspect(t: Timer) -> None:
        t("op", through_django, FLOOR_INSPECT, [held_keys["floor"]])

    def function_inspect(t: Timer) -> None:
        t("op", lambda: raw.execute("SELECT * FROM pg_lease_inspect(%s)", [held_keys["function"]]).fetchone())

    def manager_inspect(t: Timer) -> None:
        t("op", Lease.objects.inspect, held_keys["manager"])

    inspect_statements = count_statements(lambda: manager_inspect(Timer()))
    inspect = interleave(
        {"floor": floor_inspect, "function": function_inspect, "manager": manager_inspect}, rounds, block / 2
    )
    floor_inspect_label = "floor: hand-written inspect SELECT (Django cursor)"
    report.add(Row(section, floor_inspect_label, inspect["floor"].rate, *op_p(inspect["floor"])))
    inspect_ratio = ratio(inspect["manager"], inspect["floor"])
    report.add(Row(section, "SQL function inspect (raw psycopg)", inspect["function"].rate, *op_p(inspect["function"])))
    report.add(
        Row(
            section,
            "Lease.objects.inspect",
            inspect["manager"].rate,
            *op_p(inspect["manager"]),
            inspect_ratio,
            "floor (ops/s)",
            ">= 0.95x",  # issue 31 (was 0.9x, issue 17's)
            inspect_ratio >= 0.95,
            f"{inspect_statements} statement; "
            f"p50 latency ratio {inspect['floor'].p('op', 0.5) / inspect['manager'].p('op', 0.5):.2f}x",
        )
    )
    for name, key in held_keys.items():
        Lease.objects.release(key, owner, epochs[name])
    report.details["block_rates"] = block_rates({"acquire+release": series, "renew": renew, "inspect": inspect})
    report.details["statements_per_call"] = {
        "acquire": statements["acquire"],
        "release": statements["release"],
        "renew": renew_statements,
        "inspect": inspect_statements,
    }
    return {
        "select1_rate": rt.rate,
        "manager_cycle_rate": manager.rate,
        "renew_p99_1conn": renew["manager"].p("op", 0.99),
    }


def _hold_function() -> tuple[Callable[..., Any] | None, str]:
    """``hold`` when the package exports it (a tree without it still runs the rest)."""
    import pg_lease_django

    hold = getattr(pg_lease_django, "hold", None)
    if hold is None:
        return None, "pg_lease_django does not export hold() in this tree"
    return hold, ""
