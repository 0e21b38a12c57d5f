"""The lease a job holds: ``hold()``, ``@leased`` and what runs them. Nothing here is imported eagerly.

The modules are listed lowest first. Each imports only those before it and the package's root
modules below ``holds/``; tests/structure/test_import_graph.py checks it.

- `context`: the holds active in this thread or task, and ``current_lease()``. It is a leaf.
- `lease`: `HeldLease`, the job's read-only view, and `Tenure`, the state its heartbeat and its
  hold change through named methods.
- `lease_connection`: one lease connection and its acquire, renew and release, settling what an
  interruption left in flight. A lease connection is a private Django connection, never the job's.
  `InFlight` is a statement another thread may interrupt.
- `lease_pool`: the process's pools of lease connections, one lent per statement.
- `scheduler`: the process's one scheduler thread and its workers, which run every hold's renewals.
- `heartbeat`: one hold's renewals, retries and bounded exit, in `Heartbeat`.
- `session`: one hold from enter to exit. `HoldOptions` checks its options once; `HoldSession` runs
  the acquire that starts its heartbeat and the release that ends it.
- `holding`: ``hold()`` and `Holding`, the sync and async context managers around a session.
- `jobs`: ``@leased`` and ``exit_on_signals``.

Users import these names from `pg_lease_django`.
"""
