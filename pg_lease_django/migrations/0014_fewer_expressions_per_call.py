"""Fewer expressions per call: ``sql/migrations/0014_fewer_expressions_per_call.sql``.

Why, from issue 55, the server's share of a call: PL/pgSQL compiles each expression a function
reaches again in every transaction. Compiling looks up each function in it and checks its EXECUTE
privilege, about 2,000 instructions a function, and a lease call is a transaction of its own, so
every test on its way is paid in full on every call. Release and renew tested the key, owner and
epoch before their UPDATE, though none that breaks a rule can match a row: the table's constraints
hold every row to them, and epochs start at 1. They now test them only after the UPDATE matched
nothing, before the verdict, in the same order. Acquire tests the key's rules only where no row
has it. pg_lease_guard_update takes a grant and a release, a new epoch of the same key, by the
shortest way, finds a marker with one LEAST, and tests the history flags once for a key nobody
records. Every rule is unchanged, and so is the order in which a bad input is named
(tests/db/test_rules_off_the_hot_path.py). benchmarks/instructions.py on PostgreSQL 15: acquire
and release 1,003,188 -> 952,143 instructions, 1.14x -> 1.08x the floor; renewal 442,028 ->
430,093, 1.08x -> 1.05x.

Changed: function pg_lease_acquire(text, text, interval), function pg_lease_heartbeat(text, text,
bigint, interval), function pg_lease_release(text, text, bigint), function pg_lease_guard_update().
Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0013_fenced_save_one_read")]

    operations = [
        RunSQLFile(
            "migrations/0014_fewer_expressions_per_call.sql",
            "migrations/0014_fewer_expressions_per_call_reverse.sql",
            sha256="2514a419cd3898c6c1f4d4ec4f97d2b37f91ae4550e34d96ce811804fa504eac",
            reverse_sha256="b14b910b321a3339c6328ed5bfc2461ac951e39d56afdf4620a51e4215da1b68",
        )
    ]
