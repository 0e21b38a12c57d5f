"""Leader election on ``hold()``: ``elect()`` in a thread and ``aelect()`` as a task, one plan for both.

`plan` decides what a campaign does, term after term, and does no I/O. `candidate` is what both
drivers share: the checked arguments, the callbacks, what was seen. `threaded` performs the plan's
steps in a thread of its own, with `Election` and ``elect()``. `aio` performs them as a task of the
event loop, with ``aelect()``. Users import the public names from `pg_lease_django`. ``start`` and
``fail_term`` are the hooks of ``leases run --campaign``, in
`pg_lease_django.management.supervision.campaign`. See docs/leader-election.md.
"""

from .aio import aelect
from .threaded import Election, current_election, elect, fail_term, start

__all__ = ["Election", "aelect", "current_election", "elect", "fail_term", "start"]
