from django.apps import AppConfig


class PgLeaseConfig(AppConfig):
    """The app: registers the system checks, the settings copied after ``migrate`` and the metrics.

    After ``migrate`` it copies ``PG_LEASE_HISTORY`` into the database, and grants the roles declared
    in ``PG_LEASE_WORKER_ROLES`` and ``PG_LEASE_OPERATOR_ROLES`` their privileges. With
    prometheus_client installed it registers the metrics, as docs/observability.md describes.
    """

    name = "pg_lease_django"
    verbose_name = "Leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from . import checks, conf
        from .metrics import hooks, push
        from .provisioning import history, privileges

        checks.register()
        checks.register_without_database_option()
        post_migrate.connect(
            history.sync_after_migrate, sender=self, dispatch_uid="pg_lease_django.provisioning.history"
        )
        post_migrate.connect(
            privileges.grant_privileges_after_migrate,
            sender=self,
            dispatch_uid="pg_lease_django.provisioning.privileges",
        )
        # Lazily: nothing of prometheus_client is imported unless it is installed and PG_LEASE_METRICS is on.
        # A bad PG_LEASE_METRICS_KEY_LABEL is reported by check pg_lease_django.E005, not here.
        hooks.install_tracing()  # spans where opentelemetry-api is installed
        if hooks.install_quietly():
            push.arm()  # at exit: pushed (PG_LEASE_METRICS_PUSHGATEWAY), or marked dead (multiprocess)
            if conf.metrics_database_view():
                from .metrics import database_view

                database_view.register()
