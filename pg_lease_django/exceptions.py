"""Every error the app raises. Each carries the lease it concerns and the spec's cause name."""

from __future__ import annotations

from datetime import datetime

from django.db.utils import OperationalError

__all__ = [
    "AlreadyFreeError",
    "AlreadyLapsedError",
    "EpochMismatchError",
    "EpochMovedOnError",
    "HeartbeatFailedError",
    "InvalidInputError",
    "LapsedError",
    "LeaseError",
    "LeaseLostError",
    "LeaseTimeoutError",
    "MissingRowError",
    "NeverAcquiredError",
    "NotAcquirableError",
    "NotOwnerError",
    "OperatorRefusalError",
    "OutcomeUnknownError",
    "QuotaExceededError",
    "UnconfirmedCommitError",
    "UnfencedWriteError",
]


class LeaseError(Exception):
    """Base of every lease error.

    The two sides of a call are kept apart on every error: ``owner`` and ``epoch`` are always the
    caller's (what it named or presented), ``holder`` and ``current_epoch`` always the key's, as
    the server saw it when it refused; None where not known or not sent.

    Attributes:
        code: the cause name from the spec (``not_owner``, ``lapsed``, ...).
        key: the lease the failed call was about.
        owner, epoch: the caller's identity and epoch, as the caller gave them.
        holder, current_epoch: who held the key and at which epoch, when the server said so.
    """

    code = "lease_error"

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        owner: str | None = None,
        epoch: int | None = None,
        holder: str | None = None,
        current_epoch: int | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.owner = owner
        self.epoch = epoch
        self.holder = holder
        self.current_epoch = current_epoch


class NotAcquirableError(LeaseError):
    """The key is held by another owner.

    Raised where a denial must be an exception (``hold()``); ``acquire()`` returns ``None`` instead.
    Recover by trying later (after ``expires_at`` at the latest) or waiting (``blocking=True``).

    Attributes:
        owner: the caller's identity, as for every error; the holder is ``holder``.
        holder, current_epoch, expires_at: who held the key when it was refused, at which epoch,
            and until when (server clock); None when unknown (``holder``: a lock it needed was busy).
    """

    code = "not_acquirable"

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        owner: str | None = None,
        epoch: int | None = None,
        holder: str | None = None,
        current_epoch: int | None = None,
        expires_at: datetime | None = None,
    ) -> None:
        super().__init__(message, key=key, owner=owner, epoch=epoch, holder=holder, current_epoch=current_epoch)
        self.expires_at = expires_at

    @property
    def holder_epoch(self) -> int | None:
        """The holder's epoch: ``current_epoch``, under its name before 1.0 (kept for old callers)."""
        return self.current_epoch


class LeaseTimeoutError(LeaseError):
    """A blocking acquire did not get the lease within its wait bound.

    Carries ``sqlstate = "57014"`` (query_canceled), the code the SQL-level blocking acquire raises.
    Nothing was acquired and no transaction or lock is left behind; retry or give up.
    """

    code = "timeout"
    sqlstate = "57014"


class LeaseLostError(LeaseError):
    """The caller does not hold the lease it named: stop acting on its behalf.

    Base of `NotOwnerError`, `LapsedError`, `EpochMismatchError` and `HeartbeatFailedError`. Any work
    guarded by the old epoch will be rejected; re-acquire (getting a new epoch) to continue. An
    operator's call that found nothing to act on is an `OperatorRefusalError` instead: the operator
    never held the lease, so there is nothing for it to stop.
    """


class NotOwnerError(LeaseLostError):
    """Renew/release by a caller that holds no live lease on the key.

    The key is unknown, free, or held by a different owner. Stop; re-acquire to continue.
    """

    code = "not_owner"
    sqlstate = "PL001"  # a fenced write the database refused for this cause


class LapsedError(LeaseLostError):
    """Renew/release by the most recent holder after its lease expired (server clock).

    Others may already have acquired the key. Stop; re-acquire (new epoch) to continue.
    """

    code = "lapsed"
    sqlstate = "PL002"  # a fenced write the database refused for this cause


class EpochMismatchError(LeaseLostError):
    """Renew/release with an epoch that is not the current one.

    The lease moved on (typically a self-takeover by a restarted worker with the same identity).
    Stop; the caller's epoch is fenced for good.
    """

    code = "epoch_mismatch"
    sqlstate = "PL003"  # a fenced write the database refused for this cause


class HeartbeatFailedError(LeaseLostError):
    """The heartbeat of a ``hold()`` crashed on something it did not expect: no more renewals.

    The hold counts its lease as lost at once (``lease.lost``, ``lease.check()``), though the server
    may still show it held; leaving the hold still releases it. The traceback is logged. Stop.
    """

    code = "heartbeat_failed"


class OperatorRefusalError(LeaseError):
    """An operator's call (``force_release()``, ``request_handoff()``) found nothing to act on.

    The operator never held the lease, so this is not a `LeaseLostError`: nothing changed, and the
    caller has nothing to stop. ``epoch`` is the epoch the operator named (None: any), ``holder``
    and ``current_epoch`` what the key has now. ``owner`` is None: an operator is not a lease owner.
    Read the key again (``inspect()``) and decide anew; retrying the same call will not help.
    """

    code = "operator_refused"


