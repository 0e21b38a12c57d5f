"""The lease table's update rules without a WHEN clause to parse: ``sql/migrations/0006_triggers_without_when.sql``.

pg_lease_guard_update fires by a column list instead of a seven-condition WHEN clause (parsed and
compiled for every UPDATE statement); the renewal of a lapsed lease is judged by
pg_lease_judge_renewal, whose WHEN is one comparison. Every rule is kept, whoever writes.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0005_one_update_trigger")]

    operations = [
        RunSQLFile(
            "migrations/0006_triggers_without_when.sql",
            "migrations/0006_triggers_without_when_reverse.sql",
            sha256="c2b69649941451296a6920f71fbdaa005205f0aed751405cfb24ae6df6472311",
            reverse_sha256="38932b082eb096d3943d3a634d2704f2636ecf5c9b3db002ddae1ea2cd5ff60c",
        )
    ]
