"""Limits locks and inputs on every path: ``sql/migrations/0010_limits_locks_and_inputs_on_every_path.sql``.

Issue 52, the paths around issue 42's guarantees. A role limit was counted in the caller's
snapshot: REPEATABLE READ sessions, an imported snapshot or an old SERIALIZABLE transaction made
brand-new keys far past it. It now locks the role's row of the limits table; row-level security
lets only the lease functions lock it. The advisory lock it replaces had a number any role could
compute from the source and hold. It refuses with 0A000 a limited role's brand-new key outside READ
COMMITTED. A blocking attempt bounds every lock wait by the waiter's deadline.
The history scope is read without the SHARE lock that made a deploy queue behind a tenant's open
transaction; a scope change meets brand-new keys on the epoch floor's row instead.
Every function judges input, 22023, before the key scope, 42501: pg_lease_acquire_or_register
and pg_lease_check_fence checked the scope first. A malformed pg_lease.fences of any size or
depth is PL004, and a presented epoch of 0 is as malformed as -1.
A key or an owner is any non-empty text again, as the spec says: the refusal of control, bidi and
invisible characters by pg_lease_check_new_name and pg_lease_unshown_characters is dropped; the
views escape them.

Changed: function pg_lease_check_lease_quota(text), function pg_lease_acquire(text, text, interval),
function pg_lease_acquire(text, text, interval, interval), function
pg_lease_acquire_or_register(text, text, interval, interval), function pg_lease_check_fence(text,
text, bigint), function pg_lease_presented_fences(), function pg_lease_guard_key(text, jsonb, text),
function pg_lease_in_history_scope(text), function pg_lease_rescope(), function
pg_lease_privileges(). Dropped: function pg_lease_unshown_characters(), function
pg_lease_check_new_name(text, text). Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0009_scopes_compiled_as_committed")]

    operations = [
        RunSQLFile(
            "migrations/0010_limits_locks_and_inputs_on_every_path.sql",
            "migrations/0010_limits_locks_and_inputs_on_every_path_reverse.sql",
            sha256="c65bbb939ce8880bfe4082038f8168d9ae6c4d87db0bb569ac900241bf6507cd",
            reverse_sha256="2f7e69f501edf47829baa45701920e2bbdd55e30f1500dfcde9bfe6c75a089f9",
        )
    ]
