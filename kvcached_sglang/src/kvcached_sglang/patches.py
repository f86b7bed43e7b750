"""Every SGLang symbol the plugin touches, as named patch units, each for the SGLang releases it fits
(0.5.16 to 0.5.23; where SGLang changed a symbol between releases, one unit per range).

Importing this module imports SGLang's pool and allocator modules (the classes below subclass them).
"""

from __future__ import annotations

from kvcached_core.patches import Patch, Releases, Uses

from .allocators import (
    ElasticPagedTokenToKVPoolAllocator,
    ElasticPagedTokenToKVPoolAllocatorInlineFree,
    ElasticTokenToKVPoolAllocator,
    ElasticTokenToKVPoolAllocatorFlagGroups,
    use_elastic_mamba_allocator,
)
from .cache_policy import keep_cache_within_budget, release_kv_memory, report_waiting_for_memory
from .capacity import (
    check_full_pool_logically,
    check_mamba_pool_logically,
    free_memory_with_elastic_peers,
    hold_activation_peak,
    profile_virtual_capacity,
)
from .pools import ElasticMambaPool, ElasticMambaPoolPageMajor, ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

_POOLS = "sglang.srt.mem_cache.memory_pool"
_ALLOC = "sglang.srt.mem_cache.allocator"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
_LAYOUT = "sglang.srt.mem_cache.layout"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

# Where SGLang changed what the plugin relies on:
PAGED_FREE_INLINE = Releases("0.5.16", "0.5.17")  # paged free() puts pages back itself
PAGE_RELEASE = Releases("0.5.17", "0.5.24")  # every paged free ends in _release_page_ids
FLAG_GROUPS = Releases("0.5.16", "0.5.19")  # free groups marked by is_not_in_free_group
NONE_GROUPS = Releases("0.5.19", "0.5.24")  # free_group is None outside a group
PAGE_MAJOR = Releases("0.5.16", "0.5.22")  # Mamba envelope helpers in layout.page_major
TOKEN_MAJOR = Releases("0.5.22", "0.5.24")  # ... in layout.token_major

