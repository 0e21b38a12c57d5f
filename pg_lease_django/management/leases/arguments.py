"""The arguments of ``manage.py leases``: each subcommand's parser (`declare`), and `SubcommandParser`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from django.core.management.base import CommandParser

from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.management.supervision.supervisor import DEFAULT_GRACE
from pg_lease_django.status import LeaseStatus


class SubcommandParser(CommandParser):
    """The parser of each subcommand; ``run``'s also splits its argument list at the first ``--``.

    argparse cannot take "options, then ``--``, then a command line with options of its own": a
    ``REMAINDER`` positional swallows the options after KEY, a ``*`` one is matched empty before
    them. So ``run`` parses what precedes ``--`` itself and stores what follows, untouched, in
    ``command``. Arguments it does not know end up in ``unexpected`` (reported as one line) rather
    than in argparse's usage-and-exit error.
    """

    #: Set on the ``run`` subparser only.
    command_after_dashes = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse as argparse does; for ``run``, everything after the first ``--`` is COMMAND."""
        if not self.command_after_dashes or args is None:
            return super().parse_known_args(args, namespace)
        words = list(args)
        command: list[str] = []
        if "--" in words:
            split = words.index("--")
            words, command = words[:split], words[split + 1 :]
        parsed, unexpected = super().parse_known_args(words, namespace)
        parsed.command = command
        parsed.unexpected = unexpected
        return parsed, []


