"""Where Django finds ``manage.py leases`` (commands/leases.py). How leases are shown: `pg_lease_django.display`."""
