"""Process-local registry of live managers: closes them at interpreter exit and on SIGTERM.

Weak references only: a manager that is garbage-collected leaves the registry by itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from typing import Any

_live: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_hooks_installed = False


def register(manager: Any) -> None:
    """Tracks ``manager`` until it is closed or collected; installs the exit hooks on first use."""
    global _hooks_installed
    with _lock:
        _live.add(manager)
        if not _hooks_installed:
            _hooks_installed = True
            atexit.register(close_all)
            _install_sigterm_cleanup()


def unregister(manager: Any) -> None:
    with _lock:
        _live.discard(manager)


def live_managers() -> list[Any]:
    with _lock:
        return list(_live)


def close_all() -> None:
    """Closes every live manager (unmaps memory, removes segments). Safe to call more than once."""
    for manager in live_managers():
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - at exit, one failure must not keep the others' files around
            pass


def _install_sigterm_cleanup() -> None:
    # Only where nobody else handles SIGTERM (engines install their own and exit through atexit).
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, _frame: Any) -> None:
        close_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of SIGTERM as before, just without leftovers

    signal.signal(signal.SIGTERM, on_sigterm)
