"""SIGTERM during a hold: release the lease, then end the process as SIGTERM would have.

Every deploy stops processes with SIGTERM: ``systemctl stop``, a Kubernetes rollout. Python's
default for it is to end the process at once, with no ``finally`` and no ``with`` exit. So a lease
held by ``hold()`` / ``@leased`` / ``with elect()`` stayed held until its TTL ran out.

While such a scope is active in the main thread, the outermost scope installs a handler that
raises ``SystemExit(143)`` where the main thread is. It does so only if SIGTERM still has Python's
default disposition: nobody installed a handler, no server, no framework, no
``exit_on_signals()``. The exit unwinds every hold, and each releases its lease. When the
outermost scope ends, the default disposition is restored and the signal sent again. So the
process still ends *by SIGTERM*, as it would have without this package. A handler of anyone
else's is never replaced. ``PG_LEASE_RELEASE_ON_SIGTERM = False`` turns it off.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from . import conf
from .metrics import push

_depth = 0  # active scopes that counted (main thread only: no lock needed)
_received = False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    raise SystemExit(128 + signum)


def enter() -> bool:
    """A scope starts, a sync hold or ``with elect()``; True when it counts, to be passed to `leave`."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        return False  # only the main thread may install handlers, and only it receives signals
    current = signal.getsignal(signal.SIGTERM)
    if _depth == 0:
        if current is not signal.SIG_DFL or not conf.release_on_sigterm():
            return False  # someone else's handler (or an ignored signal): theirs to decide
        signal.signal(signal.SIGTERM, _handler)
    elif current is not _handler:
        return False  # replaced meanwhile by someone else
    _depth += 1
    return True


def leave(counted: bool) -> None:
    """The scope `enter` answered for ends, after its lease was released.

    The outermost one restores the default disposition, and re-sends SIGTERM if it arrived meanwhile.
    """
    global _depth, _received
    if not counted:
        return
    _depth -= 1
    if _depth > 0:
        return
    if signal.getsignal(signal.SIGTERM) is _handler:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _received:
        _received = False
        push.exiting()  # the signal ends the process without atexit: its metrics leave first
        signal.raise_signal(signal.SIGTERM)  # the default disposition: the process ends by SIGTERM
