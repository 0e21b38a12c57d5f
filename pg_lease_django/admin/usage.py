"""The admin's "how to use this key" on a lease's page: the key from Python, the shell and SQL.

The key is others' data. A character a browser or a terminal acts on, such as a control character
or a bidi override, is never pasted as it is. It is spelled with an escape each language reads back
exactly: Python's ``\\u202e``, bash's ``$'...'``, PostgreSQL's ``E'...'``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable

from pg_lease_django.display import printable

__all__ = ["usage_snippet"]


def usage_snippet(key: str, epoch: int) -> str:
    """Snippets that use ``key`` (at ``epoch`` for a forced release) from Python, the shell and SQL: plain text."""
    python_key = _spelled(json.dumps(key, ensure_ascii=False), _unicode_escape)
    if _plain(key):
        shell_key, sql_key = shlex.quote(key), "'" + key.replace("'", "''") + "'"
    else:  # bash's ANSI-C quoting and PostgreSQL's escape strings read the escapes back exactly
        shell_key = "$'" + _spelled(key.replace("\\", "\\\\").replace("'", "\\'"), _c_escape) + "'"
        sql_key = "E'" + _spelled(key.replace("\\", "\\\\").replace("'", "''"), _c_escape) + "'"
    return (
        "from pg_lease_django import Lease\n\n"
        f'grant = Lease.objects.acquire({python_key}, "my-worker-id", ttl=30)\n'
        "if grant is not None:  # None: another owner holds it\n"
        "    ...  # pass grant.epoch to guarded writes: obj.save(fence=grant)\n"
        "    Lease.objects.release(grant.key, grant.owner, grant.epoch)\n\n"
        f"$ python manage.py leases show {shell_key}\n"
        f"$ python manage.py leases release {shell_key} --force --epoch {epoch}\n\n"
        f"SELECT * FROM pg_lease_inspect({sql_key});"
    )


def _plain(text: str) -> bool:
    """Whether ``text`` has no character a browser or a terminal acts on (`printable` leaves it be)."""
    return printable(text) == text


def _spelled(literal: str, escape: Callable[[int], str]) -> str:
    """``literal`` with each character a browser or a terminal acts on written as ``escape(code)``."""
    return "".join(char if char == "\\" or _plain(char) else escape(ord(char)) for char in literal)


def _unicode_escape(code: int) -> str:
    """Python's escape of a character (JSON's for the BMP): ``\\u202e``, ``\\U0001d173``."""
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _c_escape(code: int) -> str:
    """The escape bash's ``$'...'`` and PostgreSQL's ``E'...'`` both read: ``\\x1b``, ``\\u202e``."""
    return f"\\x{code:02x}" if code < 0x80 else _unicode_escape(code)
