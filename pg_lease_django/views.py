"""Probes for load balancers and Kubernetes: `ready` for readiness and `live` for liveness.

Mount them in your URLconf; docs/deployment.md wires them as a Kubernetes pod's probes::

    from pg_lease_django.views import live, ready

    urlpatterns += [path("health/leases/ready/", ready), path("health/leases/live/", live)]

Both answer ``GET`` with JSON, ``HEAD`` with the same status and no body. An anonymous caller learns
``{"status": "ok"}`` or ``{"status": "unavailable"}`` and nothing else: no key, owner, epoch, host,
port or role. A fence is a credential, and the database's address an attacker's map. A user with
the ``pg_lease_django.view_lease`` permission also gets the details, and so does everyone with
``PG_LEASE_HEALTH_DETAILS = True``: the leases this process holds now and, when not ready, why.

- `ready` is readiness, "send me traffic". It answers 200 when the lease database answers, the app
  is migrated there to 0007 at least, and the role this process connects as may run every function
  a worker needs. When key scopes are configured, one must also apply to that role, else every
  call would be refused. It answers 503 otherwise, and 503 past ``PG_LEASE_READY_TIMEOUT``, 2 s by
  default, when the database does not answer. It runs one read-only catalog statement, with no
  write and no lock, on a thread and a connection of its own. The statement names no key, so no
  key scope is involved: it works for every tenant's role.
- `live` is liveness, "restart me". It answers 200 unless this process's lease machinery is
  wedged: holds are registered but their renewal thread is gone. It never looks at the database,
  so a database outage does not restart every pod at once.
"""

from __future__ import annotations

import threading
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from . import conf
from .holds.scheduler import active_holds, scheduler_stalled
from .sql import run, statements
from .sql.rows import Readiness

__all__ = ["health", "live", "ready"]

#: What an anonymous caller learns.
OK = {"status": "ok"}
UNAVAILABLE = {"status": "unavailable"}


@never_cache
@require_safe
def ready(request: HttpRequest) -> JsonResponse:
    """Readiness: 200 when this process's role can work with leases now, else 503."""
    reason = _not_ready()
    details = {"holds": _holds()} if reason is None else {"holds": _holds(), "reason": reason}
    return _answer(request, reason is None, details)


@never_cache
@require_safe
def live(request: HttpRequest) -> JsonResponse:
    """Liveness: 200 unless this process's holds lost their renewals' thread; never reads the database."""
    stalled = scheduler_stalled()
    details: dict[str, Any] = {"holds": _holds()}
    if stalled:
        details["reason"] = "the scheduler that renews this process's holds is not running"
    return _answer(request, not stalled, details)


#: The health view of 0.2: readiness (mount `ready` and `live` instead).
health = ready


# The readiness check running now, if any: at most one per process, however many probes come.
_checking: threading.Thread | None = None
_checking_lock = threading.Lock()


def _not_ready() -> str | None:
    """Why this process's role cannot work with leases now, or None; within ``PG_LEASE_READY_TIMEOUT``.

    The check runs on a thread of its own, on that thread's own connection. A database that does
    not answer, frozen or with packets dropped, cannot be cut short from the client. So the probe
    stops waiting for it at the bound and answers 503. The next probes answer 503 at once while it
    still hangs: there is one such thread per process, never one per probe.
    """
    global _checking
    timeout = conf.ready_timeout()
    answer: list[str | None] = []
    with _checking_lock:
        if _checking is not None and _checking.is_alive():
            return "the previous readiness check has not returned: the lease database does not answer"
        _checking = threading.Thread(target=lambda: answer.append(_check()), name="pg_lease ready", daemon=True)
        _checking.start()
        checking = _checking
    checking.join(timeout)
    if not answer:
        return f"the lease database did not answer within {timeout:g}s (PG_LEASE_READY_TIMEOUT)"
    return answer[0]


def _check() -> str | None:
    from .models import Lease

    alias = router.db_for_write(Lease)
    try:
        row = run.first(connections[alias], statements.READINESS)
    except (DatabaseError, ImproperlyConfigured) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    finally:
        connections.close_all()  # this thread's own, never left idle
    if row is None:
        row = Readiness(worker=False, scope=None, monitor=False)
    if not row.worker and row.monitor:
        return "this role is a monitor's (it reads the metrics, calls no lease function): probe its process with live"
    if not row.worker:
        return (
            "this role may not run every lease function a worker needs: declare it (or a group role it is a "
            "member of) in PG_LEASE_WORKER_ROLES, then run manage.py leases grant as the lease tables' owner"
        )
    if row.scope == []:
        return "key scopes are configured and none applies to this role: every lease call would be refused"
    return None


def _holds() -> list[dict[str, Any]]:
    return [
        {
            "key": lease.key,
            "owner": lease.owner,
            "epoch": lease.epoch,
            "expires_at": lease.expires_at.isoformat(),
            "lost": lease.lost,
        }
        for lease in sorted(active_holds(), key=lambda lease: (lease.key, lease.epoch))
    ]


def _answer(request: HttpRequest, ok: bool, details: dict[str, Any]) -> JsonResponse:
    body = dict(OK if ok else UNAVAILABLE)
    if conf.health_details() or _may_see_details(request):
        body.update(details)
    response = JsonResponse(body, status=200 if ok else 503)
    if request.method == "HEAD":
        response.content = b""  # the status is the answer; a body to HEAD is a protocol error servers log
    return response


def _may_see_details(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)  # no auth middleware: anonymous
    return bool(user is not None and user.is_authenticated and user.has_perm("pg_lease_django.view_lease"))
