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
            sha256="6ceec73c5ac01c16007a2d8b7a2aa2a56ee530efb948c0ec3544c2d1004d6271",
        )
    ]
