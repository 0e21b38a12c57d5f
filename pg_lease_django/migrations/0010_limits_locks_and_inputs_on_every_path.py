"""Limits locks and inputs on every path: ``sql/migrations/0010_limits_locks_and_inputs_on_every_path.sql``.

Issue 52, the paths around issue 42's guarantees. A role limit was counted in the caller's
snapshot: REPEATABLE READ sessions, an imported snapshot or an old SERIALIZABLE transaction made
brand-new keys far past it. It now locks the role's row of the limits table (row-level security
lets only the lease functions lock it; the advisory lock it replaces had a number any role could
compute from the source and hold) and refuses a limited role's brand-new key outside READ
COMMITTED (0A000). A blocking attempt bounds every lock wait by the waiter's deadline.
The history scope is read without the SHARE lock that made a deploy queue behind a tenant's open
transaction; a scope change meets brand-new keys on the epoch floor's row instead.

Changed: function pg_lease_check_lease_quota(text), function pg_lease_acquire(text, text, interval,
interval), function pg_lease_acquire_or_register(text, text, interval, interval), function
pg_lease_in_history_scope(text), function pg_lease_rescope(). Written from ``sql/schema.sql`` by
devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0009_scopes_compiled_as_committed")]

    operations = [
        RunSQLFile(
            "migrations/0010_limits_locks_and_inputs_on_every_path.sql",
            "migrations/0010_limits_locks_and_inputs_on_every_path_reverse.sql",
            sha256="a2039989ffcbec4216f20ba39e6006aedef5b359806c25d14a407dbb0870a234",
            reverse_sha256="b608b620a4a7bbddceb463783457016c2a83c6ff40eea89b90214377bb472172",
        )
    ]
