"""The three states of a lease, named once: every module that reads or shows a state uses these."""

from __future__ import annotations

from django.db import models


class LeaseStatus(models.TextChoices):
    """A lease's state on the server clock, as ``pg_lease_status()`` computes it.

    A `str` subclass: ``LeaseStatus.HELD == "held"``, so values read from SQL compare as they are.
    Each label is the value: it is what the command prints and the admin's state filter offers.
    """

    HELD = "held", "held"
    #: Expired, not yet taken over: the next acquire takes it with a new epoch.
    LAPSED = "lapsed", "lapsed"
    FREE = "free", "free"