class NeverAcquiredError(OperatorRefusalError):
    """The key has no row: it was never acquired (or was pruned).

    Nothing changed. Check the key's spelling; there is nothing to release or ask.
    ``current_epoch`` is the epoch floor, where the key's first grant will start above.
    """

    code = "not_found"


class AlreadyFreeError(OperatorRefusalError):
    """The key is already free (released, or force-released by someone else).

    Nothing changed. ``current_epoch`` is the key's epoch now; there is nothing to release or ask.
    """

    code = "already_free"


class AlreadyLapsedError(OperatorRefusalError):
    """A hand-off request for a lease that has lapsed: its ``holder`` stopped renewing, nobody to ask.

    Nothing changed. The next acquire takes the key with a new epoch; a force release frees it now.
    """

    code = "lapsed"


class EpochMovedOnError(OperatorRefusalError):
    """The operator named an epoch (``epoch=``) that is not the key's current one.

    The lease moved on since the operator looked: ``holder`` and ``current_epoch`` say to what.
    Nothing changed; look again and decide whether to act on the new holder.
    """

    code = "epoch_mismatch"


class InvalidInputError(LeaseError, ValueError):
    """Bad argument: empty/over-long/NUL-containing key or owner, bad TTL, bad epoch, wrong type.

    Raised before any SQL is sent, so nothing changed. Fix the call; retrying will not help.
    """

    code = "invalid_input"


class UnfencedWriteError(LeaseError):
    """A write to a FencedModel named no lease to guard it.

    Raised before anything is sent. Pass ``fence=grant`` (querysets: ``.fenced(grant)``); a write
    that deliberately bypasses fencing (admin edit, data repair, fixtures) opts out explicitly with
    ``unfenced=True``, ``.unfenced()`` or ``with unfenced_writes():``.
    """

    code = "unfenced"
    sqlstate = "PL004"  # a fenced write the database refused for this cause


class QuotaExceededError(LeaseError):
    """An acquire of a brand-new key was refused: the key's tenant is at its ``PG_LEASE_ROLE_LIMITS`` limit.

    The database refused it (SQLSTATE ``53400``, configuration_limit_exceeded) because the lease rows
    under the prefixes of a role whose scope holds the key number ``leases`` already; nothing was
    written. Keys that have a row are unaffected. Release leases no longer used and prune them
    (``manage.py leases prune``), or raise the limit; retrying alone will not help.
    """

    code = "quota"
    sqlstate = "53400"


class MissingRowError(LeaseError):
    """A statement that always answers one row answered none.

    The lease functions the database runs are not the ones this version of the package was written
    for: a migration not applied, or another function of the same name answering first. Nothing
    was decided for the call. Run ``manage.py migrate pg_lease_django``; if the error stays, report
    it with the statement's name, which the message gives.
    """

    code = "missing_row"


class OutcomeUnknownError(OperationalError):
    """A lease call whose outcome nobody can know: it may or may not have taken effect on the server.

    The connection was lost while the call's statement was in flight, or the server committed but
    could not confirm the commit (`UnconfirmedCommitError`). A `django.db.OperationalError`
    subclass, because that is what it is: a database call that did not come back with an answer;
    code written for lost connections handles it already. Retry: an acquire again with the same
    owner (a self-takeover gets a new epoch and fences any grant you missed), a renew or a release
    again (a `NotOwnerError` or `EpochMismatchError` then means the first one went through).

    Attributes:
        code: ``"outcome_unknown"``.
        key: the lease the call was about, when known.
    """

    code = "outcome_unknown"

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class UnconfirmedCommitError(OutcomeUnknownError):
    """The server committed the lease write locally but could not confirm it reached the synchronous standby.

    PostgreSQL answers a commit whose wait for the synchronous standby was cancelled (a cancel
    request, ``pg_cancel_backend``) with *success* and a WARNING (SQLSTATE ``01000``, "canceling
    wait for synchronous replication ... might not have been replicated"). Such a write is on the
    primary only: a failover now may lose it. It is not an acknowledgement, so the call raises
    this instead of returning its result. An `OutcomeUnknownError` (so a `django.db.OperationalError`):
    treat it as any lost connection, an unknown outcome (the write may or may not survive); retry,
    or for a held lease count the renewal as unconfirmed (the heartbeat does).

    Raised by a call whose statement commits on its own (autocommit, the default outside
    ``transaction.atomic()``); for a call inside the caller's ``atomic()``, out of that block, after
    its COMMIT (an ``on_commit`` hook of the call checks it): the whole transaction's outcome is unknown.

    Attributes:
        code: ``"unconfirmed_commit"``.
        sqlstate, severity, notice, detail: the server's WARNING (``notice`` its primary message).
    """

    code = "unconfirmed_commit"
    sqlstate = "01000"

    def __init__(self, message: str, *, severity: str | None, notice: str | None, detail: str | None) -> None:
        super().__init__(message)
        self.severity = severity
        self.notice = notice
        self.detail = detail
