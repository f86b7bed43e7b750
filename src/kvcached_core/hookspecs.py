"""pluggy hook specifications of kvcached-core.

Plugins are discovered through the ``kvcached.exporters`` entry-point group (see ``plugins.py``), or
registered by hand with ``kvcached_core.plugins.get_plugin_manager().register(obj)``. Metrics backends stay
outside the allocator: they read snapshots of the pools these hooks announce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pluggy

PROJECT = "kvcached"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class PoolInfo:
    """Labels of one pool. ``manager()`` gives the live KVCacheManager, or None once it is gone."""

    name: str
    pool_name: str
    engine: str
    device: str
    manager: Any  # a weakref.ref to the KVCacheManager


class KvcachedSpec:
    @hookspec
    def kvcached_pool_registered(self, pool: PoolInfo) -> None:
        """A pool was created in this process."""

    @hookspec
    def kvcached_pool_unregistered(self, pool: PoolInfo) -> None:
        """A pool was closed or garbage-collected (``pool.manager()`` may already be None)."""

    @hookspec
    def kvcached_mount_exporter(self, registry: Any) -> None:
        """Add this exporter's metrics to ``registry``, a metrics registry an engine already serves
        (for example a prometheus_client CollectorRegistry), so kvcached's metrics appear in its endpoint."""
