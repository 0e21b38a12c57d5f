"""Fenced save one read: ``sql/migrations/0012_fenced_save_one_read.sql``.

Why (issue 55): a fenced save of one row cost 4.0x a plain save's server instructions (1.4x its
wall clock). The check (pg_lease_check_fence) read the lease row twice, unlocked and then locked,
and called the key-scope check as a PL/pgSQL function; the fenced tables' statement trigger parsed
pg_lease.fences (a subtransaction), grouped its transition tables and ran pg_lease_guard_key's
checks and locked read for each key. Now the check is one read that locks the row only when it
matches (a stale fence still takes no lock), and the trigger decides the common case (one key,
one fence presented, its text as pg_lease_check_fence wrote it) in one aggregate pass and one
locked read in the new pg_lease_guard_one_key, which compares pg_lease.fences with the live lease
row's own fence; anything else, and every refusal, takes the full way as before. The guarantee
is unchanged: every written or removed row's key needs a live fence, checked under the lock,
whoever writes (benchmarks/instructions.py: 4.0x -> 2.7x with the save's bare call).

New: function pg_lease_guard_one_key(text, text, bigint, bigint, bigint, text). Changed: function
pg_lease_check_fence(text, text, bigint), function pg_lease_guard_key(text, jsonb, text), function
pg_lease_guard_rows(), function pg_lease_privileges(). Written from ``sql/schema.sql`` by
devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0011_metrics_rule_of_the_database")]

    operations = [
        RunSQLFile(
            "migrations/0012_fenced_save_one_read.sql",
            "migrations/0012_fenced_save_one_read_reverse.sql",
            sha256="0d2d60151525640887a551ad9cf5957a34b8c85ec5918f404ac7851466b5014d",
            reverse_sha256="d5f0de4be7766e212242ca238185eb88b846026a2180a5e8101321977070a7be",
        )
    ]
