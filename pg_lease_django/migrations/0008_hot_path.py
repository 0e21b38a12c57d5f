"""The hot path in server instructions: ``sql/migrations/0008_hot_path.sql``.

The key scope is an inlinable predicate tested in each operation's input condition; acquire,
heartbeat, release and inspect return named row types, write their result from their own
RETURNING and ask for synchronous_commit only when it is lower than 'on'; acquire and release leave
the expiry to the update trigger, so the renewal rule is not looked at for them; release wakes its
waiters inline; inspect reads the lease row alone. Written by hand (new types, changed return
types): the functions are dropped and made again, their EXECUTE grants kept.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0007_tenants_apart")]

    operations = [
        RunSQLFile(
            "migrations/0008_hot_path.sql",
            "migrations/0008_hot_path_reverse.sql",
            sha256="bf10fd85ccd4e5293a0321a6a4cd27c9292313d505da87253814f3efd62f3e35",
            reverse_sha256="fbce9820fb5085196f4d9567382f619e2beb79f154a64bc9dd5871c611c1ae81",
        )
    ]
