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

    The two sides of a call are kept apart on every error. ``owner`` and ``epoch`` are always the
    caller's: what it named or presented. ``holder`` and ``current_epoch`` are always the key's, as
    the server saw it when it refused. Each is None where not known or not sent.

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

    Raised where a denial must be an exception, as in ``hold()``; ``acquire()`` returns ``None``
    instead. Recover by trying later, after ``expires_at`` at the latest, or by waiting with
    ``blocking=True``.

    Attributes:
        owner: the caller's identity, as for every error; the holder is ``holder``.
        holder, current_epoch, expires_at: who held the key when it was refused, at which epoch,
            and until when by the server clock. Each is None when unknown; ``holder`` is None when
            a lock the call needed was busy.
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

    Others may already have acquired the key. Stop; re-acquire to continue, with a new epoch.
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
    caller has nothing to stop. ``epoch`` is the epoch the operator named, or None for any.
    ``holder`` and ``current_epoch`` are what the key has now. ``owner`` is None: an operator is not
    a lease owner. Read the key again with ``inspect()`` and decide anew; retrying the same call
    will not help.
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

    Raised before anything is sent. Pass ``fence=grant``, or ``.fenced(grant)`` on a queryset. A
    write that deliberately bypasses fencing, such as an admin edit, a data repair or fixtures, opts
    out explicitly with ``unfenced=True``, ``.unfenced()`` or ``with unfenced_writes():``.
    """

    code = "unfenced"
    sqlstate = "PL004"  # a fenced write the database refused for this cause


class QuotaExceededError(LeaseError):
    """An acquire of a brand-new key was refused: the key's tenant is at its ``PG_LEASE_ROLE_LIMITS`` limit.

    The database refused it with SQLSTATE ``53400``, configuration_limit_exceeded. A role's scope
    holds the key, and the lease rows under that role's prefixes number ``leases`` already. Nothing
    was written. Keys that have a row are unaffected. Release leases no longer used and prune them
    with ``manage.py leases prune``, or raise the limit; retrying alone will not help.
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
    could not confirm the commit: see `UnconfirmedCommitError`. It is a `django.db.OperationalError`
    subclass, because that is what it is: a database call that did not come back with an answer.
    Code written for lost connections handles it already. Retry. Acquire again with the same owner:
    a self-takeover gets a new epoch and fences any grant you missed. Renew or release again: a
    `NotOwnerError` or `EpochMismatchError` then means the first one went through.

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

    A commit can wait for the synchronous standby, and a cancel request or ``pg_cancel_backend``
    can cancel that wait. PostgreSQL then answers the commit with *success* and a WARNING of
    SQLSTATE ``01000``: "canceling wait for synchronous replication ... might not have been
    replicated". Such a write is on the primary only: a failover now may lose it. It is not an
    acknowledgement, so the call raises this instead of returning its result. It is an
    `OutcomeUnknownError`, so a `django.db.OperationalError` too. Treat it as any lost connection:
    the outcome is unknown, and the write may or may not survive. Retry, or for a held lease count
    the renewal as unconfirmed, as the heartbeat does.

    A call whose statement commits on its own raises it at once. That is autocommit, the default
    outside ``transaction.atomic()``. A call inside the caller's ``atomic()`` raises it out of that
    block, after its COMMIT, where an ``on_commit`` hook of the call checks it. The whole
    transaction's outcome is then unknown.

    Attributes:
        code: ``"unconfirmed_commit"``.
        sqlstate, severity, notice, detail: the server's WARNING; ``notice`` is its primary message.
    """

    code = "unconfirmed_commit"
    sqlstate = "01000"

    def __init__(self, message: str, *, severity: str | None, notice: str | None, detail: str | None) -> None:
        super().__init__(message)
        self.severity = severity
        self.notice = notice
        self.detail = detail
