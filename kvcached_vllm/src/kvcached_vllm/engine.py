"""EngineCore side: decide whether vLLM's KV layout can be elastic, and make the scheduler's planner.

vLLM's KV backing changed shape across releases, so each release range has its own :class:`BackingRule`:

- 0.29 on (:data:`FLAT`): one backing buffer; layer ``l``'s block ``b`` of a ``KVCacheTensor`` is at
  ``offset + l * layer_stride + b * block_stride``. Block-outer layouts (every ``block_stride`` is the whole
  block) are one kvcached buffer whose block is vLLM's block of all layers; layer-outer layouts with one page
  size are one kvcached buffer per layer region of ``num_blocks * page`` bytes. kvcached places buffer ``i``
  at ``i * buffer_stride``, a multiple of its physical page, so ``num_blocks`` is rounded down until a layer
  region is a whole number of physical pages.
- 0.26 to 0.28 (:data:`PER_TENSOR`): one backing buffer per ``KVCacheTensor`` (each the same size: one
  kvcached buffer each), or one packed block-outer buffer that every tensor shares (one kvcached buffer).

Anything else keeps vLLM's own buffer (and a warning says so).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcached_core import KVCacheManager
from kvcached_core.backends import cuda_device
from kvcached_core.manager import instance_name_for, page_bytes_for

from . import runtime
from .block_pool import ElasticBlockPool, ElasticBlockPoolBeforeReuseWatchers, ElasticBlockPoolWeakOwner

# Checked per call: no isinstance walk.
ELASTIC_POOLS = (ElasticBlockPool, ElasticBlockPoolBeforeReuseWatchers, ElasticBlockPoolWeakOwner)

logger = logging.getLogger("vllm.kvcached")  # under vLLM's logger, so its handlers show it


@dataclass(frozen=True)
class Geometry:
    """How a vLLM KV cache maps onto one kvcached manager."""

    num_blocks: int
    block_bytes: int
    num_buffers: int
    size: int  # bytes of each backing buffer vLLM allocates
    backings: int  # how many backing buffers vLLM allocates: 1 (kvcached's flat buffer) or num_buffers


def flat_geometry(config: Any, physical_page: int) -> tuple[Geometry | None, str]:
    """vLLM 0.29 on: the kvcached geometry of ``config`` (a KVCacheConfig), or None and the reason."""
    tensors = config.kv_cache_tensors
    blocks = config.num_blocks
    if any(getattr(t, "host_resident", False) for t in tensors):
        return None, "host-resident KV tensors (hisparse) are not elastic"
    size = tensors[0].size
    if size % blocks:
        return None, f"backing size {size} is not a whole number of {blocks} blocks"
    per_block = size // blocks
    if all(t.block_stride == per_block for t in tensors):
        return Geometry(blocks, per_block, 1, size, 1), ""
    pages = {t.block_stride for t in tensors}
    if len(pages) != 1 or any(t.layer_stride != blocks * t.block_stride for t in tensors):
        return None, "layer-outer layout with several page sizes"
    region = blocks * pages.pop()
    if any(t.offset % region for t in tensors):
        return None, "a KV tensor starts inside a layer region"
    if region % physical_page:
        return None, f"a layer region of {region} bytes is not a multiple of the {physical_page}-byte page"
    buffers = max(t.offset // region + len(t.layers) for t in tensors)
    return Geometry(blocks, region // blocks, buffers, size, 1), ""


def flat_aligned_num_blocks(config: Any, physical_page: int) -> int | None:
    """vLLM 0.29 on, layer-outer layouts: the largest block count <= vLLM's whose layer region is whole pages."""
    tensors = config.kv_cache_tensors
    if not tensors or any(t.block_stride == t.size // config.num_blocks for t in tensors):
        return None
    page = tensors[0].block_stride
    step = physical_page // math.gcd(physical_page, page)
    aligned = config.num_blocks - config.num_blocks % step
    return aligned if 0 < aligned < config.num_blocks else None


def per_tensor_geometry(config: Any, physical_page: int) -> tuple[Geometry | None, str]:
    """vLLM 0.26 to 0.28: the kvcached geometry of ``config``, or None and the reason."""
    tensors = config.kv_cache_tensors
    blocks = config.num_blocks
    if any(t.block_stride for t in tensors):  # packed: every tensor aliases one block-outer backing
        stride, size = tensors[0].block_stride, tensors[0].size
        if any(t.block_stride != stride or t.size != size for t in tensors) or size != stride * blocks:
            return None, "packed KV tensors of several block strides"
        return Geometry(blocks, stride, 1, size, 1), ""
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        return None, "KV tensors of several sizes (layers with different page sizes)"
    size = sizes.pop()
    if size % blocks:
        return None, f"KV tensor size {size} is not a whole number of {blocks} blocks"
    return Geometry(blocks, size // blocks, len(tensors), size, len(tensors)), ""


def buffer_bytes(config: Any) -> int:
    """Bytes of one kvcached buffer of ``config``: a layer region (layer-outer: blocks x block stride) or a
    whole backing tensor (one per layer, or one block-outer backing), whatever the release's layout."""
    tensor = config.kv_cache_tensors[0]
    stride = getattr(tensor, "block_stride", 0)
    return config.num_blocks * stride if stride else tensor.size


@dataclass(frozen=True)
class BackingRule:
    """How one range of vLLM releases lays out the KV backing: its geometry and block-count alignment."""

    geometry: Callable[[Any, int], tuple[Geometry | None, str]]
    aligned_num_blocks: Callable[[Any, int], int | None]


FLAT = BackingRule(flat_geometry, flat_aligned_num_blocks)
PER_TENSOR = BackingRule(per_tensor_geometry, lambda config, page: None)  # each tensor is its own buffer


def pool_name(config: Any) -> str:
    """``mla`` for MLA models, ``mha`` for other attention, ``mamba`` for state-only models."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    specs = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs += list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    if any(isinstance(s, MLAAttentionSpec) for s in specs):
        return "mla"
    if any(isinstance(s, AttentionSpec) for s in specs):
        return "mha"
    return "mamba"


def instance_name(vllm_config: Any) -> str | None:
    """The name kvctl/kvtop show for this engine: its (first) served model name."""
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return instance_name_for(name)


def planner_device(vllm_config: Any) -> str:
    """Where EngineCore's planner plans: the host, or the first GPU of this engine (each worker maps on its own)."""
    kind = getattr(vllm_config.device_config, "device_type", "cpu")
    return "cpu" if kind == "cpu" else cuda_device(0)


def workers_in_this_process(vllm_config: Any) -> bool:
    """Whether the one worker runs inside EngineCore (vLLM's ``uni`` executor: TP=1 on a GPU by default)."""
    return getattr(vllm_config.parallel_config, "distributed_executor_backend", None) == "uni"


def elastic_kv_cache_configs(
    rule: BackingRule, original: Callable[..., list], vllm_config: Any, specs: Any, available: list[int], *rest: Any
) -> list:
    """AROUND ``get_kv_cache_configs`` (EngineCore), with ``rule`` bound per release range: size the KV cache
    as vLLM does, align the block count to whole pages, make the planner, and tell the workers about it.
    ``rest``: what follows the memory list (0.33 on, the global KV cache groups), passed on unchanged."""
    configs = original(vllm_config, specs, available, *rest)
    if not configs or not configs[0].kv_cache_tensors:
        return configs
    physical_page = page_bytes_for(device=planner_device(vllm_config), buffer_bytes=buffer_bytes(configs[0]))
    aligned = rule.aligned_num_blocks(configs[0], physical_page)
    if aligned is not None:
        per_block = configs[0].kv_cache_tensors[0].size // configs[0].num_blocks
        configs = original(vllm_config, specs, [aligned * per_block] * len(available), *rest)
    geo, why = rule.geometry(configs[0], physical_page)
    if geo is None:
        logger.warning("kvcached: %s; this engine keeps vLLM's static KV cache", why)
        return configs
    # With the worker in this process the manager maps directly (the direct path); otherwise it only plans
    # and every worker maps what it publishes (docs/architecture.md, "Planner and workers").
    direct = workers_in_this_process(vllm_config)
    planner = KVCacheManager(
        num_blocks=geo.num_blocks,
        block_bytes=geo.block_bytes,
        num_layers=geo.num_buffers,
        num_kv_buffers=1,
        device=planner_device(vllm_config),
        pool_name=pool_name(configs[0]),
        name=instance_name(vllm_config),
        engine="vllm",
        reserve_null_block=True,
        page_bytes=physical_page,  # the page the block count was aligned to
        mapped_by_workers=not direct,
    )
    runtime.add_planner(geo.num_blocks, planner)
    for config in configs:
        config.kvcached = {"page_table": planner.page_table_path, "backings": geo.backings, "direct": direct}
    logger.info(
        "kvcached: %d KV blocks of %d bytes in %d buffers are elastic (pool %s, instance %s, %s)",
        geo.num_blocks,
        geo.block_bytes,
        geo.num_buffers,
        planner.pool_name,
        planner.name,
        "mapped in this process" if direct else "mapped by each worker",
    )
    return configs


def allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    """WRAPS vLLM's ``KVCacheManager.allocate_slots`` (called per request and step, hence a ``wrap`` unit):
    its free-block check maps the blocks it then takes (:meth:`ElasticBlockPool.get_num_free_blocks`); when
    the scheduler cannot get blocks because the device is full, tell the other engines on it (they give
    back cached prefix blocks). While fair share caps admissions (``admit_cap``), a request with nothing
    computed yet (a new or a preempted one) is refused as when blocks run out: it waits in vLLM's queue. With
    ``KVCACHED_BLOCK_PLACEMENT=request`` the pool learns which request it allocates for (``requester``)."""

    def allocate_slots(manager: Any, *args: Any, **kwargs: Any) -> Any:
        pool = manager.block_pool
        if type(pool) not in ELASTIC_POOLS or pool._manager is None:
            return original(manager, *args, **kwargs)
        request = args[0] if args else kwargs["request"]
        if pool._manager.admit_cap is not None:
            # The request first: a running one passes without reading the allocator's state.
            if request.num_computed_tokens == 0 and not pool._manager.admits_new_requests():
                return None  # its own cap, not the device: no shortfall to report
        if pool._manager.places_by_request:
            pool.requester = (manager.coordinator, request.request_id)
        pool.checking = True
        try:
            blocks = original(manager, *args, **kwargs)
        finally:
            pool.checking = False
            pool.planned = 0
            pool.requester = None
        if blocks is None:
            watch = runtime.pressure_watch()
            if watch is not None:
                watch.report_shortfall()
        return blocks

    return allocate_slots


def note_planned_blocks(coordinator: Any, num_blocks: int) -> None:
    """AFTER ``KVCacheCoordinator.get_num_blocks_to_allocate`` (per request and step, with nine keyword
    arguments, hence an ``after`` unit): the elastic pool learns how many blocks ``allocate_slots`` is about
    to check for and take."""
    pool = coordinator.block_pool
    if type(pool) in ELASTIC_POOLS and pool.checking:  # other callers only estimate
        pool.planned = num_blocks


def scheduler_turn(original: Callable[..., Any], engine: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EngineCoreProc._handle_client_request``: on the scheduler's thread, before a client request
    (or the pressure watch's wake-up), give back cached prefix blocks another engine needs."""
    watch = runtime.pressure_watch()
    if watch is not None:
        watch.engine = engine
        watch.run_pending()
    return original(engine, *args, **kwargs)


def close_before_shutdown(original: Callable[..., Any], engine: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EngineCore.shutdown``: close this EngineCore's planners (their segments and page tables go)
    first. Its loop has stopped, so no step is in flight (and closing fences the device before it unmaps);
    vLLM's own teardown can outlast the client's patience and end in SIGKILL, which would leave them."""
    runtime.close_all()
    return original(engine, *args, **kwargs)


def vllm_extensible_cache_off(original: Callable[..., str | None], executor: Any, *args: Any) -> str | None:
    """AROUND ``Executor.extensible_kv_cache_unsupported_reason`` (0.34 on): a reason, always, so EngineCore
    turns vLLM's own extensible KV cache off on every worker before profiling, as it does where that cache
    cannot run. On by default on CUDA, it reserves the KV cache's address range itself, commits it after
    warm-up and then cuts the block count below the one kvcached planned for: the KV cache is kvcached's."""
    return original(executor, *args) or "kvcached maps the KV cache's memory itself (kvcached-vllm)"


kv_cache_configs_flat = functools.partial(elastic_kv_cache_configs, FLAT)
kv_cache_configs_per_tensor = functools.partial(elastic_kv_cache_configs, PER_TENSOR)
