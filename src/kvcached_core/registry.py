"""Process-local registry of live pools.

It announces pools to plugins (pluggy hooks), lets integrations and exporters list them, and closes them
at interpreter exit and on SIGTERM. Weak references only: a pool that is closed or garbage-collected
leaves the registry by itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from typing import Any

from .hookspecs import PoolInfo

_live: dict[int, PoolInfo] = {}
_lock = threading.Lock()
_hooks_installed = False


def register(manager: Any) -> None:
    """Tracks ``manager`` until it is closed or collected and announces it to plugins."""
    global _hooks_installed
    key = id(manager)
    info = PoolInfo(
        name=manager.name,
        pool_name=manager.pool_name,
        engine=manager.engine,
        device=manager.device,
        manager=weakref.ref(manager, lambda _ref: _forget(key)),
    )
    with _lock:
        _live[key] = info
        if not _hooks_installed:
            _hooks_installed = True
            atexit.register(close_all)
            _install_sigterm_cleanup()
    _hook().kvcached_pool_registered(pool=info)


def unregister(manager: Any) -> None:
    """Removes a closed ``manager`` and announces it."""
    _forget(id(manager))


def _forget(key: int) -> None:
    with _lock:
        info = _live.pop(key, None)
    if info is not None:
        _hook().kvcached_pool_unregistered(pool=info)


def live_pools() -> list[PoolInfo]:
    """Every pool of this process that is neither closed nor collected."""
    with _lock:
        return [info for info in _live.values() if info.manager() is not None]


def live_managers() -> list[Any]:
    return [m for m in (info.manager() for info in live_pools()) if m is not None]


def close_all() -> None:
    """Closes every live manager (unmaps memory, removes segments). Safe to call more than once."""
    for manager in live_managers():
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - at exit, one failure must not keep the others' files around
            pass


def _hook() -> Any:
    from .plugins import get_plugin_manager  # here: kvctl and kvtop never load plugins

    return get_plugin_manager().hook


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
