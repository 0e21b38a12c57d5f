"""Settings for mypy's Django plugin (``[tool.django-stubs]`` in pyproject.toml): the test settings
with a database that nothing connects to.

The plugin imports its settings module and runs ``django.setup()`` in mypy's process, which ends
without running ``atexit`` hooks: ``tests.settings`` would start the embedded server there and leave
it running after every type check. A type check needs the apps and models, never a connection.
"""

from devkit.dbserver import database_settings
from devkit.settings_common import *  # noqa: F403
from devkit.settings_common import INSTALLED_APPS, databases

# As in tests.settings (importing that would start the server).
INSTALLED_APPS = [*INSTALLED_APPS, "tests.compatapp"]

# The discard port on loopback, where no server listens: a connection made by mistake fails at once
# rather than reaching a real server.
DATABASES = databases(database_settings("postgresql://postgres@127.0.0.1:9/pg_lease_typecheck"))
