"""The exit codes of ``manage.py leases``: `ExitCode`.

Written here once: the command's help, its docstring and ``run``'s description are generated from
`ExitCode`. Every subcommand exits with them, and so does ``leases run``, whose `RunError` in
`pg_lease_django.management.supervision` carries one. A job skipped by
``@leased(..., on_busy="exit")`` exits with ``BUSY`` or ``TIMED_OUT``. A leaf: it imports nothing of
the package.
"""

from __future__ import annotations

import textwrap
from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """The exit codes of ``manage.py leases``, each with a label for ``--help`` and a meaning for the docs.

    ``run`` otherwise exits with COMMAND's status, 128 + N when signal N killed it, as a shell
    reports it. Its own codes are kept clear of 0-6 and of the shell's 126, 127 and 128 + N. 75 is
    sysexits' EX_TEMPFAIL, "try again later", which is what a caller should do when busy; 76 and 77
    are the next two. 126 and 127 mean what they mean in a shell.
    """

    label: str
    meaning: str

    def __new__(cls, value: int, label: str, meaning: str) -> ExitCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.label = label
        member.meaning = meaning
        return member

    OK = 0, "ok", "success"
    DATABASE_ERROR = 1, "database error", "database error (the message says which)"
    USAGE = (
        2,
        "bad arguments",
        "bad arguments: unknown option, bad key, epoch or limit, unknown or non-PostgreSQL database; "
        "``advance-epochs --by`` that would raise an epoch past the limit (nothing changed)",
    )
    NOT_FOUND = 3, "no such lease", "no such lease: the key was never acquired"
    NOT_FORCED = 4, "release without --force", "``release`` refused: ``--force`` not given"
    MOVED_ON = (
        5,
        "lease moved on",
        "``release`` or ``handoff`` refused: the lease moved on (``--epoch`` is not the current epoch, or it "
        "changed hands while being released)",
    )
    ALREADY_FREE = (
        6,
        "already free",
        "``release``: nothing to release, the lease is already free; ``handoff``: nobody holds it (free or lapsed)",
    )
    BUSY = 75, "busy", "busy: the lease is held by another owner; COMMAND was not run"
    LOST = (
        76,
        "lease lost",
        "lost: the lease was lost while COMMAND ran (it was sent SIGTERM, then SIGKILL after ``--grace``), "
        "or at its end the lease turned out to have moved on",
    )
    TIMED_OUT = (
        77,
        "timed out waiting",
        "timed out: ``--wait`` passed and the lease was still held; COMMAND was not run",
    )
    CANNOT_EXECUTE = 126, "cannot execute", "COMMAND could not be executed (permission denied, not an executable)"
    COMMAND_NOT_FOUND = 127, "not found", "COMMAND was not found"

    @classmethod
    def of(cls, *, run: bool) -> list[ExitCode]:
        """The codes of every subcommand (``run=False``), or those only ``run`` exits with."""
        return [code for code in cls if (code >= cls.BUSY) == run]

    @classmethod
    def summary(cls, *, run: bool) -> str:
        """``0 ok, 1 database error, ...``: the codes and their labels on one line."""
        return ", ".join(f"{code.value} {code.label}" for code in cls.of(run=run))

    @classmethod
    def table(cls, *, run: bool, width: int = 90) -> str:
        """The codes and their meanings as a reStructuredText table, for a docstring."""
        codes = cls.of(run=run)
        digits = max(len(str(code.value)) for code in codes)
        rule = f"{'=' * digits}  {'=' * width}"
        lines = [rule]
        for code in codes:
            first, *more = textwrap.wrap(code.meaning, width)
            lines.append(f"{code.value:<{digits}}  {first}")
            lines += [f"{'':<{digits}}  {line}" for line in more]
        return "\n".join([*lines, rule])
