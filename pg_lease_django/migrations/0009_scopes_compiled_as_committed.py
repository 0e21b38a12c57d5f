"""Scopes compiled as committed: ``sql/migrations/0009_scopes_compiled_as_committed.sql``.

Two changes of the scope table at once, such as two deploys syncing PG_LEASE_KEY_SCOPES, could
compile the key-scope predicate from rows one of them had already removed. That widened a tenant
again, or failed with "tuple concurrently updated". pg_lease_compile_key_scope now compiles one at
a time, holding SHARE UPDATE EXCLUSIVE on the scope table, from the table as committed. It refuses
with 0A000 a transaction that reads as of its start: REPEATABLE READ, SERIALIZABLE.

Changed: function pg_lease_compile_key_scope(). Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0008_hot_path")]

    operations = [
        RunSQLFile(
            "migrations/0009_scopes_compiled_as_committed.sql",
            "migrations/0009_scopes_compiled_as_committed_reverse.sql",
            sha256="ccfd5d1c187daf7f64ad0cd42b8446ccd6ed02f7287f7ab4baf27f45770c5b17",
            reverse_sha256="b4b4ad94c025ce42b73f703287524eafb301c0e3284659dbc0f63645db9e2e43",
        )
    ]
