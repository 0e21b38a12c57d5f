"""The development settings on a real PostgreSQL (DATABASE_URL, else the embedded server, started
here): the Django set-up of the stress tool's processes."""

from devkit.dbserver import database_settings
from devkit.settings_common import *  # noqa: F403
from devkit.settings_common import databases

DATABASES = databases(database_settings())