PATCHES: tuple[Patch, ...] = (
    Patch(
        "mha-pool",
        f"{_POOLS}.MHATokenToKVPool",
        "replace",
        ElasticMHATokenToKVPool,
        "MHA K/V buffers in kvcached memory (pool_name mha)",
    ),
    Patch(
        "mla-pool",
        f"{_POOLS}.MLATokenToKVPool",
        "replace",
        ElasticMLATokenToKVPool,
        "MLA latent buffers in kvcached memory (pool_name mla)",
    ),
    Patch(
        "token-allocator",
        f"{_ALLOC}.token.TokenToKVPoolAllocator",
        "replace",
        ElasticTokenToKVPoolAllocatorFlagGroups,
        "page_size 1: slots come from kvcached, availability is physical",
        releases=FLAG_GROUPS,
    ),
    Patch(
        "token-allocator",
        f"{_ALLOC}.token.TokenToKVPoolAllocator",
        "replace",
        ElasticTokenToKVPoolAllocator,
        "page_size 1: slots come from kvcached, availability is physical",
        releases=NONE_GROUPS,
    ),
    Patch(
        "paged-allocator",
        f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator",
        "replace",
        ElasticPagedTokenToKVPoolAllocatorInlineFree,
        "pages come from kvcached, availability is physical",
        releases=PAGED_FREE_INLINE,
    ),
    Patch(
        "paged-allocator",
        f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator",
        "replace",
        ElasticPagedTokenToKVPoolAllocator,
        "pages come from kvcached, availability is physical",
        releases=PAGE_RELEASE,
    ),
    Patch(
        "virtual-capacity",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
        "around",
        profile_virtual_capacity,
        "marks SGLang's KV budget profiling",
    ),
    Patch(
        "free-memory",
        "sglang.srt.utils.common.get_available_gpu_memory",
        "around",
        free_memory_with_elastic_peers,
        "while profiling: memory other kvcached engines hold counts as free",
    ),
    Patch(
        "activation-reserve",
        f"{_SCHEDULER}.init_model_worker",
        "after",
        hold_activation_peak,
        "at the end of start-up, torch keeps the activation peak cached (other engines' KV cannot take it)",
    ),
    Patch(
        "mamba-pool",
        f"{_POOLS}.HybridReqToTokenPool.mamba_pool_cls",
        "replace",
        ElasticMambaPoolPageMajor,
        "Mamba states in kvcached memory (pool_name mamba)",
        releases=PAGE_MAJOR,
    ),
    Patch(
        "mamba-pool",
        f"{_POOLS}.HybridReqToTokenPool.mamba_pool_cls",
        "replace",
        ElasticMambaPool,
        "Mamba states in kvcached memory (pool_name mamba)",
        releases=TOKEN_MAJOR,
    ),
    Patch(
        "mamba-allocator",
        f"{_POOLS}.HybridReqToTokenPool._init_mamba_pool",
        "after",
        use_elastic_mamba_allocator,
        "Mamba slots come from kvcached",
    ),
    Patch(
        "idle-check",
        f"{_CHECKER}._check_full_pool",
        "around",
        check_full_pool_logically,
        "idle leak check counts unmapped free pages as free",
    ),
    Patch(
        "idle-check-mamba",
        f"{_CHECKER}._check_mamba_pool",
        "around",
        check_mamba_pool_logically,
        "idle leak check counts unmapped free Mamba slots as free",
    ),
    Patch(
        "idle-cache-budget",
        f"{_SCHEDULER}.on_idle",
        "around",
        keep_cache_within_budget,
        "an idle engine keeps KVCACHED_PREFIX_CACHE_BYTES of radix cache mapped, gives back under pressure",
    ),
    Patch(
        "report-shortfall",
        f"{_SCHEDULER}.get_next_batch_to_run",
        "after",
        report_waiting_for_memory,
        "requests waiting for memory the device lacks ask other engines to give back",
    ),
    Patch(
        "release-kv-memory",
        "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
        ".release_memory_occupation",
        "after",
        release_kv_memory,
        "release_memory_occupation unmaps the flushed KV pages at once",
    ),
)

# Engine symbols the plugin relies on without patching them: checked at load like the targets.
USED_SYMBOLS: tuple[str | Uses, ...] = (
    "sglang.srt.plugins.hook_registry.HookRegistry.register",
    f"{_POOLS}.MHATokenToKVPool._create_buffers_normal",
    f"{_POOLS}.MHATokenToKVPool._kv_buffer_shapes",
    f"{_POOLS}.MHATokenToKVPool._clear_buffers",
    f"{_POOLS}.MLATokenToKVPool._create_buffers",
    f"{_POOLS}.MLATokenToKVPool._clear_buffers",
    Uses(f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator._release_page_ids", PAGE_RELEASE),
    f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator.alloc_extend",
    f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator.alloc_decode",
    f"{_ALLOC}.base.BaseTokenToKVPoolAllocator.free_group_begin",
    f"{_ALLOC}.mamba.MambaSlotAllocator._do_alloc",
    f"{_POOLS}.MambaPool._conv_fuse_ok",
    f"{_POOLS}.MambaPool._conv_slot_desc",
    Uses(f"{_LAYOUT}.page_major.build_page_major_mamba_views", PAGE_MAJOR),
    Uses(f"{_LAYOUT}.page_major.mamba_entry_bytes", PAGE_MAJOR),
    Uses(f"{_LAYOUT}.token_major.build_mamba_entry_views", TOKEN_MAJOR),
    Uses(f"{_LAYOUT}.token_major.mamba_entry_bytes", TOKEN_MAJOR),
    "sglang.srt.utils.get_num_new_pages",
    "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats",
    f"{_SCHEDULER}.is_fully_idle",
    "sglang.srt.mem_cache.base_prefix_cache.EvictParams",
    "sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE",
)
