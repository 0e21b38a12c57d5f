"""``manage.py leases run``: COMMAND run while a lease is held. Nothing here is imported eagerly.

Modules, lowest first. Each imports only those before it, the command's exit codes and the
layers below the operators'; tests/structure/test_import_graph.py checks it.

- `child_process`: what ``leases run`` asks the operating system about COMMAND, and `Child`,
  COMMAND's process with its group and its grace. No database, no lease.
- `status_line`: the line ``leases run --wait`` shows on a terminal while it waits for the lease.
- `supervisor`: `Supervisor`, one run that acquires with ``hold()``, runs COMMAND, passes signals
  on, signals COMMAND on a loss and releases; and `RunError`, how a run ends with a code of its own.
- `campaign`: `CampaignSupervisor`, the `Supervisor` of ``leases run --campaign``, which keeps
  COMMAND running on one machine of many, a term at a time.

The command's arguments are parsed in `pg_lease_django.management.leases.running`, beside every
other subcommand's; the exit codes of the whole command are `pg_lease_django.management.exit_codes`.
"""
