"""Minimal settings for the demo: DATABASE_URL, else the embedded PostgreSQL."""

from devkit.dbserver import database_settings

SECRET_KEY = "demo-only"
USE_TZ = True
TIME_ZONE = "UTC"
DATABASES = {"default": database_settings()}
INSTALLED_APPS = ["pg_lease_django", "demo"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Record the demo lease's tenures (the history chart and `leases history`); migrate copies this into the database.
PG_LEASE_HISTORY = ["demo:"]
