"""The process's pluggy plugin manager, created on first use: hook specs plus installed exporters."""

from __future__ import annotations

import threading
from typing import Any

import pluggy

from .hookspecs import PROJECT, KvcachedSpec

EXPORTER_GROUP = "kvcached.exporters"

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The plugin manager, with every plugin of the ``kvcached.exporters`` entry-point group loaded."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(KvcachedSpec)
            pm.load_setuptools_entrypoints(EXPORTER_GROUP)
            _manager = pm
        return _manager


def mount_exporters(registry: Any) -> None:
    """Asks every exporter plugin to add its metrics to ``registry`` (an engine's own metrics registry)."""
    get_plugin_manager().hook.kvcached_mount_exporter(registry=registry)
