"""A tiny async Django site for tests/db/test_async.py: a view that waits for a lease, then lets it go.

Served by a real ASGI server in a child process::

    DJANGO_SETTINGS_MODULE=tests.settings DATABASE_URL=<the test database> \\
        python -m uvicorn tests.children.asgi_app:make_application --factory --lifespan off

The URLs are this module's own ``urlpatterns``: in-process tests set them with
``override_settings(ROOT_URLCONF="tests.children.asgi_app")``, and the child process's factory does the same
(with ``ALLOWED_HOSTS`` for its loopback address), so ``tests/settings.py`` and ``devkit/urls.py``
stay as they are. Routes:

- ``hold?key=K&owner=O&hold=SECONDS``: ``await aacquire(K, O, blocking=True)``, hold for SECONDS,
  ``await arelease``; answers the grant as JSON.
- ``stats``: the `gauge` of this process (how many requests wait and hold now, and at most).
- ``ready``: 200 once the server answers.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import override_settings
from django.urls import path


@dataclass
class Gauge:
    """Requests of this process between the start of their wait and their release (one event loop)."""

    waiting: int = 0
    holding: int = 0
    max_waiting: int = 0
    max_holding: int = 0


gauge = Gauge()


async def hold(request: HttpRequest) -> JsonResponse:
    from pg_lease_django import Lease  # needs the app registry, which the factory sets up first

    key, owner = request.GET["key"], request.GET["owner"]
    hold_for = float(request.GET.get("hold", "0.05"))
    gauge.waiting += 1
    gauge.max_waiting = max(gauge.max_waiting, gauge.waiting)
    try:
        grant = await Lease.objects.aacquire(key, owner, ttl=30, blocking=True, timeout=60)
    finally:
        gauge.waiting -= 1
    gauge.holding += 1
    gauge.max_holding = max(gauge.max_holding, gauge.holding)
    try:
        seen = await Lease.objects.ainspect(key)  # the server's view while this request holds it
        await asyncio.sleep(hold_for)
    finally:
        gauge.holding -= 1
    await Lease.objects.arelease(key, owner, grant.epoch)
    return JsonResponse(
        {
            "owner": grant.owner,
            "epoch": grant.epoch,
            "granted_at": grant.server_time.isoformat(),
            "seen_owner": seen.owner,
            "seen_epoch": seen.epoch,
        }
    )


async def stats(request: HttpRequest) -> JsonResponse:
    return JsonResponse(asdict(gauge))


async def ready(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [path("hold", hold), path("stats", stats), path("ready", ready)]


def make_application() -> ASGIHandler:
    """The ASGI application (``uvicorn --factory``): Django from ``DJANGO_SETTINGS_MODULE``, serving these URLs."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    application = get_asgi_application()
    # For the life of this test server process, as override_settings does for an in-process test.
    override_settings(ROOT_URLCONF=__name__, ALLOWED_HOSTS=["127.0.0.1"]).enable()
    return application
