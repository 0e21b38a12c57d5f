"""Key scopes per role, and the database role in the history: ``sql/migrations/0004_key_scopes.sql``.

A role listed in ``PG_LEASE_KEY_SCOPES`` may name only keys starting with its prefixes, in every
lease function (the database checks it); each tenure records the database role that ended it.
"""

from django.db import migrations, models

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0003_least_privilege")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                RunSQLFile(
                    "migrations/0004_key_scopes.sql",
                    "migrations/0004_key_scopes_reverse.sql",
                    sha256="e17d6e4417ef5ba814fb52826c1555893432c61da17bff3383ea71a7be877053",
                    reverse_sha256="7d9f9aa417d1096306dd030b8ad8082b23bc678528a2d04c7db3f9da04688380",
                )
            ],
            state_operations=[
                migrations.AddField(
                    model_name="leasetenure",
                    name="ended_by_role",
                    field=models.TextField(blank=True, null=True),
                ),
            ],
        ),
    ]
