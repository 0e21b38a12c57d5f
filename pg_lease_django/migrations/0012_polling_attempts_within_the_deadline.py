"""Polling attempts within the deadline: ``sql/migrations/0012_polling_attempts_within_the_deadline.sql``.

Issue 52's last gap. A blocking acquire can poll rather than LISTEN: behind a transaction pooler,
with PG_LEASE_LISTEN = False, or inside the caller's atomic(). Such an acquire, and the async wait's
first try, sent the plain pg_lease_acquire, whose lock waits only the caller's lock_timeout bounds.
An attempt could meet a lock held open: the lease row a takeover needs, a role's limit row, a
concurrent insert of the key. It then waited past the waiter's deadline, and
`acquire(blocking=True, timeout=3)` was answered, or granted, 15-20 s later in CI's pooled leg.
pg_lease_acquire_within(key, owner, ttl, within) is that attempt with every lock wait bounded by
`within`, what is left of the deadline, counted on the server from the call's start. That is the
way pg_lease_acquire_or_register of migration 0010 bounds a LISTENing waiter's attempt by its retry
bound. A wait that runs out is a refusal that changed nothing, and the waiter times out. Roles
granted pg_lease_acquire_or_register are granted it too, so that no polling waiter meets 42501
between this migration and the next `leases grant`. The plain acquire, the hot path, is unchanged.

New: function pg_lease_acquire_within(text, text, interval, interval). Changed: function
pg_lease_privileges(). Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0011_metrics_rule_of_the_database")]

    operations = [
        RunSQLFile(
            "migrations/0012_polling_attempts_within_the_deadline.sql",
            "migrations/0012_polling_attempts_within_the_deadline_reverse.sql",
            sha256="a02dcc1a2bcf7346d67e7b0876a54a0148a12df4d557fce2037ec470ed5910bf",
            reverse_sha256="9028420f36560cfb596ae44253a75ec5ce3caec7fbdb23496bdd9eab056a3a2e",
        )
    ]