def declare(parser: CommandParser) -> None:
    """Declare the subcommands; ``--database`` and ``--no-color`` are accepted before or after them."""
    parser.add_argument(
        "--database",
        default=None,
        help="Database alias holding the leases (default: where DATABASE_ROUTERS send writes of leases).",
    )
    subparsers = parser.add_subparsers(
        dest="subcommand",
        title="subcommands",
        metavar="{list,show,watch,history,handoff,release,prune,prune-history,advance-epochs,grant,run}",
        parser_class=SubcommandParser,
    )

    list_parser = subparsers.add_parser("list", help="Table of leases, sorted by key (the default).")
    list_parser.add_argument(
        "--state", action="append", choices=LeaseStatus.values, help="Only leases in this state (repeatable)."
    )
    list_parser.add_argument("--prefix", help="Only keys starting with this text (uses the primary-key index).")
    list_parser.add_argument("--glob", help="Only keys matching this glob: * any text, ? one character.")
    list_parser.add_argument("--owner", help="Only leases held (or last held, if lapsed) by this owner.")
    list_parser.add_argument("--limit", help="Show at most this many leases (the count still covers all).")
    list_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    show_parser = subparsers.add_parser(
        "show", aliases=["inspect"], help="One lease in detail (alias: inspect, as Lease.objects.inspect())."
    )
    show_parser.add_argument("key", help="The lease key.")
    show_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    release_parser = subparsers.add_parser(
        "release", help="Force-release a lease: the epoch goes up and its holder is fenced."
    )
    release_parser.add_argument("key", help="The lease key.")
    release_parser.add_argument("--force", action="store_true", help="Required: this overrides the holder.")
    release_parser.add_argument("--epoch", help="Release only if this is still the current epoch.")
    release_parser.add_argument(
        "--operator", help="Who is releasing, recorded in the lease's history (default: your user@host)."
    )
    release_parser.add_argument("--dry-run", action="store_true", help="Say what would happen; change nothing.")
    release_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    history_parser = subparsers.add_parser(
        "history", help="The recorded tenures of a lease (keys named by PG_LEASE_HISTORY), oldest first."
    )
    history_parser.add_argument("key", help="The lease key.")
    history_parser.add_argument("--limit", help="Show only the newest this many tenures (the count covers all).")
    history_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    handoff_parser = subparsers.add_parser(
        "handoff", help="Ask the holder to step down at its next renewal (advice: the lease stays granted)."
    )
    handoff_parser.add_argument("key", help="The lease key.")
    handoff_parser.add_argument("--epoch", help="Ask only if this is still the current epoch.")
    handoff_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    prune_history_parser = subparsers.add_parser(
        "prune-history", help="Delete the recorded tenures that ended longer ago than --older-than."
    )
    prune_history_parser.add_argument(
        "--older-than",
        help="30d, 12h, 90m, 45s or seconds (default: PG_LEASE_HISTORY_RETENTION, 30 days).",
    )
    prune_history_parser.add_argument("--dry-run", action="store_true", help="Count what would go; change nothing.")
    prune_history_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    prune_parser = subparsers.add_parser(
        "prune",
        help="Delete the rows of leases free for at least --free-for; a key that comes back starts above its past.",
    )
    prune_parser.add_argument(
        "--free-for", required=True, help="How long a lease must have been free: 30d, 12h, 90m, 45s or seconds."
    )
    prune_parser.add_argument("--dry-run", action="store_true", help="List what would go; change nothing.")
    prune_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    advance_parser = subparsers.add_parser(
        "advance-epochs",
        help="After a failover that may have lost lease writes: raise every epoch and the epoch floor by --by "
        "(holders are fenced and must re-acquire).",
    )
    advance_parser.add_argument(
        "--by",
        required=True,
        help="How much to raise every epoch: more than the grants per key the lost primary could have made "
        "since the last replicated point (e.g. 1000000).",
    )
    advance_parser.add_argument("--dry-run", action="store_true", help="Say what would change; change nothing.")
    advance_parser.add_argument("--json", action="store_true", help="JSON for scripts (stable field names).")

    watch_parser = subparsers.add_parser(
        "watch", help="A live view of the leases matching --prefix or --glob, refreshed in place (Ctrl-C stops)."
    )
    watch_parser.add_argument("--prefix", help="Only keys starting with this text.")
    watch_parser.add_argument("--glob", help="Only keys matching this glob: * any text, ? one character.")
    watch_parser.add_argument("--limit", help="Show at most this many leases (default 50; the count covers all).")
    watch_parser.add_argument("--interval", help="Seconds between refreshes (default 1).")
    watch_parser.add_argument("--transitions", help="How many recent transitions to show (default 10; 0: none).")
    watch_parser.add_argument("--once", action="store_true", help="Show one frame and exit.")
    watch_parser.add_argument("--json", action="store_true", help="JSON for scripts: one document per frame.")
    watch_parser.add_argument("--plain", action="store_true", help="Plain text even when rich is installed.")

    grant_parser = subparsers.add_parser(
        "grant",
        help="Grant the roles of PG_LEASE_WORKER_ROLES and PG_LEASE_OPERATOR_ROLES their lease privileges "
        "(migrate does it too); run as the lease functions' owner.",
    )
    grant_parser.add_argument(
        "--check", action="store_true", help="Only say what is missing; exit 1 if anything is. Change nothing."
    )

    run_parser = subparsers.add_parser(
        "run",
        help="Run COMMAND while holding the lease KEY (renewed by heartbeats, released at the end).",
        usage=(
            "%(prog)s KEY --ttl SECONDS [--wait SECONDS | --campaign] [--owner ID] [--grace SECONDS] "
            "[--database ALIAS] -- COMMAND [ARGS ...]"
        ),
        description=(
            "Acquire KEY, run COMMAND with PG_LEASE_KEY, PG_LEASE_OWNER and PG_LEASE_EPOCH in its environment, "
            "renew the lease while it runs, release it when it ends. If the lease is lost, COMMAND gets SIGTERM, "
            "then SIGKILL after --grace seconds. SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to "
            "COMMAND; --grace after the first SIGTERM passed on, COMMAND gets SIGKILL too, then the lease is "
            f"released. Exit status: COMMAND's (128+N if signal N killed it); {ExitCode.summary(run=True)}."
        ),
    )
    assert isinstance(run_parser, SubcommandParser)
    run_parser.command_after_dashes = True
    run_parser.add_argument("key", help="The lease key.")
    run_parser.add_argument(
        "--ttl", help="Required. How long each grant and renewal lasts (30, 30s, 5m, 2h); renewed every TTL/3."
    )
    run_parser.add_argument(
        "--wait", help="Wait up to this long for the lease (30, 30s, 5m; default: don't wait; busy exits 75)."
    )
    run_parser.add_argument("--owner", help="Owner identity (default: host:pid:random, new for every run).")
    run_parser.add_argument(
        "--campaign",
        action="store_true",
        help="Keep COMMAND running on exactly one machine of many: campaign for KEY, run COMMAND while leading, "
        "campaign again when it exits or the lease is lost or handed off; until SIGTERM/SIGINT/SIGHUP.",
    )
    run_parser.add_argument(
        "--grace",
        help=(
            "Time COMMAND gets after a SIGTERM, sent because the lease was lost or passed on from a deploy's "
            f"stop, before SIGKILL (10, 10s, 1m; default: {DEFAULT_GRACE:g})."
        ),
    )

    # run: Django's -v/--verbosity after the subcommand too (2 reports the grant and the release on stderr).
    run_parser.add_argument(
        "-v", "--verbosity", type=int, choices=[0, 1, 2, 3], default=argparse.SUPPRESS, help="Verbosity level."
    )

    for sub in (
        list_parser,
        show_parser,
        history_parser,
        handoff_parser,
        release_parser,
        prune_parser,
        prune_history_parser,
        advance_parser,
        watch_parser,
        grant_parser,
        run_parser,
    ):
        # SUPPRESS: a subcommand that is not given these must not overwrite the top-level value.
        sub.add_argument("--database", default=argparse.SUPPRESS, help="Database alias holding the leases.")
        sub.add_argument("--no-color", action="store_true", default=argparse.SUPPRESS, help="Don't colorize.")
        sub.add_argument("--force-color", action="store_true", default=argparse.SUPPRESS, help="Force colors.")
