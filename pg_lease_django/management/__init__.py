"""Operator tooling shared by ``manage.py leases`` and the admin: how lease times are shown."""

from __future__ import annotations

from datetime import timedelta

__all__ = ["describe_expiry", "format_duration"]


def format_duration(delta: timedelta) -> str:
    """Render a non-negative duration compactly: ``0.4s``, ``29s``, ``4m 05s``, ``2h 03m``, ``3d 04h``.

    Negative durations are rendered by their magnitude; callers say "ago" themselves.
    """
    seconds = abs(delta.total_seconds())
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def describe_expiry(state: str, expires_in: timedelta | None) -> str:
    """Say when a lease expires relative to the server clock: ``in 29s``, ``lapsed 3m 05s ago``, ``-``.

    Args:
        state: ``"held"``, ``"lapsed"`` or ``"free"``, as ``pg_lease_status`` computed it.
        expires_in: ``expires_at`` minus the server time the state was computed at (None when free).
    """
    if state == "free" or expires_in is None:
        return "-"
    if state == "held":
        return f"in {format_duration(max(expires_in, timedelta(0)))}"
    return f"lapsed {format_duration(min(expires_in, timedelta(0)))} ago"
