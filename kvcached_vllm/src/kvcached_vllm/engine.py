"""EngineCore side: decide whether vLLM's KV layout can be elastic, and make the scheduler's planner.

vLLM places block ``b`` of layer ``l`` of a ``KVCacheTensor`` at ``offset + l * layer_stride + b *
block_stride`` in one backing buffer. kvcached serves two shapes of it:

- block-outer layouts (every tensor's ``block_stride`` is the whole block): one kvcached buffer whose block is
  vLLM's block of all layers;
- layer-outer layouts with one page size: one kvcached buffer per layer region of ``num_blocks * page``
  bytes. kvcached places buffer ``i`` at ``i * buffer_stride``, a multiple of its physical page, so
  ``num_blocks`` is rounded down until a layer region is a whole number of physical pages.

Anything else keeps vLLM's own buffer (and a warning says so).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcached_core import KVCacheManager, load_settings

from . import runtime

logger = logging.getLogger("vllm.kvcached")  # under vLLM's logger, so its handlers show it

PHYSICAL_PAGE = 2 << 20  # kvcached's default page; KVCACHED_PAGE_BYTES may raise it


@dataclass(frozen=True)
class Geometry:
    """How a vLLM KV cache maps onto one kvcached manager."""

    num_blocks: int
    block_bytes: int
    num_buffers: int
    size: int  # vLLM's backing buffer, bytes


def page_bytes() -> int:
    return load_settings().page_bytes or PHYSICAL_PAGE


def geometry(config: Any, physical_page: int) -> tuple[Geometry | None, str]:
    """The kvcached geometry of ``config`` (a KVCacheConfig), or None and the reason it has none."""
    tensors = config.kv_cache_tensors
    blocks = config.num_blocks
    if not tensors:
        return None, "the model has no KV cache tensors"
    if any(getattr(t, "host_resident", False) for t in tensors):
        return None, "host-resident KV tensors (hisparse) are not elastic"
    size = tensors[0].size
    if size % blocks:
        return None, f"backing size {size} is not a whole number of {blocks} blocks"
    per_block = size // blocks
    if all(t.block_stride == per_block for t in tensors):
        return Geometry(blocks, per_block, 1, size), ""
    pages = {t.block_stride for t in tensors}
    if len(pages) != 1 or any(t.layer_stride != blocks * t.block_stride for t in tensors):
        return None, "layer-outer layout with several page sizes"
    region = blocks * pages.pop()
    if any(t.offset % region for t in tensors):
        return None, "a KV tensor starts inside a layer region"
    if region % physical_page:
        return None, f"a layer region of {region} bytes is not a multiple of the {physical_page}-byte page"
    buffers = max(t.offset // region + len(t.layers) for t in tensors)
    return Geometry(blocks, region // blocks, buffers, size), ""


def aligned_num_blocks(config: Any, physical_page: int) -> int | None:
    """For a layer-outer layout, the largest block count <= vLLM's whose layer region is whole pages."""
    tensors = config.kv_cache_tensors
    if not tensors or any(t.block_stride == t.size // config.num_blocks for t in tensors):
        return None
    page = tensors[0].block_stride
    step = physical_page // math.gcd(physical_page, page)
    aligned = config.num_blocks - config.num_blocks % step
    return aligned if 0 < aligned < config.num_blocks else None


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
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if not name:
        return None
    return str(name).rstrip("/").rsplit("/", 1)[-1][:127]


def planner_device(vllm_config: Any) -> str:
    kind = getattr(vllm_config.device_config, "device_type", "cpu")
    return "cpu" if kind == "cpu" else "cuda:0"


def workers_in_this_process(vllm_config: Any) -> bool:
    """Whether the one worker runs inside EngineCore (vLLM's ``uni`` executor: TP=1 on a GPU by default)."""
    return getattr(vllm_config.parallel_config, "distributed_executor_backend", None) == "uni"


def elastic_kv_cache_configs(original: Callable[..., list], vllm_config: Any, specs: Any, available: list[int]) -> list:
    """AROUND ``get_kv_cache_configs`` (EngineCore): size the KV cache as vLLM does, align the block count
    to whole pages, make the planner, and tell the workers where its page table is."""
    configs = original(vllm_config, specs, available)
    if not configs:
        return configs
    physical_page = page_bytes()
    aligned = aligned_num_blocks(configs[0], physical_page)
    if aligned is not None:
        per_block = configs[0].kv_cache_tensors[0].size // configs[0].num_blocks
        configs = original(vllm_config, specs, [aligned * per_block] * len(available))
    geo, why = geometry(configs[0], physical_page)
    if geo is None:
        logger.warning("kvcached: %s; this engine keeps vLLM's static KV cache", why)
        return configs
    # With the worker in this process the manager maps directly (the direct path); otherwise it only plans
    # and every worker maps what it publishes (DESIGN.md principle 6).
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
        mapped_by_workers=not direct,
    )
    runtime.add_planner(geo.num_blocks, planner)
    for config in configs:
        config.kvcached = {"page_table": planner.page_table_path, "size": geo.size, "direct": direct}
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
