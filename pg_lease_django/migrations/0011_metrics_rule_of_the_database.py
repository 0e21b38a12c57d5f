"""Metrics rule of the database: ``sql/migrations/0011_metrics_rule_of_the_database.sql``.

The monitor's function took the separator and the label cap from its caller: one call per
character read back nearly every key of every tenant, which the monitor may not see: issue 51.
``pg_lease_metrics()`` now takes nothing. The rule is the owner's settings, copied into
``pg_lease_django_metrics_rule`` by ``migrate`` and ``leases grant``. A key under a declared scope
prefix is labelled by that prefix, so each tenant has its own series.

New: table pg_lease_django_metrics_rule, function pg_lease_metrics_label(text, text[], text),
function pg_lease_metrics(). Changed: function pg_lease_privileges(). Dropped: function
pg_lease_metrics(text, integer, boolean). Written from ``sql/schema.sql`` by devkit.sqlchange.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0010_limits_locks_and_inputs_on_every_path")]

    operations = [
        RunSQLFile(
            "migrations/0011_metrics_rule_of_the_database.sql",
            "migrations/0011_metrics_rule_of_the_database_reverse.sql",
            sha256="8120b92d763d13e43af15af992b1c66f717ea59e5b4a30f7f535a5cb34331788",
            reverse_sha256="5a7414297d58787dd879005b01583fe9b2bc17e7db4354f0a4b3060eb8f8c4e7",
        )
    ]
