"""Settings for the test suite: a real PostgreSQL (DATABASE_URL, else the embedded server, started here)."""

from tests.dbserver import database_settings
from tests.settings_common import *  # noqa: F403
from tests.settings_common import databases

DATABASES = databases(database_settings())
