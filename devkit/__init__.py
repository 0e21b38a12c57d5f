"""The project's development kit: what the tests, the stress tool, the benchmarks and the demo run on.

Not part of the package users install (pyproject.toml's packages are ``pg_lease_django*`` only):
the embedded PostgreSQL server and throwaway servers (``dbserver``), a primary with a streaming
standby (``pgcluster``), a Patroni cluster (``patroni_cluster``), a hold in a child process on such a
cluster (``failover_child``), the test app (``testapp``: fenced models, label ``testapp``), the
development settings (``settings_common``; ``settings`` on a real server) and ``sqlchange``, which
writes the next migration from an edit of ``schema.sql`` (``make sql-change NAME=...``). It imports only
``pg_lease_django`` and third-party code; ``tests``, ``stress``, ``benchmarks`` and ``demo`` import it,
never the other way round (tests/structure/test_layers.py).
"""
