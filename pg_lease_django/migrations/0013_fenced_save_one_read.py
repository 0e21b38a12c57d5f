"""Fenced save one read: ``sql/migrations/0013_fenced_save_one_read.sql``.

Why, from issue 55: a fenced save of one row cost 4.0x a plain save's server instructions, and
1.4x its wall clock. The check, pg_lease_check_fence, read the lease row twice, unlocked and then
locked. It called the key-scope check as a PL/pgSQL function and recorded the fence through a JSON
round trip. The fenced tables' statement trigger parsed pg_lease.fences in a subtransaction,
grouped its transition tables and ran pg_lease_guard_key's checks and locked read for each key.

Now the check is one read that locks the row only when it matches. A stale fence still takes no
lock; inputs and scope are judged after it, only on the way to a refusal. The trigger decides the
common case in one aggregate pass and one locked read in the new pg_lease_guard_one_key, which
compares pg_lease.fences with the live lease row's own fence. The common case is one key with one
fence presented, its text as pg_lease_check_fence wrote it. Anything else, and every refusal,
takes the full way as before. The guarantee is unchanged: every written or removed row's key needs
a live fence, checked under the lock, whoever writes. benchmarks/instructions.py measures 4.03x ->
2.49x a plain save, with the save's bare call, the entry fence_expression of queries.sql.

New: function pg_lease_guard_one_key(text, text, bigint, bigint, text). Changed: function
pg_lease_check_fence(text, text, bigint), function pg_lease_guard_key(text, jsonb, text), function
pg_lease_guard_rows(), function pg_lease_privileges(). Written from ``sql/schema.sql`` by
devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0012_polling_attempts_within_the_deadline")]

    operations = [
        RunSQLFile(
            "migrations/0013_fenced_save_one_read.sql",
            "migrations/0013_fenced_save_one_read_reverse.sql",
            sha256="adf518621b842e946ea084df32f067cdbba7f5e6d25ed001a13ccffca0b8075a",
            reverse_sha256="495cfea6feac8c7b8a3af5a316187557a57042d50c2057e0b8fb29a4cfabebf1",
        )
    ]
