"""The lease table's update rules as one trigger: ``sql/migrations/0005_one_update_trigger.sql``.

One BEFORE UPDATE trigger with one small WHEN clause replaces five (PostgreSQL parses and compiles
each WHEN clause for every UPDATE statement); a cheaper key-scope check and waiter wake-up. Every
rule the five triggers enforced is kept, whoever writes.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0004_key_scopes")]

    operations = [
        RunSQLFile(
            "migrations/0005_one_update_trigger.sql",
            "migrations/0005_one_update_trigger_reverse.sql",
            sha256="b7a0b17351c52d64dd7694c6ca7152b0dbda29e18c1ef10f1cbb3059866aa37f",
            reverse_sha256="3d701bcc59e1b112d89143ac71b4e43e2dc70c33ee608d7db131074d33514e4e",
        )
    ]
