"""Least privilege by default: ``sql/migrations/0003_least_privilege.sql``.

Every function that locks, reveals or changes a lease is revoked from PUBLIC. After ``migrate``, a
post_migrate receiver grants the roles declared in ``PG_LEASE_WORKER_ROLES`` and
``PG_LEASE_OPERATOR_ROLES`` what ``pg_lease_privileges()`` lists. The opt-out of
fencing becomes a token only ``pg_lease_allow_unfenced()`` mints; prune removes expired waiters'
registrations; the TRUNCATE refusals name the test runner and the pytest plugin.
"""

from django.db import migrations

from pg_lease_django.sql.files import RunSQLFile


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0002_triggers_off_the_common_path")]

    operations = [
        RunSQLFile(
            "migrations/0003_least_privilege.sql",
            "migrations/0003_least_privilege_reverse.sql",
            sha256="08761ccd38664369676c0c8508f6caa4a60135f38e0aff4966f8e7fd61547772",
            reverse_sha256="68c3a53637febf3faf94f502dd535a07980048ab89046ceb65e4040a64212f9b",
        )
    ]
