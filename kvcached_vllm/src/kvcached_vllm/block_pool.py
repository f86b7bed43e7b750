"""An elastic BlockPool: vLLM's own free queue and prefix cache, with kvcached deciding which blocks are new.

Every block is in one of three states:

- in use (``ref_cnt > 0``): allocated in kvcached, so its pages are mapped in every worker;
- cached-free (``ref_cnt == 0`` with a prefix hash): still allocated in kvcached (its data is worth keeping)
  and in vLLM's free queue as an eviction candidate, exactly as in vLLM;
- free: released to kvcached, whose reclaim may unmap its page; it stays in vLLM's free queue.

``get_new_blocks`` takes ids from kvcached (pages already mapped first), evicting cached-free blocks when
kvcached cannot serve the request otherwise. ``get_num_free_blocks`` is what kvcached can map now plus the
cached-free blocks, so the scheduler's admission and preemption follow physical memory and ``kvctl limit``.
While requests hold blocks, cached prefixes stay as in vLLM (evicted when kvcached cannot serve a new block
otherwise), so a busy engine keeps vLLM's prefix hits. When the last block in use is freed (the engine went
idle), cached-free blocks beyond ``KVCACHED_PREFIX_CACHE_BYTES`` are evicted, page-aware: first those on
pages where no block is in use (oldest such page first), so whole pages come free and can be unmapped, then
the oldest others. When another engine on the same device runs short of memory,
:meth:`ElasticBlockPool.shrink_prefix_cache` gives cached-free blocks back the same way, down to a floor.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvcached_core import KVCacheManager
from kvcached_core.promise import SchedulerCount

from . import runtime

logger = logging.getLogger("vllm.kvcached")
# Blocks per page up to which a request's own page fills soon (block-outer pages of a few MiB hold tens).
_REQUEST_PAGE_BLOCKS = 64


class ElasticBlockPool(BlockPool):
    """``BlockPool`` over a kvcached planner (the releases with block reuse watchers; see its patch unit).

    Replaces the ``BlockPool`` that ``vllm.v1.core.kv_cache_coordinator`` builds for the scheduler's KV cache
    groups; pools built elsewhere (offloading, connectors) stay vLLM's own. Without a planner for this many
    blocks (the KV cache could not be made elastic) every method is vLLM's own.
    """

    # 0.30 on, blocks carry their pool, and blocks of other pools can be freed through this one.
    _blocks_know_their_pool = True

    def __init__(self, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_gpu_blocks, *args, **kwargs)
        self._owner: object = self._pool_of_own_blocks()
        self._manager: KVCacheManager | None = runtime.planner_for(num_gpu_blocks)
        self._held = bytearray(num_gpu_blocks)  # allocated in kvcached (in use or cached-free)
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._prefix_budget = runtime.prefix_cache_blocks(num_gpu_blocks)
        # Page-aware eviction: blocks in use per physical page, cached-free blocks per page, and the pages
        # whose every held block is cached-free (evicting those gives whole pages back), oldest first. The
        # page of each block is kvcached's own (blocks that do not divide a page straddle some, and those are
        # never handed out: block id // blocks per page drifts from the real page after the first).
        self._blocks_per_page = 1
        self._page_of: list[int] = []
        if self._manager is not None:
            self._blocks_per_page = max(1, self._manager.page_bytes // self._manager.block_bytes)
            self._page_of = self._manager.block_pages()
        self._busy = [0] * (max(self._page_of, default=0) + 1)
        self._busy[0] = 1  # vLLM's null block, reserved in kvcached for good: page 0 never comes free
        self._cached_by_page: dict[int, dict[int, None]] = {}
        self._idle_pages: OrderedDict[int, None] = OrderedDict()
        self._in_use = 0  # blocks requests hold (ref_cnt > 0)
        self._count = SchedulerCount(self._manager)  # what vLLM's scheduler was last told is free
        # Set by the allocate-slots and planned-blocks units (attributes, not methods: vLLM's scheduler
        # passes here per request and step): whether vLLM's allocate_slots is running, and the blocks it
        # plans to take right after its next free-block check.
        self.checking = False
        self.planned = 0
        # With KVCACHED_BLOCK_PLACEMENT=request, the allocate-slots unit sets ``requester`` to vLLM's
        # coordinator and the id of the request it allocates for; new blocks then go beside that request's
        # last one (read only when blocks are taken: most decode steps take none).
        self.requester: tuple[Any, str] | None = None
        places_by_request = self._manager is not None and self._manager.places_by_request
        if places_by_request and self._blocks_per_page > _REQUEST_PAGE_BLOCKS:
            logger.warning(
                "kvcached: KVCACHED_BLOCK_PLACEMENT=request with %d blocks per page: a request's page is mostly "
                "unused while it is short; KVCACHED_KV_LAYOUT=block-outer (pages of whole blocks of every "
                "layer) fits it",
                self._blocks_per_page,
            )
        elif places_by_request:
            logger.info(
                "kvcached: KVCACHED_BLOCK_PLACEMENT=request: each request on pages of its own (%d blocks a page)",
                self._blocks_per_page,
            )
        self._available = self._manager.available_size if self._manager is not None else None
        if self._manager is not None:
            self._manager.gates_admissions = True  # allocate_slots holds new requests to fair share's cap
            runtime.add_block_pool(self, self._manager.device)

    def _pool_of_own_blocks(self) -> object:
        """What this pool's blocks hold as their pool."""
        return self

    @property
    def elastic(self) -> bool:
        """Whether block ids come from kvcached."""
        return self._manager is not None

    def get_num_free_blocks(self) -> int:
        """Blocks the scheduler may plan on: what kvcached can serve now plus cached prefix blocks it may
        evict (later allocations are held to this count).

        Right before an allocation (``planned`` blocks, noted while ``checking``) the blocks vLLM is about
        to take are mapped first, when this process does not hold them yet: the device's free memory is read
        at most 20 ms apart and other engines may have used it since, and vLLM cannot take a refusal once it
        has checked. If they cannot all be mapped, the count is what this process holds, and vLLM refuses
        the request (it waits, or another of this engine's requests is preempted) instead of failing."""
        if self._manager is None:
            return super().get_num_free_blocks()
        cached = len(self._cached_free)
        planned = self.planned
        if planned:
            self.planned = 0
            if self.checking and self._manager.assured_size() + cached < planned:
                assured = self._manager.prepare(planned - cached) + cached
                if assured < planned:
                    return self._count.report(assured)
        available = self._available() + cached
        self._count.counted = available  # SchedulerCount.report, inlined: once per request and step
        return available

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks from kvcached, evicting cached prefixes first when memory is short;
        ValueError, as vLLM's own pool raises, beyond what was last counted."""
        if self._manager is None:
            return super().get_new_blocks(num_blocks)
        near, manager = -1, self._manager  # near -1: a plain alloc
        if self.requester is not None:
            coordinator, request_id = self.requester
            own = coordinator.get_blocks(request_id)[0]
            near = own[-1].block_id if own else -1
        ids = manager.alloc_near(num_blocks, near)
        while ids is None and self._cached_free:
            self._evict(max(1, num_blocks - manager.available_size()))
            ids = manager.alloc_near(num_blocks, near)
        # Blocks within the scheduler's last count are served even if a limit or another process took the
        # memory since; beyond it vLLM's own pool fails the same way.
        ids = self._count.honour(num_blocks, ids, on_short=self._report_shortfall)
        if ids is None:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = [self.blocks[i] for i in ids]
        self._notify_handed_out(blocks)
        # One pass, bookkeeping inlined: this runs for every block the scheduler takes.
        held, busy, idle_pages, page_of = self._held, self._busy, self._idle_pages, self._page_of
        remove = self.free_block_queue.remove
        caching, collector = self.enable_caching, self.metrics_collector
        for block in blocks:
            block_id = block.block_id
            held[block_id] = 1
            page = page_of[block_id]
            busy[page] += 1
            if busy[page] == 1 and idle_pages:  # a block of the page is in use again: the page is not idle
                idle_pages.pop(page, None)
            remove(block)
            if caching and (collector or block.block_hash is not None):
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        self._in_use += len(blocks)
        return blocks

    @staticmethod
    def _report_shortfall() -> None:
        """Ask the other engines on this device to give memory back (while a promised allocation waits)."""
        watch = runtime.pressure_watch()
        if watch is not None:
            watch.report_shortfall()

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit: cached free blocks become busy again (their pages must not be given back)."""
        if self._manager is not None:
            for block in blocks:
                if block.ref_cnt == 0 and block.block_id in self._cached_free:  # a prefix hit: back in use
                    self._forget_cached(block.block_id)
                    self._mark_busy(block.block_id, 1)
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Blocks whose last reference went: hashed ones stay as cached prefixes, the rest go back to
        kvcached; once no block is in use, cached prefixes beyond the prefix-cache budget go too."""
        if self._manager is None:
            return super().free_blocks(ordered_blocks)
        ordered_blocks = list(ordered_blocks)
        super().free_blocks(ordered_blocks)
        self._after_free(ordered_blocks, evict_first=False)

    def _after_free(self, ordered_blocks: list[KVCacheBlock], evict_first: bool) -> None:
        """kvcached's side of :meth:`free_blocks`, after vLLM's; with ``evict_first``, freed cached prefixes
        are the first to be evicted."""
        released, cached_now = [], []
        freed = 0
        held, busy, idle_pages, page_of = self._held, self._busy, self._idle_pages, self._page_of
        cached_free, cached_by_page = self._cached_free, self._cached_by_page
        caching, check_owner, owner = self.enable_caching, self._blocks_know_their_pool, self._owner
        for block in ordered_blocks:
            block_id = block.block_id
            # Another pool's, still referenced, or never held (the null block): not ours to give back.
            if (check_owner and block.pool is not owner) or block.ref_cnt or not held[block_id]:
                continue
            page = page_of[block_id]
            busy[page] -= 1
            freed += 1
            if caching and block.block_hash is not None:
                cached_free[block_id] = None
                if evict_first:
                    cached_now.append(block_id)
                cached_by_page.setdefault(page, {})[block_id] = None
            else:
                released.append(block_id)
            if busy[page] == 0 and page in cached_by_page:  # only cached-free blocks left: an idle page
                idle_pages.setdefault(page, None)
        self._in_use -= freed
        if evict_first:  # to the front, in the order given (the first freed is the first evicted), as vLLM does
            for block_id in reversed(cached_now):
                cached_free.move_to_end(block_id, last=False)
        self._release(released)
        excess = len(self._cached_free) - self._prefix_budget
        if excess > 0 and not self._in_use:
            self._evict(excess)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM evicts these cached blocks: those no longer hashed go back to kvcached."""
        super().evict_blocks(block_ids)
        if self._manager is not None:
            self._release_unhashed(block_ids)

    def reset_prefix_cache(self) -> bool:
        """vLLM drops its prefix cache: every cached free block goes back to kvcached."""
        done = super().reset_prefix_cache()
        if done and self._manager is not None:
            self._release_unhashed(list(self._cached_free))
        return done

    @property
    def cached_free_blocks(self) -> int:
        """Blocks kept mapped only for their cached prefix (no request uses them)."""
        return len(self._cached_free)

    def shrink_prefix_cache(self, floor_blocks: int) -> int:
        """Give back whole pages of cached-free blocks (pages no request uses, least recently freed first)
        while at least ``floor_blocks`` cached-free blocks remain, and no more pages than unmap (under fair
        share's cap, pages stay mapped: :meth:`kvcached_core.KVCacheManager.pages_over_cap`); returns how many
        blocks went back. Only whole pages free memory, so no page is split. Call on the scheduler's thread:
        it reads the cache."""
        if self._manager is None:
            return 0
        victims: list[int] = []
        for page in list(self._idle_pages)[: self._manager.pages_over_cap()]:
            if not self._keeps_floor(page, floor_blocks):
                break
            victims += self._take_page(page)
        self._drop(victims)
        return len(victims)

    def gives_prefix_back(self, floor_blocks: int) -> bool:
        """Whether :meth:`shrink_prefix_cache` would free memory now: an idle page it may take without going
        below the floor, and not held under fair share's cap. Read from the watcher thread: racy, as a hint
        may be (one C-level ``next`` on the dict, one ``get``)."""
        if self._manager is None or self._manager.pages_over_cap() == 0:
            return False
        page = next(iter(self._idle_pages), None)  # the first page shrink_prefix_cache would take
        return page is not None and self._keeps_floor(page, floor_blocks)

    def _keeps_floor(self, page: int, floor_blocks: int) -> bool:
        """Whether giving back ``page``'s cached blocks leaves at least ``floor_blocks`` cached."""
        return len(self._cached_free) - len(self._cached_by_page.get(page, ())) >= floor_blocks

    def has_idle_pages(self) -> bool:
        """Whether pages that hold no allocated block are mapped (kvcached keeps the engine's recent demand
        mapped for up to two ``KVCACHED_RECLAIM_DELAY_MS`` windows) beyond those kept under fair share's cap."""
        return self._manager is not None and self._manager.has_idle_pages()

    def trim(self) -> int:
        """Unmap every page no allocated block is on, now, but none under fair share's cap while one is set
        (:meth:`kvcached_core.KVCacheManager.trim_to_cap`); returns the bytes given back."""
        return self._manager.trim_to_cap() if self._manager is not None else 0

    def physically_short(self) -> bool:
        """Whether the device, not this engine's limit or virtual capacity, stops it handing out more blocks."""
        return self._manager is not None and self._manager.physically_short()

    def _notify_handed_out(self, blocks: list[KVCacheBlock]) -> None:
        """Tell vLLM's reuse watchers (0.30 on) that these blocks were handed out again."""
        if self._reuse_watchers:
            self._notify_reuse(blocks)

    def _page(self, block_id: int) -> int:
        return self._page_of[block_id]

    def _mark_busy(self, block_id: int, delta: int) -> None:
        page = self._page(block_id)
        self._busy[page] += delta
        self._in_use += delta
        if self._busy[page] == 0 and page in self._cached_by_page:
            self._idle_pages[page] = None
        elif delta > 0 and self._busy[page] == 1:
            self._idle_pages.pop(page, None)

    def _remember_cached(self, block_id: int) -> None:
        page = self._page(block_id)
        self._cached_free[block_id] = None
        self._cached_by_page.setdefault(page, {})[block_id] = None
        if self._busy[page] == 0:
            self._idle_pages.setdefault(page, None)

    def _forget_cached(self, block_id: int) -> None:
        page = self._page(block_id)
        self._cached_free.pop(block_id, None)
        on_page = self._cached_by_page.get(page)
        if on_page is not None:
            on_page.pop(block_id, None)
            if not on_page:
                del self._cached_by_page[page]
                self._idle_pages.pop(page, None)

    def _evict(self, count: int) -> None:
        """Drop ``count`` cached-free blocks from the prefix cache and give them to kvcached: whole idle pages
        first (oldest first), then the oldest blocks elsewhere."""
        victims: list[int] = []
        while self._idle_pages and len(victims) < count:
            victims += self._take_page(next(iter(self._idle_pages)))
        while self._cached_free and len(victims) < count:
            block_id = next(iter(self._cached_free))
            self._forget_cached(block_id)
            victims.append(block_id)
        self._drop(victims)

    def _take_page(self, page: int) -> list[int]:
        """Forget every cached-free block of an idle page; returns their ids."""
        block_ids = list(self._cached_by_page[page])
        for block_id in block_ids:
            self._forget_cached(block_id)
        return block_ids

    def _drop(self, victims: list[int]) -> None:
        """Remove the victims' hashes from the prefix cache and give them to kvcached."""
        for block_id in victims:
            self._maybe_evict_cached_block(self.blocks[block_id])
        self._release(victims)

    def _release_unhashed(self, block_ids: Iterable[int]) -> None:
        released = []
        for block_id in list(block_ids):
            block = self.blocks[block_id]
            if self._held[block_id] and block.ref_cnt == 0 and block.block_hash is None and not block.is_null:
                self._forget_cached(block_id)
                released.append(block_id)
        self._release(released)

    def _release(self, block_ids: list[int]) -> None:
        if block_ids:
            for block_id in block_ids:
                self._held[block_id] = 0
            self._manager.free(block_ids)


class ElasticBlockPoolBeforeReuseWatchers(ElasticBlockPool):
    """``ElasticBlockPool`` for vLLM 0.26 to 0.29, whose blocks carry no pool and whose pool has no reuse
    watchers."""

    _blocks_know_their_pool = False

    def _notify_handed_out(self, blocks: list[KVCacheBlock]) -> None:
        return None


class ElasticBlockPoolWeakOwner(ElasticBlockPool):
    """``ElasticBlockPool`` for vLLM 0.34 on: a block names its pool through a weak reference (the pool's
    ``_weak_self``), and ``free_blocks`` takes ``evict_first`` (freed cached blocks evicted before others,
    for blocks another tier already holds)."""

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
        """As :meth:`ElasticBlockPool.free_blocks`; with ``evict_first``, the freed cached prefixes go to the
        front of both vLLM's free queue and kvcached's eviction order."""
        if self._manager is None:
            return BlockPool.free_blocks(self, ordered_blocks, evict_first)
        ordered_blocks = list(ordered_blocks)
        BlockPool.free_blocks(self, ordered_blocks, evict_first)
        self._after_free(ordered_blocks, evict_first)

    def _pool_of_own_blocks(self) -> object:
        return self._weak_self  # set by vLLM's __init__: a missing one fails at engine start
