"""The subcommands that change leases: release, handoff, prune, prune-history, advance-epochs, grant.

Keys and owners in messages are quoted with ``!r`` (Python's escapes: a terminal shows them, never
obeys them); in lists, and role names, through `printable`. ``--json`` gives them as they are.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from pg_lease_django import conf
from pg_lease_django.display import LeaseRow, format_duration, json_text, printable
from pg_lease_django.exceptions import (
    AlreadyFreeError,
    AlreadyLapsedError,
    EpochMovedOnError,
    NeverAcquiredError,
)
from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.leases.common import (
    duration,
    iso,
    not_found,
    os_operator,
    positive_int,
)
from pg_lease_django.models import Lease, LeaseTenure
from pg_lease_django.provisioning import privileges
from pg_lease_django.status import LeaseStatus
from pg_lease_django.validation import MAX_ADVANCE, check_name


class OperatingSubcommands(BaseCommand):
    """The subcommands that change leases: release, handoff, prune, prune-history, advance-epochs, grant."""

    # -- release -------------------------------------------------------------------------------------

    def _release(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        expected = positive_int("--epoch", options.get("epoch"))
        operator = options.get("operator")
        operator = check_name("operator", os_operator() if operator is None else operator)
        manager = Lease.objects.db_manager(alias)
        row = manager.row(key)  # who holds it: for the report, --dry-run and the refusal without --force
        if row is None:  # nothing seen, nothing released: a key acquired since is not ours to break
            raise CommandError(not_found(key), returncode=ExitCode.NOT_FOUND)
        if options.get("dry_run") or not options.get("force"):
            self._release_not_forced(options, row, expected)
            return
        try:
            # The epoch we looked at, not "whatever is there now": we report who we released.
            new_epoch = manager.force_release(key, epoch=row.epoch if expected is None else expected, operator=operator)
        except NeverAcquiredError:  # pruned since we looked
            raise CommandError(not_found(key), returncode=ExitCode.NOT_FOUND) from None
        except AlreadyFreeError as exc:
            raise CommandError(str(exc), returncode=ExitCode.ALREADY_FREE) from None
        except EpochMovedOnError as exc:
            raise CommandError(f"{exc}; nothing released", returncode=ExitCode.MOVED_ON) from None
        self._report(options, row, new_epoch, dry_run=False)

    def _release_not_forced(self, options: dict[str, Any], row: LeaseRow, expected: int | None) -> None:
        """--dry-run, or the refusal without --force: what a release would do, judged from ``row``."""
        if row.state == LeaseStatus.FREE:
            raise CommandError(
                f"lease {row.key!r} is already free (epoch {row.epoch}): nothing to release",
                returncode=ExitCode.ALREADY_FREE,
            )
        holder = f"{row.state} by {row.owner!r}, expires {row.expiry}"
        if expected is not None and expected != row.epoch:
            raise CommandError(
                f"lease {row.key!r} has moved on: its epoch is {row.epoch} ({holder}), not {expected}; "
                "nothing released",
                returncode=ExitCode.MOVED_ON,
            )
        if options.get("dry_run"):
            self._report(options, row, row.epoch + 1, dry_run=True)
            return
        raise CommandError(
            f"refusing to release {row.key!r} (epoch {row.epoch}, {holder}) without --force",
            returncode=ExitCode.NOT_FORCED,
        )

    def _report(self, options: dict[str, Any], row: LeaseRow, new_epoch: int, *, dry_run: bool) -> None:
        if options.get("json"):
            document = {
                "key": row.key,
                "released": not dry_run,
                "dry_run": dry_run,
                "previous_owner": row.owner,
                "previous_state": row.state,
                "previous_epoch": row.epoch,
                "epoch": new_epoch,
            }
            self.stdout.write(json_text(document))
            return
        was = f"{row.state} by {row.owner!r} at epoch {row.epoch}"
        if dry_run:
            self.stdout.write(f"Dry run: would release {row.key!r} ({was}); its epoch would become {new_epoch}.")
        else:
            self.stdout.write(self.style.SUCCESS(f"Released {row.key!r} ({was}). New epoch: {new_epoch}"))

    def _handoff(self, alias: str, options: dict[str, Any]) -> None:
        key = check_name("key", options["key"])
        epoch = positive_int("--epoch", options.get("epoch"))
        try:
            done = Lease.objects.db_manager(alias).request_handoff(key, epoch=epoch)
        except NeverAcquiredError:
            raise CommandError(not_found(key), returncode=ExitCode.NOT_FOUND) from None
        except (AlreadyFreeError, AlreadyLapsedError) as exc:  # nobody holds it: nobody to ask
            raise CommandError(f"{exc}; nobody to hand off from", returncode=ExitCode.ALREADY_FREE) from None
        except EpochMovedOnError as exc:
            raise CommandError(f"{exc}; nothing requested", returncode=ExitCode.MOVED_ON) from None
        if options.get("json"):
            document = {
                "key": done.key,
                "owner": done.owner,
                "epoch": done.epoch,
                "expires_at": iso(done.expires_at),
                "requested_at": iso(done.requested_at),
                "server_time": iso(done.server_time),
            }
            self.stdout.write(json_text(document))
            return
        expires_in = format_duration(max(done.expires_at - done.server_time, timedelta(0)))
        self.stdout.write(
            self.style.SUCCESS(f"Hand-off requested from {done.owner!r} (epoch {done.epoch}) on {done.key!r}")
            + f": it learns at its next renewal and may step down; the lease stays held until then "
            f"(expires in {expires_in} unless renewed)."
        )

    def _prune_history(self, alias: str, options: dict[str, Any]) -> None:
        text = options.get("older_than")
        older_than = None if text is None else duration("--older-than", text)
        dry_run = bool(options.get("dry_run"))
        count = LeaseTenure.objects.db_manager(alias).prune(older_than=older_than, dry_run=dry_run)
        if older_than is None:
            older_than = conf.history_retention().total_seconds()
        if options.get("json"):
            document = {"dry_run": dry_run, "older_than_seconds": older_than, "tenures": count}
            self.stdout.write(json_text(document))
            return
        age = printable(text) if text else format_duration(timedelta(seconds=older_than))  # as typed, escaped
        if dry_run:
            self.stdout.write(f"Dry run: would delete {count} tenure(s) that ended more than {age} ago.")
        else:
            self.stdout.write(self.style.SUCCESS(f"Deleted {count} tenure(s) that ended more than {age} ago."))

    def _prune(self, alias: str, options: dict[str, Any]) -> None:
        free_for = duration("--free-for", options["free_for"])
        dry_run = bool(options.get("dry_run"))
        keys = Lease.objects.db_manager(alias).prune(free_for=free_for, dry_run=dry_run)
        if options.get("json"):
            self.stdout.write(json_text({"dry_run": dry_run, "free_for_seconds": free_for, "keys": keys}))
            return
        listing = "".join(f"\n  {printable(key)}" for key in keys)
        age = printable(options["free_for"])  # as typed, escaped
        if dry_run:
            self.stdout.write(f"Dry run: would prune {len(keys)} lease(s) free for at least {age}.{listing}")
        else:
            self.stdout.write(self.style.SUCCESS(f"Pruned {len(keys)} lease(s) free for at least {age}.") + listing)

    # -- grant -----------------------------------------------------------------------------------------

    def _grant(self, alias: str, options: dict[str, Any]) -> None:
        declared = privileges.declared()
        if options.get("check"):
            absent, lacking = privileges.missing(alias)
            extra = privileges.undeclared(alias)
            scopes_differ = privileges.stored_key_scopes(alias) not in (None, conf.key_scopes())
            # Role names come from the settings and the catalog: shown escaped, as keys are.
            for role in absent:
                self.stdout.write(f"role {printable(role)} does not exist")
            for needed in lacking:
                self.stdout.write(printable(needed.statement()))
            for held in extra:
                self.stdout.write(printable(f"{held.revoke()}  -- not declared"))
            if scopes_differ:
                self.stdout.write("the database's key scopes differ from PG_LEASE_KEY_SCOPES")
            if absent or lacking or extra or scopes_differ:
                # `leases grant` creates no role and revokes nothing: each finding gets the cure that works.
                cures = [f"run `manage.py leases grant --database {alias}`"] if lacking or scopes_differ else []
                cures += ["run the REVOKE lines above (or declare those roles)"] if extra else []
                cures += ["create the missing roles, then `manage.py leases grant`"] if absent else []
                raise CommandError(  # exit 1, as for any database state that stops the leases working
                    f"{len(absent)} declared role(s) missing, {len(lacking)} grant(s) missing, "
                    f"{len(extra)} undeclared grant(s){', key scopes differ' if scopes_differ else ''}: "
                    f"{'; '.join(cures)}, as the lease functions' owner",
                    returncode=ExitCode.DATABASE_ERROR,
                )
            self.stdout.write(f"Every declared role holds its lease privileges in {alias!r}.")
            return
        granted = privileges.grant_privileges(alias)
        for needed in granted:
            self.stdout.write(printable(needed.statement()))
        roles = ", ".join(f"{printable(role)} ({', '.join(kinds)})" for role, kinds in declared.items()) or (
            "none (PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES, PG_LEASE_MONITOR_ROLES): only the lease "
            "functions' owner may use them"
        )
        self.stdout.write(self.style.SUCCESS(f"Granted {len(granted)} privilege(s); declared roles: {roles}."))

    # -- advance-epochs ------------------------------------------------------------------------------

    def _advance_epochs(self, alias: str, options: dict[str, Any]) -> None:
        by = positive_int("--by", options["by"], maximum=MAX_ADVANCE)
        assert by is not None
        dry_run = bool(options.get("dry_run"))
        done = Lease.objects.db_manager(alias).advance_epochs(by=by, dry_run=dry_run)
        if options.get("json"):
            document = {
                "dry_run": done.dry_run,
                "by": done.by,
                "leases": done.leases,
                "held": done.held,
                "epoch_floor": done.epoch_floor,
                "max_epoch": done.max_epoch,
                "server_time": done.server_time.isoformat(),
            }
            self.stdout.write(json_text(document))
            return
        what = (
            f"{done.leases} lease(s) by {done.by} ({done.held} held: their holders are fenced and must re-acquire); "
            f"epoch floor {done.epoch_floor}, highest epoch {done.max_epoch}."
        )
        if dry_run:
            self.stdout.write(f"Dry run: would advance the epochs of {what}")
        else:
            self.stdout.write(self.style.SUCCESS(f"Advanced the epochs of {what}"))
