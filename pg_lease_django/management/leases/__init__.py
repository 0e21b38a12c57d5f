"""``manage.py leases`` in rooms: its arguments (`arguments`), what they share (`common`), and a module per
group of subcommands (`reading`, `operating`, `running`); `pg_lease_django.management.commands.leases`
puts them together and dispatches."""
