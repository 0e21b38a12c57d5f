"""The lease a job holds: ``hold()``, ``@leased`` and what runs them. Nothing here is imported eagerly.

Modules, lowest first (each imports only those before it, and the package's root modules below
``holds/``; tests/test_import_graph.py checks it):

- `context`: the holds active in this thread or task, and ``current_lease()`` (a leaf).
- `lease`: `HeldLease`, the job's read-only view, and `Tenure`, the state its heartbeat and its
  hold change through named methods.
- `lease_connection`: one lease connection (a private Django connection, never the job's) and its
  acquire / renew / release, settling what an interruption left in flight; `InFlight`, a statement
  another thread may interrupt.
- `lease_pool`: the process's pools of lease connections, one lent per statement.
- `scheduler`: the process's one scheduler thread and its workers, which run every hold's renewals.
- `heartbeat`: one hold's renewals, retries and bounded exit (`Heartbeat`).
- `session`: one hold from enter to exit: its options, checked once (`HoldOptions`), the acquire
  that starts its heartbeat and the release that ends it (`HoldSession`).
- `holding`: ``hold()`` and `Holding`, the sync and async context managers around a session.
- `jobs`: ``@leased`` and ``exit_on_signals``.

Users import these names from `pg_lease_django`.
"""
