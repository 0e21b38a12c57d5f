"""What the subcommands of ``manage.py leases`` share: checking their arguments, and saying times."""

from __future__ import annotations

import getpass
import math
import os
import re
import socket
from datetime import UTC, datetime, timedelta

from django.core.management.base import CommandError
from django.db import connections

from pg_lease_django.management.exit_codes import ExitCode
from pg_lease_django.validation import MAX_EPOCH


def shown(iso: str | None) -> str:
    """A time for people: UTC, to the second (``2026-05-01 12:00:03Z``)."""
    return "-" if iso is None else f"{iso[:10]} {iso[11:19]}Z"


def database(alias: str) -> str:
    if alias not in connections:
        raise CommandError(f"unknown database alias {alias!r}", returncode=ExitCode.USAGE)
    vendor = connections[alias].vendor
    if vendor != "postgresql":
        raise CommandError(  # the words of operations.require_postgresql (check E001): the setting to change
            f"database {alias!r} is {vendor}, not PostgreSQL: pass --database with an alias whose ENGINE is "
            "'django.db.backends.postgresql', or route the pg_lease_django app to one (DATABASE_ROUTERS)",
            returncode=ExitCode.USAGE,
        )
    return alias


def positive_int(name: str, text: str | None, maximum: int = MAX_EPOCH) -> int | None:
    if text is None:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        raise CommandError(f"{name} must be a whole number, got {text!r}", returncode=ExitCode.USAGE) from None
    if not 1 <= value <= maximum:
        raise CommandError(f"{name} must be between 1 and {maximum}, got {value}", returncode=ExitCode.USAGE)
    return value


def pattern(name: str, text: str | None) -> str | None:
    if text is None:
        return None
    if not text or "\x00" in text:
        raise CommandError(f"{name} must be non-empty text without NUL characters", returncode=ExitCode.USAGE)
    return text


def not_found(key: str) -> str:
    """The message for a key with no row: never acquired, or pruned (``leases prune`` deletes rows)."""
    return f"no lease with key {key!r} (never acquired, or pruned)"


def iso(moment: datetime | None) -> str | None:
    """A server time as the stable JSON text: ISO 8601 in UTC, with microseconds (as `LeaseRow`'s)."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def os_operator() -> str:
    """Who runs the command, for the history of a forced release: ``user@host``."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
        user = f"uid-{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def seconds(name: str, text: str, minimum: timedelta, maximum: timedelta) -> float:
    """Parse a command-line duration within ``[minimum, maximum]``: seconds such as ``30`` or ``0.5``,
    or with a unit as ``--free-for`` takes them, such as ``30s``, ``1.5m``, ``2h`` or ``1d``."""
    match = _DURATION.fullmatch(text.strip())
    try:
        value = float(match["number"]) * _UNIT_SECONDS[match["unit"]] if match is not None else float(text)
    except ValueError:
        raise CommandError(
            f"{name} must be a number of seconds or a duration such as 30s, 5m or 2h, got {text!r}",
            returncode=ExitCode.USAGE,
        ) from None
    low, high = minimum.total_seconds(), maximum.total_seconds()
    if not math.isfinite(value) or not low <= value <= high:
        raise CommandError(
            f"{name} must be between {low:.15g} and {high:.15g} seconds, got {text!r}", returncode=ExitCode.USAGE
        )
    return value


_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(name: str, text: str) -> float:
    """Parse ``30d``, ``12h``, ``90m``, ``45s`` or plain seconds, up to ten years, into seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise CommandError(
            f"{name} must be a duration such as 30d, 12h, 90m or 45s, got {text!r}", returncode=ExitCode.USAGE
        )
    seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    if seconds > 3650 * 86400:
        raise CommandError(f"{name} must be at most 3650d, got {text!r}", returncode=ExitCode.USAGE)
    return seconds
