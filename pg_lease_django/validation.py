"""Input rules, checked in Python before any SQL is sent (the SQL functions check them again)."""

from __future__ import annotations

import math
from datetime import timedelta

from .exceptions import InvalidInputError

#: Longest key or owner identity, in UTF-8 bytes (also a CHECK constraint on the table).
MAX_NAME_BYTES = 255
#: Shortest TTL accepted. Anything shorter lapses before the statement that grants it returns.
MIN_TTL = timedelta(milliseconds=1)
#: Longest TTL accepted. A lease is meant to be renewed; a longer bound is a bug, not a lease.
MAX_TTL = timedelta(days=365)
_MIN_TTL_SECONDS, _MAX_TTL_SECONDS = MIN_TTL.total_seconds(), MAX_TTL.total_seconds()
#: Largest epoch PostgreSQL's bigint can hold.
MAX_EPOCH = 2**63 - 1
#: Longest wait accepted by a blocking acquire (the SQL function's own bound is only "not negative").
MAX_WAIT = timedelta(days=365)
#: Longest ``free_for`` accepted by `LeaseManager.prune`.
MAX_PRUNE_AGE = timedelta(days=3650)
#: Largest advance of `LeaseManager.advance_epochs`, and the highest epoch it may leave: 2**62 more
#: grants per key stay possible before bigint overflows (``pg_lease_advance_epochs`` checks the same).
MAX_ADVANCE = 2**62

Seconds = int | float | timedelta


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a usable key or owner identity, else raise InvalidInputError.

    Any non-empty text without NUL of at most `MAX_NAME_BYTES` bytes, as the spec says: characters a
    terminal would obey are escaped where a person reads them (`pg_lease_django.display`), never refused.
    """
    if not isinstance(value, str):
        raise InvalidInputError(f"{kind} must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidInputError(f"{kind} must not be empty")
    if "\x00" in value:
        raise InvalidInputError(f"{kind} must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{kind} is not valid Unicode text: {exc.reason}") from None
    if size > MAX_NAME_BYTES:
        raise InvalidInputError(f"{kind} is {size} bytes long; the limit is {MAX_NAME_BYTES} (UTF-8)")
    return value


def to_timedelta(kind: str, value: object, *, minimum: timedelta, maximum: timedelta) -> timedelta:
    """Convert seconds or a timedelta to a timedelta within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise InvalidInputError(f"{kind} must be a number of seconds or a timedelta, not {type(value).__name__}")
    if isinstance(value, timedelta):
        delta = value
    else:
        if not math.isfinite(value) or not -1e12 < value < 1e12:  # beyond what timedelta holds: say the range
            if math.isnan(value):
                raise InvalidInputError(f"{kind} must be a number of seconds, got {value!r}")
            raise InvalidInputError(
                f"{kind} must be between {describe_seconds(minimum)} and {describe_seconds(maximum)}, got {value!r} s"
            )
        delta = timedelta(seconds=value)
    if not minimum <= delta <= maximum:
        raise InvalidInputError(
            f"{kind} must be between {describe_seconds(minimum)} and {describe_seconds(maximum)}, "
            f"got {describe_seconds(delta)}"
        )
    return delta


def describe_seconds(delta: timedelta) -> str:
    """A duration as a person reads it in an error: ``0.001 s``, ``-1 s``, ``90 s``, ``365 days``."""
    seconds = delta.total_seconds()
    if abs(seconds) >= 86400 and seconds % 86400 == 0:
        days = int(seconds // 86400)
        return f"{days} day" if days in (1, -1) else f"{days} days"
    return f"{seconds:.6f}".rstrip("0").rstrip(".") + " s"


def check_ttl(value: object) -> timedelta:
    """Return the TTL as a timedelta, or raise InvalidInputError.

    Seconds in range, what nearly every call passes, are converted at once: a lease call checks its
    TTL every time. Anything else, a NaN included (it fails the comparison), takes `to_timedelta`.
    """
    if (type(value) is int or type(value) is float) and _MIN_TTL_SECONDS <= value <= _MAX_TTL_SECONDS:
        return timedelta(seconds=value)
    return to_timedelta("ttl", value, minimum=MIN_TTL, maximum=MAX_TTL)


def check_wait(
    blocking: object, timeout: object, *, key: str | None = None, owner: str | None = None
) -> timedelta | None:
    """The longest wait of an acquire (None: no bound, or not blocking), or InvalidInputError.

    One rule for ``LeaseManager.acquire`` and ``hold()``; ``key`` and ``owner`` only label the error.
    """
    if not isinstance(blocking, bool):
        raise InvalidInputError(f"blocking must be a bool, not {type(blocking).__name__}", key=key, owner=owner)
    if timeout is not None and not blocking:
        raise InvalidInputError("timeout only applies with blocking=True", key=key, owner=owner)
    return None if timeout is None else to_timedelta("timeout", timeout, minimum=timedelta(0), maximum=MAX_WAIT)


def check_epoch(value: object) -> int:
    """Return ``value`` if it can be a granted epoch (an int from 1 up), else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"epoch must be an int, not {type(value).__name__}")
    if not 1 <= value <= MAX_EPOCH:
        raise InvalidInputError(f"epoch must be between 1 and {MAX_EPOCH}, got {value}")
    return value


def check_advance(by: object) -> int:
    """Return ``by`` if it is a usable epoch advance (1 to `MAX_ADVANCE`), else raise InvalidInputError."""
    if isinstance(by, bool) or not isinstance(by, int):
        raise InvalidInputError(f"by must be an int, not {type(by).__name__}")
    if not 1 <= by <= MAX_ADVANCE:
        raise InvalidInputError(f"by must be between 1 and {MAX_ADVANCE}, got {by}")
    return by
