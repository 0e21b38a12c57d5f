"""Metrics rule of the database: ``sql/migrations/0010_metrics_rule_of_the_database.sql``.

The monitor's function took the separator and the label cap from its caller: one call per
character read back nearly every key of every tenant, which the monitor may not see (issue 51).
``pg_lease_metrics()`` now takes nothing: the rule is the owner's settings, copied into
``pg_lease_django_metrics_rule`` by ``migrate`` and ``leases grant``, and a key under a declared
scope prefix is labelled by that prefix (each tenant its own series).

New: table pg_lease_django_metrics_rule, function pg_lease_metrics_label(text, text[], text),
function pg_lease_metrics(). Changed: function pg_lease_privileges(). Dropped: function
pg_lease_metrics(text, integer, boolean). Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0009_scopes_compiled_as_committed")]

    operations = [
        RunSQLFile(
            "migrations/0010_metrics_rule_of_the_database.sql",
            "migrations/0010_metrics_rule_of_the_database_reverse.sql",
            sha256="fa6a8e910eb484a1685f72b919186af4096840a5c20f09ab0cc059f0cd51a102",
            reverse_sha256="8a0af6f0ac06d21691bb81b0bb067305b85bffab34f48bd1c77e71d8c7a2e64b",
        )
    ]
