"""``manage.py leases``: see who holds what, and break a stuck lease safely.

Subcommands:

- ``list``, the default, and ``show KEY``.
- ``watch``: a live view, from `management.leases.live_view`.
- ``release KEY --force [--operator NAME]``.
- ``handoff KEY``: ask the holder to step down at its next renewal.
- ``history KEY``: the recorded tenures of a key, from `pg_lease_django.timeline`.
- ``prune-history [--older-than 30d]``.
- ``prune --free-for 30d``: delete rows of leases free that long; epochs never go back.
- ``advance-epochs --by N``: after a failover to a standby that may have missed lease writes, raise
  every epoch and the epoch floor by N, fencing current holders.
- ``grant [--check]``: the declared roles' lease privileges, as ``migrate`` grants them.
- ``run KEY --ttl SECONDS -- COMMAND``: run a command while holding a lease, the way ``flock``
  does on one machine, for a whole cluster; see `pg_lease_django.management.supervision`.

Every state shown is computed in SQL from the database server's clock with ``pg_lease_status``, the
rule the lease functions use, in one statement whatever the number of leases: `LeaseQuerySet.listing`.

This module dispatches. The arguments are declared in `pg_lease_django.management.leases.arguments`,
and each group of subcommands is a module there: `reading`, `operating` and `running`. Reading is
`LeaseQuerySet`'s, and watching ``run``'s COMMAND is `Supervisor`'s. The exit-code tables below are
generated from `ExitCode`, like the help texts, and docs/operations.md repeats them.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError, router

from pg_lease_django import seats
from pg_lease_django.display import printable
from pg_lease_django.exceptions import InvalidInputError
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.leases.arguments import declare
from pg_lease_django.management.leases.common import database
from pg_lease_django.management.leases.operating import OperatingSubcommands
from pg_lease_django.management.leases.reading import ReadingSubcommands
from pg_lease_django.management.leases.running import RunSubcommand
from pg_lease_django.models import Lease
from pg_lease_django.sql import errors

__doc__ = f"""{__doc__ or ""}
Exit codes:

{ExitCode.table(run=False)}

``run`` exits with its COMMAND's status (128 + N when a signal N killed it, as a shell reports
it), or with one of these, kept clear of 0-6 above and of the shell's 126, 127 and 128 + N:

{ExitCode.table(run=True)}
"""


class Command(ReadingSubcommands, OperatingSubcommands, RunSubcommand):
    """``manage.py leases [list|show|watch|history|handoff|release|prune|prune-history|advance-epochs|grant|run] ...``:
    the operators' view of the lease table."""

    help = (
        "Inspect leases, break stuck ones, run a command under a lease. Subcommands: list (default), "
        "show KEY, watch [--prefix P | --glob G], history KEY, handoff KEY, release KEY --force, "
        "prune --free-for AGE, prune-history, "
        "advance-epochs --by N, grant [--check], run KEY --ttl SECONDS -- COMMAND. "
        f"Exit codes: {ExitCode.summary(run=False)}; run: COMMAND's status, {ExitCode.summary(run=True)}."
    )
    # An operator's tool, also for incidents: no other app's system-check error may stop it, and its
    # own preconditions (a PostgreSQL database, a migrated one) are each reported in one line.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        """Declare the subcommands; ``--database`` and ``--no-color`` are accepted before or after them."""
        declare(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the subcommand; every failure becomes a one-line `CommandError` with its exit code."""
        alias = database(options["database"] or router.db_for_write(Lease))
        subcommand = options.get("subcommand") or "list"
        try:
            if subcommand in ("show", "inspect"):
                self._show(alias, options)
            elif subcommand == "history":
                self._history(alias, options)
            elif subcommand == "handoff":
                self._handoff(alias, options)
            elif subcommand == "release":
                self._release(alias, options)
            elif subcommand == "prune":
                self._prune(alias, options)
            elif subcommand == "prune-history":
                self._prune_history(alias, options)
            elif subcommand == "advance-epochs":
                self._advance_epochs(alias, options)
            elif subcommand == "grant":
                self._grant(alias, options)
            elif subcommand == "watch":
                self._watch(alias, options)
            elif subcommand == "run":
                self._run(alias, options)
            else:
                self._list(alias, options)
        except InvalidInputError as exc:
            raise CommandError(str(exc), returncode=ExitCode.USAGE) from None
        except ImproperlyConfigured as exc:  # e.g. no lease table: the message names the migrate command
            # Escaped: it may name roles or schemas as the catalog spells them (`privileges.grant_privileges`).
            raise CommandError(f"database error: {printable(str(exc))}", returncode=ExitCode.DATABASE_ERROR) from None
        except DatabaseError as exc:
            # The server's text may quote a key or an owner (a RAISE of a lease function): other
            # roles' data, shown escaped like them.
            first_line = printable(str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
            if errors.sqlstate(exc) == "42P01":  # undefined_table: not migrated (that far)
                first_line += f"; run `manage.py migrate pg_lease_django --database {alias}`"
            elif seats.denied(exc):  # the wrong seat: name the one to use
                first_line += f"; {seats.remedy(alias, subcommand)}"
            raise CommandError(f"database error: {first_line}", returncode=ExitCode.DATABASE_ERROR) from None
