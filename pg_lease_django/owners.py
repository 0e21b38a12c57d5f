"""The owner identity a hold or a campaign takes when none is given."""

from __future__ import annotations

import os
import secrets
import socket


def default_owner() -> str:
    """``host:pid:random``, unique per hold and per campaign.

    Two holds in one process never share an identity, and a campaign keeps one identity for all its
    terms. The host and pid tell an operator where it runs.
    """
    return f"{socket.gethostname()[:200]}:{os.getpid()}:{secrets.token_hex(4)}"
