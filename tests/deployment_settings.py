"""Settings of the whole-deployment test's processes (tests/test_deployment_whole.py).

The suite's settings (``tests.settings``), the database URL in ``DATABASE_URL`` (each process logs
in as the role it plays), and the lease settings of docs/security.md's multi-tenant set-up, which
the test passes as JSON in ``PG_LEASE_DEPLOYMENT_SETTINGS`` (the page's block, its names swapped
for the test's). Only the ``default`` alias: the deployment's database is the one the test made.
"""

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES = {"default": DATABASES["default"]}
globals().update(json.loads(os.environ["PG_LEASE_DEPLOYMENT_SETTINGS"]))
