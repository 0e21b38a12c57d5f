"""The lease table's triggers cost nothing on the common path: ``sql/migrations/0002_...sql``.

The history triggers test a per-row flag, ``recorded`` (kept by the database from the history
scope), in their WHEN clauses; hand-off requests are cleared by a trigger whose WHEN clause is true
only while one is pending; the re-check under the row lock runs without a SET clause.
"""

from django.db import migrations, models

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0001_baseline")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                RunSQLFile(
                    "migrations/0002_triggers_off_the_common_path.sql",
                    "migrations/0002_triggers_off_the_common_path_reverse.sql",
                    sha256="84f6503f9d4319ea1505339dca65f8cc585934fcf69200224147a58b8a1f397e",
                    reverse_sha256="54dc36fc9ecbb95e9e3ab609b4f088072e4710844b73ac10b922fabef7b109d8",
                )
            ],
            state_operations=[
                migrations.AddField(
                    model_name="lease",
                    name="recorded",
                    field=models.BooleanField(db_default=False, editable=False),
                ),
            ],
        ),
    ]
