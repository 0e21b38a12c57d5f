"""``manage.py migrate``: Django's, with a refusal from the wrong seat named as such.

Migrating is the owner's seat, as docs/security.md explains. Run as a worker, an operator or the
monitor, Django's own command ends in a traceback over the first table the role may not read or
write, such as ``django_migrations``. This one ends in one line naming the role that owns the
tables. Overriding a core command from an app is Django's own mechanism, used by ``flush`` here
and by ``django.contrib.staticfiles`` for ``runserver``; every argument and behaviour is Django's.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError
from django.core.management.commands import migrate
from django.db import DatabaseError

from pg_lease_django import seats
from pg_lease_django.display import printable


class Command(migrate.Command):
    """Django's ``migrate``; a role that may not migrate is told which role may."""

    def handle(self, *args: Any, **options: Any) -> None:
        """Migrate as Django does; on "permission denied", a `CommandError` naming the owner's seat."""
        try:
            super().handle(*args, **options)
        except DatabaseError as exc:
            if not seats.denied(exc):
                raise
            first_line = printable(str(exc).strip().splitlines()[0])
            raise CommandError(f"{first_line}; {seats.remedy(options['database'], 'migrate')}") from exc
