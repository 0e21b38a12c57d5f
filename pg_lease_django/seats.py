"""The words for a refusal that came from the wrong seat: which role, or which setting, to use instead.

A deployment has seats, as docs/security.md tells: the owner migrates and grants, operators read
the lease tables, workers call the lease functions for the keys of their scope, the monitor reads
counts. PostgreSQL's refusal names the table or function it denied, as in "permission denied for
table pg_lease_django_lease". It never names the seat that may do it. `remedy` adds that: the role
that owns the tables, the declared operators, the setting that declares a worker.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections

from pg_lease_django import conf
from pg_lease_django.display import printable
from pg_lease_django.sql import errors, run, statements

__all__ = ["denied", "remedy"]

#: The ``manage.py leases`` subcommands that are the owner's: they write the grants and the scopes.
OWNERS = frozenset({"grant", "migrate"})
#: The subcommands a worker runs: they call the lease functions, as ``hold()`` does.
WORKERS = frozenset({"run"})


def denied(error: BaseException) -> bool:
    """Whether ``error`` is PostgreSQL's "permission denied", 42501, for a table or a function.

    A key scope's refusal is 42501 too, but is not one: it names the key and already says what to do.
    """
    return errors.sqlstate(error) == "42501" and "permission denied" in str(error)


def _seat(using: str, relation: str) -> tuple[str, str | None] | None:
    """This session's login role and the owner of ``relation``; None where even that cannot be read."""
    try:
        seat = run.one(connections[using], statements.SEAT, relation=relation)
    except DatabaseError:
        return None
    return seat.login, seat.owner


def remedy(using: str, what: str) -> str:
    """The seat that may do ``what``, named for a session of database ``using`` that was refused it.

    ``what`` is a ``manage.py leases`` subcommand, or ``migrate``. ``migrate`` and ``leases grant``
    are the owner's: the remedy names the role owning the tables. ``leases run`` is a worker's:
    declare the login role, or a group it is a member of. Anything else is an operator's: the roles
    of ``PG_LEASE_OPERATOR_ROLES``.
    """
    if what == "migrate":
        relation = "django_migrations"
    else:
        try:
            relation = f"{run.schema_name(connections[using])}.pg_lease_django_lease"
        except (ImproperlyConfigured, DatabaseError):  # not migrated, or ambiguous: its own error says so
            relation = "pg_lease_django_lease"
    seat = _seat(using, relation)
    login = f"role {printable(seat[0])}" if seat else "this role"
    owner = f"role {printable(seat[1])}" if seat and seat[1] else "the role that owns the lease tables"
    shown = "migrate" if what == "migrate" else f"leases {what}"
    if what in OWNERS:
        return f"`manage.py {shown}` is the owner's: run it as {owner}, not as {login}"
    if what in WORKERS:
        return (
            f"{login} may not call the lease functions: declare it (or a group role it is a member of) in "
            f"PG_LEASE_WORKER_ROLES, then run `manage.py leases grant` as {owner}"
        )
    operators = ", ".join(printable(role) for role in conf.operator_roles()) or "none declared"
    return (
        f"`manage.py {shown}` reads the lease tables, an operator's privilege: run it as a role of "
        f"PG_LEASE_OPERATOR_ROLES ({operators}), not as {login}"
    )
