"""The lease app's schema as of the 0.2 baseline: its tables, functions, triggers and privileges.

It replaces the ten migrations of the 0.1/0.2 development versions, 0001_initial to
0010_one_statement, which built the same schema step by step. A database that had applied all ten
applies nothing here and keeps what it has; tests/db/test_sql_source.py builds one each way and
compares the catalogs. The tables are the models', as Django's state below says. PostgreSQL gets
them from the SQL file, with the functions and triggers that guard them.

``sql/migrations/0001_baseline.sql`` is ``sql/schema.sql`` as it was then, frozen by its
``sha256``. The current schema is ``sql/schema.sql``, and each later migration runs a file of its
own.
"""

import django.db.models.lookups
from django.db import migrations, models

from pg_lease_django.sql.files import RunSQLFile


def octet_length(field: str) -> models.Func:
    return models.Func(models.F(field), function="octet_length", output_field=models.IntegerField())


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("pg_lease_django", "0001_initial"),
        ("pg_lease_django", "0002_fence"),
        ("pg_lease_django", "0003_force_release"),
        ("pg_lease_django", "0004_airtight"),
        ("pg_lease_django", "0005_prune"),
        ("pg_lease_django", "0006_notify_waiters"),
        ("pg_lease_django", "0007_advance_epochs"),
        ("pg_lease_django", "0008_cheap_refusal"),
        ("pg_lease_django", "0009_history_and_handoff"),
        ("pg_lease_django", "0010_one_statement"),
    ]

    dependencies = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                RunSQLFile(
                    "migrations/0001_baseline.sql",
                    "migrations/0001_baseline_reverse.sql",
                    sha256="acb1cedb56e3894c17447e70a4d87113a3581b9058be9961c4f3f5324918dd85",
                    reverse_sha256="25e8e7dfa900ed3c15fbf66c6356980ab71c6d5e6109ea0608085432f548a423",
                )
            ],
            state_operations=[
                migrations.CreateModel(
                    name="Lease",
                    fields=[
                        ("key", models.TextField(primary_key=True, serialize=False)),
                        ("owner", models.TextField(blank=True, null=True)),
                        ("epoch", models.BigIntegerField(default=0)),
                        ("acquired_at", models.DateTimeField(blank=True, null=True)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("released_at", models.DateTimeField(blank=True, null=True)),
                        ("handoff_requested_at", models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "pg_lease_django_lease",
                        "ordering": ["key"],
                        "permissions": [("force_release_lease", "Can force-release a lease")],
                        "constraints": [
                            models.CheckConstraint(
                                condition=django.db.models.lookups.Range(octet_length("key"), (1, 255)),
                                name="pg_lease_key_length",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(owner__isnull=True)
                                | models.Q(django.db.models.lookups.Range(octet_length("owner"), (1, 255))),
                                name="pg_lease_owner_length",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(epoch__gte=0), name="pg_lease_epoch_non_negative"
                            ),
                            models.CheckConstraint(
                                condition=models.Q(
                                    acquired_at__isnull=True, expires_at__isnull=True, owner__isnull=True
                                )
                                | models.Q(acquired_at__isnull=False, expires_at__isnull=False, owner__isnull=False),
                                name="pg_lease_held_fields_together",
                            ),
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="LeaseTenure",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("key", models.TextField()),
                        ("epoch", models.BigIntegerField()),
                        ("owner", models.TextField()),
                        ("granted_at", models.DateTimeField()),
                        ("ended_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "end_reason",
                            models.TextField(
                                blank=True,
                                choices=[
                                    ("released", "released by its holder"),
                                    ("handed_off", "handed off (released after a hand-off request)"),
                                    ("lapsed", "lapsed (then taken over, or pruned)"),
                                    ("reacquired", "re-acquired by its holder under a new epoch"),
                                    ("force_released", "force-released by an operator"),
                                    ("epochs_advanced", "fenced by an epoch advance"),
                                ],
                                null=True,
                            ),
                        ),
                        ("ended_by", models.TextField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "pg_lease_django_tenure",
                        "ordering": ["key", "epoch"],
                        "indexes": [models.Index(fields=["key", "epoch"], name="pg_lease_tenure_key_epoch")],
                    },
                ),
            ],
        ),
    ]
