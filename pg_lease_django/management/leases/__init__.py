"""``manage.py leases`` in rooms: its arguments in `arguments`, what they share in `common`, and a
module per group of subcommands: `reading`, `operating` and `running`.
`pg_lease_django.management.commands.leases` puts them together and dispatches."""
