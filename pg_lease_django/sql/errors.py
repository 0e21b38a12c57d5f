"""Where the database's answer becomes the package's error: every map from SQLSTATE or verdict, in one place.

Each statement carries two maps, ``Statement.errors`` for SQLSTATEs and ``Statement.verdicts`` for
the verdicts a lease function answers with, such as renew's ``not_owner`` or force release's
``not_found``. Both executors apply them in one place each. The sync one, ``sql.run``, maps
Django's errors and the async one, ``sql.arun``, psycopg's. The decoders of ``sql.rows`` never see
a verdict that is an error.

Two refusals come from Django's own statements, which no executor of ours sends, so their callers
ask here: `fence_refusal` for a fenced write and `truncate_refusal` for a TRUNCATE. Everyone else
who asks what the server said reads `sqlstate`. This module is the one that unwraps Django's
``__cause__`` and psycopg's ``diag``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

from pg_lease_django.exceptions import (
    AlreadyFreeError,
    AlreadyLapsedError,
    EpochMismatchError,
    EpochMovedOnError,
    InvalidInputError,
    LapsedError,
    LeaseError,
    LeaseLostError,
    NeverAcquiredError,
    NotOwnerError,
    OperatorRefusalError,
    QuotaExceededError,
    UnfencedWriteError,
)

#: A statement's map: SQLSTATE -> the package's error for it, given the driver's error and, as
#: keywords, the parameters sent.
ErrorMap = Mapping[str, Callable[..., BaseException]]

#: How many causes deep `driver_error` looks: Django's wrapper, and a package error raised from it.
_DEPTH = 3


def driver_error(error: BaseException | None) -> psycopg.Error | None:
    """The psycopg error ``error`` is, or was raised from (Django's wrapper, a package error); None if none."""
    for _ in range(_DEPTH):
        if error is None or isinstance(error, psycopg.Error):
            return error
        error = error.__cause__
    return None


def sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE the server answered with for ``error`` (Django's or psycopg's), None for no answer."""
    found = driver_error(error)
    return None if found is None else found.sqlstate


def primary_message(error: BaseException) -> str:
    """The server's primary message for ``error``, without its DETAIL and HINT; else ``str(error)``."""
    found = driver_error(error)
    return (found.diag.message_primary if found is not None else None) or str(error)


def raise_mapped(error: BaseException, errors: ErrorMap, params: Mapping[str, Any]) -> None:
    """Raise the package's error for ``error`` if ``errors`` (a statement's map) names its SQLSTATE;
    ``params``: the parameters the statement was sent.

    Each executor calls this in its one ``except`` clause, then re-raises ``error`` as it is when it returns.
    """
    if not errors:
        return
    found = driver_error(error)
    mapped = errors.get((found.sqlstate or "") if found is not None else "")
    if mapped is not None and found is not None:
        raise mapped(found, **params) from error


# ---- the statements' maps ------------------------------------------------------------------------


def _quota(error: psycopg.Error, *, key: str, owner: str, **_: Any) -> QuotaExceededError:
    """53400 from an acquire: the key's tenant is at its ``PG_LEASE_ROLE_LIMITS``."""
    return QuotaExceededError(primary_message(error), key=key, owner=owner)


def _out_of_range(error: psycopg.Error, **_: Any) -> InvalidInputError:
    """22003 from an epoch advance: an epoch or the floor would pass the limit; the transaction changed nothing."""
    return InvalidInputError(f"{primary_message(error)}; nothing was changed")


#: An acquire's (``pg_lease_acquire``, ``pg_lease_acquire_or_register``).
ACQUIRE_ERRORS: ErrorMap = {QuotaExceededError.sqlstate: _quota}
#: An epoch advance's (``pg_lease_advance_epochs``).
ADVANCE_ERRORS: ErrorMap = {"22003": _out_of_range}


# ---- the row verdicts -----------------------------------------------------------------------------

#: The verdict of a lease function that did what it was asked. A statement with a verdict map answers
#: its verdict in its first column.
OK = "ok"

#: A statement's verdict map: a verdict other than `OK` -> the package's error for it. Each entry is
#: given the row and, as keywords, the parameters sent.
VerdictMap = Mapping[str, Callable[..., BaseException]]


def raise_verdict(row: Sequence[Any], verdicts: VerdictMap, params: Mapping[str, Any]) -> None:
    """Raise the package's error for ``row``'s verdict unless it is `OK`.

    ``verdicts`` is the statement's map and ``params`` the parameters it was sent. Each executor
    calls this in the one place it reads what a statement answered, before any decoder sees the row.
    """
    if row[0] != OK:
        raise verdicts[row[0]](row, **params)


#: A renew/release verdict from the SQL functions (``not_owner``, ...) -> the error raised for it.
LOST_ERRORS: dict[str, type[LeaseLostError]] = {
    cls.code: cls for cls in (NotOwnerError, LapsedError, EpochMismatchError)
}
#: An operator's verdict (force release, hand-off request) -> the error raised for it. The SQL says
#: ``free`` where the error's code says ``already_free``.
OPERATOR_ERRORS: dict[str, type[OperatorRefusalError]] = {
    "not_found": NeverAcquiredError,
    "free": AlreadyFreeError,
    "lapsed": AlreadyLapsedError,
    "epoch_mismatch": EpochMovedOnError,
}


class _Lost:
    """The `LeaseLostError` of a renew's or release's verdict, for the caller's ``owner`` and ``epoch``."""

    __slots__ = ("operation",)

    def __init__(self, operation: str) -> None:
        self.operation = operation

    def __call__(self, row: Sequence[Any], *, key: str, owner: str, epoch: int, **_: Any) -> LeaseLostError:
        outcome = row[0]
        return LOST_ERRORS[outcome](
            f"cannot {self.operation} {key!r} as {owner!r} at epoch {epoch}: {outcome}",
            key=key,
            owner=owner,
            epoch=epoch,
        )


class _Refused:
    """The `OperatorRefusalError` of an operator's call on a key that found nothing to act on.

    The parameter ``epoch`` is the epoch the operator named, or None for any. The row's second and
    third columns are the key's holder and epoch now. ``so`` says what follows for the call, such as
    "nothing to release".
    """

    __slots__ = ("so",)

    def __init__(self, so: str) -> None:
        self.so = so

    def __call__(self, row: Sequence[Any], *, key: str, epoch: int | None, **_: Any) -> OperatorRefusalError:
        outcome, holder, current = row[0], row[1], row[2]
        if outcome == "epoch_mismatch":
            message = f"lease {key!r} has moved on: its epoch is {current} (held by {holder!r}), not {epoch}"
        elif outcome == "not_found":
            message = f"no lease with key {key!r} (never acquired): {self.so}"
        elif outcome == "lapsed":
            message = f"lease {key!r} lapsed (holder {holder!r}, epoch {current}): {self.so}"
        else:
            message = f"lease {key!r} is already free (epoch {current}): {self.so}"
        return OPERATOR_ERRORS[outcome](message, key=key, epoch=epoch, holder=holder, current_epoch=current)


def _every(make: Callable[..., BaseException], verdicts: Mapping[str, object]) -> VerdictMap:
    return dict.fromkeys(verdicts, make)


#: A renewal's (``pg_lease_renew``).
RENEW_VERDICTS: VerdictMap = _every(_Lost("renew"), LOST_ERRORS)
#: A release's (``pg_lease_release``).
RELEASE_VERDICTS: VerdictMap = _every(_Lost("release"), LOST_ERRORS)
#: A force release's (``pg_lease_force_release``).
FORCE_RELEASE_VERDICTS: VerdictMap = _every(_Refused("nothing to release"), OPERATOR_ERRORS)
#: A hand-off request's (``pg_lease_request_handoff``).
HANDOFF_VERDICTS: VerdictMap = _every(_Refused("nobody holds it to hand it off"), OPERATOR_ERRORS)


# ---- refusals of Django's own statements --------------------------------------------------------

#: The SQLSTATE of a fenced write the triggers refused (``pg_lease_refuse``) -> the error raised for it.
REFUSED_WRITE_ERRORS: dict[str, type[LeaseError]] = {
    cls.sqlstate: cls for cls in (NotOwnerError, LapsedError, EpochMismatchError, UnfencedWriteError)
}


def fence_refusal(error: BaseException, action: str) -> LeaseError | None:
    """The typed error for a write the database refused by its fence (PL001-PL004), or None for any other.

    The server's DETAIL is the fence the writer presented, as JSON: the caller's ``key``, ``owner``
    and ``epoch``.
    """
    found = driver_error(error)
    kind = REFUSED_WRITE_ERRORS.get((found.sqlstate or "") if found is not None else "")
    if kind is None or found is None:
        return None
    try:
        fence = json.loads(found.diag.message_detail or "{}")
    except ValueError:
        fence = {}
    return kind(
        f"{action} refused: {found.diag.message_primary}",
        key=fence.get("key"),
        owner=fence.get("owner"),
        epoch=fence.get("epoch"),
    )


#: SQLSTATEs of the two refusals of a TRUNCATE: the lease table's guard (23001) and a fenced table's (PL004).
TRUNCATE_REFUSALS = frozenset({"23001", "PL004"})


def truncate_refusal(error: BaseException | None) -> str | None:
    """The database's message when ``error`` (or an exception it was raised from, or raised during) is
    the lease app's refusal of a TRUNCATE; else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        diag = getattr(error, "diag", None)
        primary = getattr(diag, "message_primary", None) or ""
        if getattr(diag, "sqlstate", None) in TRUNCATE_REFUSALS and "TRUNCATE" in primary:
            return primary
        error = error.__cause__ or error.__context__
    return None
