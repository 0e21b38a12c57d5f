"""A process for tests/db/test_jobs.py: a ``@leased(..., on_busy="exit")`` job, as cron or a systemd timer runs it.

    python -m tests.children.leased_child FORM KEY MARKER [WAIT]

``DATABASE_URL`` must point at the test database. The job creates MARKER (proof that it ran). Forms:

- ``command``: a management command whose ``handle()`` is decorated, run as ``manage.py`` runs one
  (``run_from_argv``), the key one of its arguments.
- ``main``: a script's ``main()``, decorated.

With WAIT, the job waits up to WAIT seconds for the lease (``blocking=True, timeout=WAIT``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import django


def main() -> None:
    form, key, marker, *wait = sys.argv[1:]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.core.management.base import BaseCommand, CommandParser

    from pg_lease_django import leased

    timeout = float(wait[0]) if wait else None
    blocking = timeout is not None

    if form == "command":

        class Command(BaseCommand):
            def add_arguments(self, parser: CommandParser) -> None:
                parser.add_argument("key")
                parser.add_argument("marker")

            @leased(lambda self, **options: options["key"], ttl=30, blocking=blocking, timeout=timeout, on_busy="exit")
            def handle(self, *args: Any, **options: Any) -> None:
                Path(options["marker"]).touch()

        Command().run_from_argv(["manage.py", "report", key, marker])
    elif form == "main":

        @leased(key, ttl=30, blocking=blocking, timeout=timeout, on_busy="exit")
        def job() -> None:
            Path(marker).touch()

        job()
    else:
        raise SystemExit(f"unknown form {form!r}")


if __name__ == "__main__":
    main()
