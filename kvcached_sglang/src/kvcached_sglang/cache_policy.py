"""What an SGLang engine keeps mapped for its radix cache, and how it answers other engines on its device.

SGLang keeps the KV of finished requests in its radix cache until its own allocations need the room. Over
kvcached that memory stays mapped, so without a policy an idle engine would hold its last burst's peak away
from its neighbours. The policy (the vLLM plugin's, in SGLang's terms), run on the scheduler's own thread
inside its loop, as SGLang's own eviction is:

- when the scheduler is fully idle, radix-cache entries beyond ``KVCACHED_PREFIX_CACHE_BYTES`` are evicted
  (SGLang's eviction: least recently used first, only entries no request holds), so their pages come free
  and kvcached unmaps them after its reclaim window;
- when another engine on the device could not get memory, an idle engine evicts down to
  ``KVCACHED_PREFIX_CACHE_FLOOR_BYTES`` and unmaps its empty pages at once;
- when requests wait for memory that the device (not this engine's limit) lacks, this engine tells the
  others (:class:`kvcached_core.pressure.PressureWatch`);
- when an allocation the scheduler already counted on finds the device full (another engine mapped the
  memory since SGLang's check, and SGLang treats a failed allocation as fatal), the engine evicts that many
  tokens of its own radix cache, as SGLang does before its own allocations, and tells the others, while
  kvcached waits for the memory (:meth:`kvcached_core.KVCacheManager.alloc_promised`);
- ``release_memory_occupation`` with the KV cache among its tags (what RL frameworks call between rollouts)
  unmaps every page at once: SGLang flushes the cache, and the memory is back before the call returns.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached_core import KVCacheManager, load_settings
from kvcached_core.pressure import PressureWatch

logger = logging.getLogger(__name__)


class CachePolicy:
    """The policy for one SGLang scheduler whose token pool is elastic (see the module docstring)."""

    def __init__(self, scheduler: Any, kv: KVCacheManager, others: list[KVCacheManager]) -> None:
        settings = load_settings()
        self.scheduler = scheduler
        self.kv, self.managers = kv, [kv, *others]
        self.tokens_per_block = scheduler.token_to_kv_pool_allocator.page_size
        block_bytes = kv.block_bytes * kv.num_buffers  # one block of every layer's buffers
        self.budget_tokens = settings.prefix_cache_bytes // block_bytes * self.tokens_per_block
        self.floor_tokens = settings.prefix_cache_floor_bytes // block_bytes * self.tokens_per_block
        self.watch = PressureWatch(settings, kv.device, self._has_spare)
        self.given_back = 0  # tokens evicted for other engines, for tests and logs
        self._id_traffic = (0, 0)  # what on_idle last logged of the allocator's id_traffic()
        scheduler.token_to_kv_pool_allocator.when_short(self.make_room)
        mamba = getattr(scheduler.req_to_token_pool, "mamba_allocator", None)
        if others and mamba is not None:
            mamba.when_short(lambda _slots: self.tell_others())

    @classmethod
    def of(cls, scheduler: Any) -> CachePolicy | None:
        """The scheduler's policy (made at its first use), or None when its KV cache is not elastic."""
        policy = scheduler.__dict__.get("_kvcached_policy", False)
        if policy is False:
            kv = getattr(scheduler.token_to_kv_pool_allocator, "_manager", None)
            mamba = getattr(getattr(scheduler.req_to_token_pool, "mamba_allocator", None), "_manager", None)
            policy = cls(scheduler, kv, [mamba] if mamba is not None else []) if kv is not None else None
            scheduler.__dict__["_kvcached_policy"] = policy
        return policy

    def _evictable_tokens(self) -> int:
        return self.scheduler.tree_cache.evictable_size()

    def _has_spare(self) -> bool:
        """Watcher thread: whether this engine keeps cache or empty pages it could give back (racy reads of
        sizes are fine: the give-back itself runs on the scheduler's thread)."""
        if self._evictable_tokens() > self.floor_tokens and self.kv.pages_over_cap() != 0:
            return True
        return any(m.has_idle_pages() for m in self.managers)

    def _evict(self, num_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.scheduler.tree_cache.evict(EvictParams(num_tokens=num_tokens))

    def _evict_down_to(self, keep_tokens: int) -> int:
        excess = self._evictable_tokens() - keep_tokens
        if excess <= 0:
            return 0
        self._evict(excess)
        return excess

    def tell_others(self) -> None:
        """This engine is short of memory the device (not its own limit) lacks: tell the other engines."""
        self.watch.report_shortfall(self.kv.physically_short)

    def make_room(self, pages: int) -> None:
        """An allocation of ``pages`` pages that the scheduler counted on waits for memory the device no
        longer has: evict that many tokens of the radix cache (pages this engine holds mapped, so the
        allocation can have them) and tell the other engines."""
        if self._evictable_tokens() > 0:
            self._evict(pages * self.tokens_per_block)
        self.tell_others()

    def on_idle(self) -> None:
        """The scheduler is fully idle: keep the radix cache within its budget, and give back to a short
        neighbour."""
        traffic = self.scheduler.token_to_kv_pool_allocator.id_traffic()
        if traffic != self._id_traffic:
            self._id_traffic = traffic
            logger.info("kvcached: %d page ids reused on their way back, %d allocations waited for the GPU", *traffic)
        if not self.watch.take_pending():
            self._evict_down_to(self.budget_tokens)
            return
        # Under fair share's cap the pages the cache frees stay this engine's (trim_to_cap): evicting then
        # would only lose the cache.
        evicted = self._evict_down_to(self.floor_tokens) if self.kv.pages_over_cap() != 0 else 0
        unmapped = sum(m.trim_to_cap() for m in self.managers)
        self.given_back += evicted
        if evicted or unmapped:
            logger.info(
                "kvcached: gave back %d cached tokens and %d MiB to another engine on this device",
                evicted,
                unmapped >> 20,
            )

    def after_schedule(self) -> None:
        """After the scheduler picked its next batch: if requests still wait for memory the device lacks,
        tell the other engines on it."""
        waiting = self.scheduler.waiting_queue
        if not waiting:
            return
        need = len(waiting[0].origin_input_ids) // self.tokens_per_block + 1
        if self.kv.available_size() < need:
            self.tell_others()

    def release(self) -> int:
        """Unmap every page no block is on (SGLang has flushed its cache); returns the bytes given back."""
        return sum(m.trim() for m in self.managers)

    def close(self) -> None:
        """Stops watching the device."""
        self.watch.close()


def keep_cache_within_budget(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.on_idle``: SGLang's idle housekeeping, then the cache policy's."""
    result = original(scheduler, *args, **kwargs)
    policy = CachePolicy.of(scheduler)
    if policy is not None and scheduler.is_fully_idle():
        policy.on_idle()
    return result


def report_waiting_for_memory(_plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_next_batch_to_run``: requests waiting for memory the device lacks are reported."""
    policy = CachePolicy.of(scheduler)
    if policy is not None:
        policy.after_schedule()


def release_kv_memory(_output: Any, updater: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SchedulerWeightUpdaterManager.release_memory_occupation``: with the KV cache released (its tag
    given, or no tags: everything), the flushed pages are unmapped now rather than after the reclaim window."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    tags = getattr(request, "tags", None)
    policy = CachePolicy.of(updater.scheduler) if updater.scheduler is not None else None
    if policy is not None and (not tags or GPU_MEMORY_TYPE_KV_CACHE in tags):
        policy.release()
