"""Per-process state of the plugin: the scheduler's planner, block pools and pressure watch (EngineCore) and
each worker's page mirrors.

vLLM starts the scheduler and the workers in separate processes (always on CPU; for TP > 1 on GPU), and a
forked child inherits the parent's patches without re-running the plugin, so nothing here is created at
import: the planner when EngineCore has sized the KV cache, a mirror when a worker allocates it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcached_core import KVCacheManager, PageMirror, load_settings
from kvcached_core.pressure import PressureWatch as CoreWatch

logger = logging.getLogger("vllm.kvcached")

_planners: dict[tuple[int, int], KVCacheManager] = {}  # (pid, num_blocks) -> planner
_mirrors: dict[int, list[PageMirror]] = {}  # pid -> this worker's mirrors
# A worker's steps and its idle syncs exclude each other: pages are unmapped only between steps.
_step_lock = threading.RLock()
_idle_syncer: dict[int, threading.Event] = {}  # pid -> stop flag of this worker's idle-sync thread


def sleep_watch_interval() -> None:
    """Sleep one ``KVCACHED_WATCH_INTERVAL_MS``: how often control segments are republished."""
    time.sleep(load_settings().watch_interval_ms / 1000)


def add_planner(num_blocks: int, planner: KVCacheManager) -> None:
    _planners[(os.getpid(), num_blocks)] = planner


def planner_for(num_blocks: int) -> KVCacheManager | None:
    """The planner EngineCore made for a KV cache of ``num_blocks`` blocks, or None (not elastic)."""
    return _planners.get((os.getpid(), num_blocks))


def prefix_cache_blocks(num_blocks: int, budget_bytes: int | None = None) -> int:
    """How many cached-free blocks ``budget_bytes`` (default ``KVCACHED_PREFIX_CACHE_BYTES``) keeps mapped."""
    planner = planner_for(num_blocks)
    if planner is None:
        return num_blocks
    if budget_bytes is None:
        budget_bytes = load_settings().prefix_cache_bytes
    return budget_bytes // (planner.block_bytes * planner.num_buffers)


def add_mirror(mirror: PageMirror) -> None:
    """Keep ``mirror`` in sync: before every step (:func:`run_step`), and every ``KVCACHED_WATCH_INTERVAL_MS``
    while the worker is idle, so an idle engine's workers give back what its scheduler released."""
    pid = os.getpid()
    _mirrors.setdefault(pid, []).append(mirror)
    if pid not in _idle_syncer:
        stop = threading.Event()
        _idle_syncer[pid] = stop
        interval = load_settings().watch_interval_ms / 1000
        thread = threading.Thread(target=_sync_while_idle, args=(stop, interval), name="kvcached-idle-sync")
        thread.daemon = True
        thread.start()
        atexit.register(close_all)  # stop the thread and unmap before the interpreter tears down


def sync_mirrors() -> None:
    """Bring this worker's mappings up to the planner's page table."""
    with _step_lock:
        for mirror in _mirrors.get(os.getpid(), ()):
            mirror.sync()


def run_step(step: Callable[[], Any]) -> Any:
    """Sync, then run a worker step, with no idle sync in between or during it."""
    with _step_lock:
        sync_mirrors()
        return step()


def _sync_while_idle(stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        if _step_lock.acquire(blocking=False):  # a step is running: it synced, the next idle turn will
            try:
                if not stop.is_set():
                    sync_mirrors()
            finally:
                _step_lock.release()


class PressureWatch:
    """EngineCore side of device pressure (:class:`kvcached_core.pressure.PressureWatch`), one per EngineCore
    process.

    Policy: when another engine on this device could not get memory, this engine gives back its cached
    prefix blocks (no request uses them), least recently used first and whole idle pages first, down to
    ``KVCACHED_PREFIX_CACHE_FLOOR_BYTES``, and unmaps the empty pages it keeps for its own recent demand.
    Blocks in use are never taken. The give-back runs on the scheduler's own thread, between two of its
    turns: the core's watcher notices the shortfall and wakes the engine loop, whose next client request (or
    the wake-up itself) runs :meth:`run_pending` first. When this engine falls short itself (the device, not
    its own limit, is full), :meth:`report_shortfall` tells the others.
    """

    def __init__(self, device: str) -> None:
        settings = load_settings()
        self.floor_bytes = settings.prefix_cache_floor_bytes
        self.pools: list[Any] = []  # ElasticBlockPool, this process's
        self.engine: Any = None  # vLLM's EngineCoreProc, seen at its first client request
        self.given_back = 0  # blocks, for tests and logs
        self.core = CoreWatch(settings, device, self._has_spare, self._wake_engine)

    @property
    def pending(self) -> threading.Event:
        """Set while another engine on the device reported a shortfall this one has not answered yet."""
        return self.core.pending

    def _has_spare(self) -> bool:
        return any(p.gives_prefix_back(self._floor_blocks(p)) or p.has_idle_pages() for p in self.pools)

    def _floor_blocks(self, pool: Any) -> int:
        return prefix_cache_blocks(pool.num_gpu_blocks, self.floor_bytes)

    def _wake_engine(self) -> None:
        engine = self.engine
        if engine is None:
            return
        from vllm.v1.engine import EngineCoreRequestType

        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def run_pending(self) -> None:
        """On the scheduler's thread: give back cached prefix blocks and idle pages if another engine fell
        short."""
        if not self.core.take_pending():
            return
        given = sum(pool.shrink_prefix_cache(self._floor_blocks(pool)) for pool in self.pools)
        unmapped = sum(pool.trim() for pool in self.pools)
        if given or unmapped:
            self.given_back += given
            logger.info(
                "kvcached: gave back %d cached prefix blocks and %d MiB to another engine on this device",
                given,
                unmapped >> 20,
            )

    def report_shortfall(self) -> None:
        """The scheduler could not get blocks: tell the other engines on this device, when the device (not
        this engine's limit or virtual capacity) is what is short."""
        self.core.report_shortfall(lambda: any(pool.physically_short() for pool in self.pools))

    def close(self) -> None:
        """Stops watching the device."""
        self.core.close()


_watch: dict[int, PressureWatch] = {}  # pid -> this EngineCore's pressure watch


def add_block_pool(pool: Any, device: str) -> None:
    """Register an elastic block pool of this EngineCore for the pressure policy."""
    watch = _watch.get(os.getpid())
    if watch is None:
        watch = _watch[os.getpid()] = PressureWatch(device)
    watch.pools.append(pool)


def pressure_watch() -> PressureWatch | None:
    """This process's pressure watch (EngineCore with an elastic KV cache), or None."""
    return _watch.get(os.getpid())


def close_all() -> None:
    stop = _idle_syncer.pop(os.getpid(), None)
    if stop is not None:
        stop.set()
    watch = _watch.pop(os.getpid(), None)
    if watch is not None:
        watch.close()
    with _step_lock:
        mirrors = _mirrors.pop(os.getpid(), [])
    for mirror in mirrors:
        mirror.close()
    for key in [k for k in _planners if k[0] == os.getpid()]:
        _planners.pop(key).close()
