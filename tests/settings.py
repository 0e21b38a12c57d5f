"""Settings for the test suite: the development settings (devkit.settings_common) and the suite's
own app, on a real PostgreSQL (DATABASE_URL, else the embedded server, started here)."""

import os

from devkit.dbserver import database_settings
from devkit.settings_common import *  # noqa: F403
from devkit.settings_common import INSTALLED_APPS, databases

# The app whose migrations are an old release's (test_compat.py, test_fencing_paths.py).
INSTALLED_APPS = [*INSTALLED_APPS, "tests.compatapp"]
DATABASES = databases(database_settings())

# Every test labels its keys with a prefix of its own, and a pytest-xdist worker runs hundreds of
# tests in one process: the cap on the metrics' labels (16 by default) would fold all but the first
# ones into "(other)". tests/db/test_metrics.py tests the cap with a setting of its own.
PG_LEASE_METRICS_MAX_LABELS = 1_000_000
# A child process of tests/db/test_metrics.py pushes its metrics to the test's receiver at exit.
PG_LEASE_METRICS_PUSHGATEWAY = os.environ.get("PG_LEASE_TEST_PUSHGATEWAY") or None
