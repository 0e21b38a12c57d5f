"""Limits locks and inputs on every path: ``sql/migrations/0010_limits_locks_and_inputs_on_every_path.sql``.

Issue 52, the paths around issue 42's guarantees. A role limit was counted in the caller's
snapshot: REPEATABLE READ sessions, an imported snapshot or an old SERIALIZABLE transaction made
brand-new keys far past it. It now locks the role's row of the limits table (row-level security
lets only the lease functions lock it; the advisory lock it replaces had a number any role could
compute from the source and hold) and refuses a limited role's brand-new key outside READ
COMMITTED (0A000). A blocking attempt bounds every lock wait by the waiter's deadline.

Changed: function pg_lease_check_lease_quota(text), function pg_lease_acquire(text, text, interval,
interval), function pg_lease_acquire_or_register(text, text, interval, interval). Written from
``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0009_scopes_compiled_as_committed")]

    operations = [
        RunSQLFile(
            "migrations/0010_limits_locks_and_inputs_on_every_path.sql",
            "migrations/0010_limits_locks_and_inputs_on_every_path_reverse.sql",
            sha256="0f9e47e7db175653454da71bbcdedc08445285914fd6a4c43ba4a289174ade77",
            reverse_sha256="4c6c464ee1b647ef45e092933a65e3e475d027e5789ce3fc6cd1c14e494a0369",
        )
    ]
