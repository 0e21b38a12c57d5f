"""A health check for load balancers and Kubernetes probes: the lease functions, and this process's holds.

Add it to your URLconf::

    from pg_lease_django.views import health

    urlpatterns += [path("health/leases/", health)]

``GET`` answers JSON, 200 when the lease database answers a lease call (its table and functions
are there and reachable), 503 otherwise. It also lists the leases this process holds now
(``hold()``, ``@leased``, ``elect()``), each with its key, owner, epoch, server expiry and whether it
is lost: a process whose job lost its lease is reported, not failed (the job itself stops; a
restart would not give the lease back). The check is one read-only statement (``inspect`` of a key
of its own): it writes nothing and takes no lock.
"""

from __future__ import annotations

from django.db import DatabaseError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from .holds.scheduler import active_holds

#: The key the check inspects: never acquired by anyone, so the answer costs one index lookup.
PROBE_KEY = "pg_lease_django:health"


@never_cache
@require_GET
def health(request: HttpRequest) -> JsonResponse:
    """The lease database's answer and this process's holds, as JSON; 503 when the database does not answer."""
    from django.core.exceptions import ImproperlyConfigured

    from .models import Lease

    holds = [
        {
            "key": lease.key,
            "owner": lease.owner,
            "epoch": lease.epoch,
            "expires_at": lease.expires_at.isoformat(),
            "lost": lease.lost,
        }
        for lease in sorted(active_holds(), key=lambda lease: (lease.key, lease.epoch))
    ]
    try:
        state = Lease.objects.inspect(PROBE_KEY)
    except (DatabaseError, ImproperlyConfigured) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return JsonResponse({"status": "error", "database": first_line, "holds": holds}, status=503)
    return JsonResponse({"status": "ok", "server_time": state.server_time.isoformat(), "holds": holds})
