"""Tenants apart for real, and the monitoring view: ``sql/migrations/0007_tenants_apart.sql``.

Key scopes follow role membership and fail closed (compiled from the scope table); input is judged
before the scope; an opt-out is minted only for a role the session may act as, by the owner's
grant; every trigger fires ALWAYS; row-level security on the secret, the scopes and the limits;
per-role limits on lease rows and kept tenures; ``pg_lease_metrics`` for monitoring roles.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0006_triggers_without_when")]

    operations = [
        RunSQLFile(
            "migrations/0007_tenants_apart.sql",
            "migrations/0007_tenants_apart_reverse.sql",
            sha256="3fba2c9eca35e617002c489143f4b844401cf5b95429a3573652a46782c4c361",
            reverse_sha256="502257675eb99a7379be5a7f21cc752b4878aaceb770dd664f0fa930d3888ebb",
        )
    ]
