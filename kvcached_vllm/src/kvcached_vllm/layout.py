"""``KVCACHED_KV_LAYOUT=block-outer``: ask vLLM to lay every layer's K and V of a block side by side.

Why: kvcached maps and gives back memory a page at a time in every buffer. With vLLM's own layout (one buffer
per layer) a page of each of L buffers moves together, so the unit of growth and give-back is L pages (a
32 MiB page on a 32-layer model: 1 GiB). With the block-outer layout the KV cache is one buffer whose block
holds all layers, so the unit is one page (32 MiB) at the same bandwidth: the driver charges per page, not
per byte. vLLM supports the layout for attention backends that read KV through the block stride (e.g.
FlashAttention; its CPU backend does not), and lays out DeepSeek V4 that way by default:

- 0.26-0.28: its packed layout (``_use_packed_kv_cache_config``), one packed backing every layer aliases;
- 0.29 on: a block-outermost ``KVCacheLayout`` chosen by ``resolve_kv_cache_layout`` among the layouts every
  worker supports (``VLLM_KV_CACHE_LAYOUT`` or a layout already on the cache config still wins).

Where the layout is unavailable the engine keeps vLLM's layout and one warning says why.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from kvcached_core import load_settings

logger = logging.getLogger("vllm.kvcached")


def wants_block_outer() -> bool:
    """Whether ``KVCACHED_KV_LAYOUT`` asks for the block-outer layout."""
    return load_settings().kv_layout == "block-outer"


@functools.cache
def _keeping_vllm_layout(why: str) -> None:
    logger.warning("kvcached: KVCACHED_KV_LAYOUT=block-outer, but %s; keeping vLLM's KV layout", why)


def reads_by_block_stride(spec: Any) -> bool:
    """Whether every attention layer of ``spec`` (a group's KV cache spec) reads its KV through the block
    stride, as the block-outer layout needs. Other specs (Mamba state, ...) do not."""
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(reads_by_block_stride(s) for s in spec.kv_cache_specs.values())
    return isinstance(spec, AttentionSpec) and bool(spec.indexes_kv_by_block_stride)


def packed_when_block_outer(original: Callable[..., bool], vllm_config: Any, kv_cache_groups: list) -> bool:
    """AROUND ``kv_cache_utils._use_packed_kv_cache_config`` (0.26-0.28): with ``KVCACHED_KV_LAYOUT=block-outer``,
    vLLM's packed layout for every model whose attention layers all read KV by block stride (vLLM's own rule
    picks it for DeepSeek V4 and for multi-group models with cross-layer blocks)."""
    packed = original(vllm_config, kv_cache_groups)
    if packed or not kv_cache_groups or not wants_block_outer():
        return packed
    if all(reads_by_block_stride(group.kv_cache_spec) for group in kv_cache_groups):
        return True
    _keeping_vllm_layout("an attention backend here reads KV per layer (not by block stride)")
    return False


def _block_outermost(name: str) -> bool:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout.__members__.get(name)
    return layout is not None and layout.is_block_outermost


def prefer_block_outer(
    original: Callable[..., Any], vllm_config: Any, supported_layouts: list, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``resolve_kv_cache_layout`` (0.29 on): with ``KVCACHED_KV_LAYOUT=block-outer``, and neither
    ``VLLM_KV_CACHE_LAYOUT`` nor the cache config naming a layout, resolve among the block-outermost layouts
    every worker supports (vLLM's own checks still apply); otherwise, or if they fail, as vLLM would."""
    chosen_elsewhere = vllm_config.cache_config.kv_cache_layout is not None or os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if wants_block_outer() and not chosen_elsewhere:
        outer = [[name for name in names if _block_outermost(name)] for names in supported_layouts]
        if outer and all(outer):
            try:
                return original(vllm_config, outer, *args, **kwargs)
            except ValueError as exc:  # e.g. specs this layout cannot serve: vLLM's own choice below
                _keeping_vllm_layout(f"vLLM refused a block-outer layout ({exc})")
        else:
            offered = supported_layouts[0] if supported_layouts else []
            _keeping_vllm_layout(f"no layout the workers support is block-outer ({', '.join(offered)})")
    return original(vllm_config, supported_layouts, *args, **kwargs)
