"""Settings of the whole-deployment test's processes (tests/cluster/test_deployment_whole.py).

The suite's settings (``tests.settings``), the database URL in ``DATABASE_URL`` (each process logs
in as the role it plays), and the lease settings of docs/security.md's multi-tenant set-up, which
the test passes as JSON in ``PG_LEASE_DEPLOYMENT_SETTINGS`` (the page's block, its names swapped
for the test's). The ``default`` alias is the database the test made; ``sqlite`` is there to be refused.
"""

import json
import os

from devkit.settings_common import INSTALLED_APPS as DEVKIT_APPS
from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES = {"default": DATABASES["default"], "sqlite": DATABASES["sqlite"]}
INSTALLED_APPS = DEVKIT_APPS  # not the suite's app of an old release (its W009 is no seat's to fix)
del PG_LEASE_METRICS_MAX_LABELS  # noqa: F821 (the suite's; the deployment keeps the default)
globals().update(json.loads(os.environ["PG_LEASE_DEPLOYMENT_SETTINGS"]))
