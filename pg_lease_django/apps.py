from django.apps import AppConfig


class PgLeaseConfig(AppConfig):
    """Registers the system checks; nothing else happens at start-up."""

    name = "pg_lease_django"
    verbose_name = "Leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks

        checks.register()
