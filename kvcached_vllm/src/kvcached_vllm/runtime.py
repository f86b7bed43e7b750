"""Per-process state of the plugin: the scheduler's planner (EngineCore) and each worker's page mirrors.

vLLM starts the scheduler and the workers in separate processes (always on CPU; for TP > 1 on GPU), and a
forked child inherits the parent's patches without re-running the plugin, so nothing here is created at
import: the planner when EngineCore has sized the KV cache, a mirror when a worker allocates it.
"""

from __future__ import annotations

import os

from kvcached_core import KVCacheManager, PageMirror, load_settings

_planners: dict[tuple[int, int], KVCacheManager] = {}  # (pid, num_blocks) -> planner
_mirrors: dict[int, list[PageMirror]] = {}  # pid -> this worker's mirrors


def add_planner(num_blocks: int, planner: KVCacheManager) -> None:
    _planners[(os.getpid(), num_blocks)] = planner


def planner_for(num_blocks: int) -> KVCacheManager | None:
    """The planner EngineCore made for a KV cache of ``num_blocks`` blocks, or None (not elastic)."""
    return _planners.get((os.getpid(), num_blocks))


def prefix_cache_blocks(num_blocks: int) -> int:
    """How many cached-free blocks may stay mapped (``KVCACHED_PREFIX_CACHE_BYTES``)."""
    planner = planner_for(num_blocks)
    if planner is None:
        return num_blocks
    per_block = planner.block_bytes * planner.num_buffers
    return load_settings().prefix_cache_bytes // per_block


def add_mirror(mirror: PageMirror) -> None:
    _mirrors.setdefault(os.getpid(), []).append(mirror)


def sync_mirrors() -> None:
    """Bring this worker's mappings up to the planner's page table (before a step runs)."""
    for mirror in _mirrors.get(os.getpid(), ()):
        mirror.sync()


def close_all() -> None:
    for mirror in _mirrors.pop(os.getpid(), []):
        mirror.close()
    for key in [k for k in _planners if k[0] == os.getpid()]:
        _planners.pop(key).close()
