"""``manage.py flush``: Django's, with the lease app's refusal of TRUNCATE explained.

Lease rows and fenced rows are never deleted wholesale outside a test database: a TRUNCATE would
restart every epoch and un-fence every stale holder. So the database refuses the TRUNCATE that
``flush`` sends, and that ``TransactionTestCase`` and ``LiveServerTestCase`` tests send after each
test. Django's own command then says only "couldn't be flushed. Possible reasons: ..."; this one
names the refusal and the cure, which is the test runner or the pytest plugin. Overriding a core
command from an app is Django's own mechanism, which ``django.contrib.staticfiles`` uses for
``runserver``; every argument and behaviour is Django's.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError
from django.core.management.commands import flush
from django.db import connections

from pg_lease_django.sql.errors import truncate_refusal

TEST_SETUP = (
    'in tests, set TEST_RUNNER = "pg_lease_django.testing.LeaseTestRunner" (a runner of your own: subclass it), '
    "or run them with pytest-django, whose pg_lease_django plugin is on by default: either lets the test "
    "databases, and only them, be flushed (docs/testing.md)"
)


class Command(flush.Command):
    """Django's ``flush``; a TRUNCATE the lease app refused is reported as such."""

    def handle(self, **options: Any) -> None:
        """Flush as Django does; on the lease app's refusal, a `CommandError` that names it and the cure."""
        try:
            super().handle(**options)
        except CommandError as exc:
            refused = truncate_refusal(exc.__cause__)
            if refused is None:
                raise
            name = connections[options["database"]].settings_dict["NAME"]
            raise CommandError(
                f"Database {name} couldn't be flushed: pg_lease_django refused the TRUNCATE "
                f"({refused}). Lease rows and fenced rows are never deleted wholesale: epochs would start again "
                f"and stale holders' writes would be accepted. {TEST_SETUP[0].upper()}{TEST_SETUP[1:]}."
            ) from exc.__cause__
