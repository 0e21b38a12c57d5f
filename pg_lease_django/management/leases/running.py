"""``manage.py leases run``: parse its arguments and hand COMMAND to a `Supervisor`.

With ``--campaign`` the supervisor is a `CampaignSupervisor`.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from pg_lease_django.exceptions import InvalidInputError
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.leases.common import (
    seconds,
)
from pg_lease_django.management.supervision.campaign import CampaignSupervisor
from pg_lease_django.management.supervision.supervisor import DEFAULT_GRACE, RunError, Supervisor
from pg_lease_django.sql import run as executor
from pg_lease_django.validation import MAX_TTL, MAX_WAIT, MIN_TTL, check_name

RUN_USAGE = "leases run KEY --ttl SECONDS -- COMMAND [ARGS ...]"


class RunSubcommand(BaseCommand):
    """``manage.py leases run``: parse its arguments and hand COMMAND to `Supervisor`."""

    # -- run -----------------------------------------------------------------------------------------

    def _run(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        if options.get("ttl") is None:
            raise CommandError("--ttl is required: how many seconds each grant lasts", returncode=ExitCode.USAGE)
        ttl = seconds("--ttl", options["ttl"], MIN_TTL, MAX_TTL)
        wait = None if options.get("wait") is None else seconds("--wait", options["wait"], timedelta(0), MAX_WAIT)
        grace = DEFAULT_GRACE
        if options.get("grace") is not None:
            grace = seconds("--grace", options["grace"], timedelta(0), MAX_TTL)
        owner = options.get("owner")
        if owner is not None:
            check_name("owner", owner)
        unexpected: list[str] = options.get("unexpected") or []
        command: list[str] = options.get("command") or []
        if unexpected:
            raise CommandError(
                f"unexpected argument {unexpected[0]!r}: COMMAND goes after --, as in {RUN_USAGE}",
                returncode=ExitCode.USAGE,
            )
        if not command or not command[0]:
            raise CommandError(f"missing COMMAND: {RUN_USAGE}", returncode=ExitCode.USAGE)
        if threading.current_thread() is not threading.main_thread():
            raise CommandError(
                "leases run must be called from the main thread (it handles signals)", returncode=ExitCode.USAGE
            )
        # An unmigrated database in one line, before anything starts: a campaign would otherwise
        # retry its failing attempts until stopped (a configuration error is not a transient one).
        executor.schema(connections[alias])
        common: dict[str, Any] = {
            "ttl": ttl,
            "grace": grace,
            "owner": owner,
            "using": alias,
            "verbosity": options.get("verbosity", 1),
            "stdout": self.stdout,
            "stderr": self.stderr,
        }
        supervisor: Supervisor
        if options.get("campaign"):
            if wait:
                raise InvalidInputError("--campaign waits for the lease as long as it takes: leave out --wait")
            supervisor = CampaignSupervisor(key, command, **common)
        else:
            supervisor = Supervisor(key, command, wait=wait or None, **common)
        try:
            status = supervisor.run()
        except RunError as exc:
            raise CommandError(str(exc), returncode=exc.exit_code) from None
        if status:
            # Like Django's own `test` and `makemigrations --check`: the status is the whole message.
            raise SystemExit(status)
