"""History-checked stress testing for pg_lease_django.

``python -m stress --short`` (CI: fixed seeds, about a minute) or ``python -m stress --long
--minutes N`` (a local soak). Workers in separate processes run seeded random schedules of
acquire, renew, release, inspect and fenced writes; :mod:`stress.checker` verifies the recorded
history against the server's own record. See :mod:`stress.harness` and docs/FAILURE-MODEL.md.

``python -m stress failover`` (:mod:`stress.failover`, ``make stress-failover``): the same against a
primary and a standby whose primary is SIGKILLed mid-load and the standby promoted, again and
again; see docs/high-availability.md.
"""
