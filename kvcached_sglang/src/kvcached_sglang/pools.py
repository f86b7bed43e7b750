"""Elastic SGLang KV pools: SGLang's own pool classes whose buffers live in kvcached memory.

One kvcached block is one SGLang page (``page_size`` token slots) of one layer's K, V or MLA buffer, so block
ids are SGLang page ids. Block 0 is kvcached's reserved null block: SGLang writes padded and dummy tokens to
page 0, which therefore stays mapped for the pool's life. Buffer addresses never change (SGLang caches every
buffer's ``data_ptr()``), only which of their pages are backed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool

from kvcached_core import KVCacheManager
from kvcached_core.backends import device_name
from kvcached_core.manager import instance_name_for

logger = logging.getLogger(__name__)


def instance_name() -> str | None:
    """The name kvctl/kvtop show for this engine: the served model name (plus the TP rank when TP > 1).

    None outside a running SGLang server (the core then derives ``sglang-<pid>``).
    """
    try:
        from sglang.srt.runtime_context import get_parallel, get_server_args

        args = get_server_args()
        parallel = get_parallel()
        model = getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
        return instance_name_for(model, parallel.tp_rank if getattr(parallel, "tp_size", 1) > 1 else None)
    except Exception:  # no server context (a pool built outside a server): fall back to the default name
        return None


def elastic_buffers(
    pool: object, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, pool_name: str
) -> tuple[KVCacheManager, list[list[torch.Tensor]]] | None:
    """A manager for ``pool`` and views ``result[layer][i]`` of ``shapes[i]`` over its memory.

    Each shape leads with token slots or pages, so page ``p`` of SGLang's pool is one contiguous run that
    starts at ``p * block_bytes`` in every buffer. Returns None (the caller keeps SGLang's own buffers) when
    the buffers cannot be cut into equal per-page blocks, e.g. K and V rows of different sizes.
    """
    page_size, rows = pool.page_size, pool.size + pool.page_size
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    if any(size * page_size % rows for size in sizes) or len({size * page_size // rows for size in sizes}) != 1:
        logger.warning(
            "kvcached: %s buffers %s do not split into equal per-page blocks; this pool keeps SGLang's static buffers",
            type(pool).__name__,
            list(shapes),
        )
        return None
    manager = KVCacheManager(
        num_blocks=-(-rows // page_size),
        block_bytes=sizes[0] * page_size // rows,
        num_layers=pool.layer_num,
        num_kv_buffers=len(shapes),
        device=device_name(pool.device),
        pool_name=pool_name,
        name=instance_name(),
        engine="sglang",
        reserve_null_block=True,
    )
    views = [
        [
            manager.buffer(layer, i)[:size].view(dtype).view(shape)
            for i, (shape, size) in enumerate(zip(shapes, sizes, strict=True))
        ]
        for layer in range(pool.layer_num)
    ]
    return manager, views


class ElasticMHATokenToKVPool(MHATokenToKVPool):
    """SGLang's MHA pool (pool_name ``mha``) with per-layer K and V buffers in kvcached memory.

    Replaces ``sglang.srt.mem_cache.memory_pool.MHATokenToKVPool``. Only the unquantized
    NHD/HND buffers become elastic; other layouts keep SGLang's buffers (and its allocator then behaves as
    SGLang's own).
    """

    kvcached_manager: KVCacheManager | None = None

    def _create_buffers_normal(self) -> None:
        made = None
        if getattr(self, "kv_cache_layout", None) != "vectorized_5d":
            made = elastic_buffers(self, self._kv_buffer_shapes(), self.store_dtype, "mha")
        if made is None:
            super()._create_buffers_normal()
            return
        # K and V are separate buffers here, not SGLang's fused (2, rows, ...) allocation: kernels that want
        # V at a block offset from K copy instead (SGLang logs that on the paths that care).
        self.kvcached_manager, views = made
        self.k_buffer = [layer[0] for layer in views]
        self.v_buffer = [layer[1] for layer in views]

    def _clear_buffers(self) -> None:
        super()._clear_buffers()
        close_manager(self)


class ElasticMLATokenToKVPool(MLATokenToKVPool):
    """SGLang's MLA pool (pool_name ``mla``) with its per-layer latent buffer in kvcached memory.

    Replaces ``sglang.srt.mem_cache.memory_pool.MLATokenToKVPool``.
    """

    kvcached_manager: KVCacheManager | None = None

    def _create_buffers(self) -> None:
        shape = (self.size + self.page_size, 1, self.kv_cache_dim)
        made = elastic_buffers(self, [shape], self.store_dtype, "mla")
        if made is None:
            super()._create_buffers()
            return
        self.kvcached_manager, views = made
        self.kv_buffer = [layer[0] for layer in views]

    def _clear_buffers(self) -> None:
        super()._clear_buffers()
        close_manager(self)


class ElasticMambaPool(MambaPool):
    """SGLang's Mamba state pool (pool_name ``mamba``) with every slot's state in kvcached memory.

    Replaces ``sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.mamba_pool_cls`` (the patch unit states
    the releases; :class:`ElasticMambaPoolPageMajor` serves the earlier ones). The states use SGLang's own
    slot-major envelope layout (one entry holds a slot's conv and temporal state of every layer), so one
    kvcached block is one slot and slot 0, SGLang's dummy slot, is the reserved null block. Speculative
    decoding and ReplaySSM add per-slot scratch outside that entry: with either, the pool keeps SGLang's
    buffers.
    """

    kvcached_manager: KVCacheManager | None = None
    # Cached per-layout facts that SGLang computes from the states: dropped when the states move.
    _LAYOUT_CACHES = ("_conv_fuse_ok", "_conv_slot_desc", "_layer_cache_by_id")

    @staticmethod
    def entry_layout() -> tuple[Callable[..., Any], Callable[..., int]]:
        """SGLang's envelope helpers: (views over a raw buffer, bytes of one slot's entry)."""
        from sglang.srt.mem_cache.layout.token_major import build_mamba_entry_views, mamba_entry_bytes

        return build_mamba_entry_views, mamba_entry_bytes

    def __init__(self, **kwargs: Any) -> None:
        plain = not (
            kwargs.get("speculative_num_draft_tokens") is not None
            or kwargs.get("enable_linear_replayssm")
            or kwargs.get("enable_linear_replayssm_spec")
            or kwargs.get("enable_gdn_replayssm_spec")  # its name in 0.5.16
        )
        if not plain:
            super().__init__(**kwargs)
            return
        size, params = kwargs["size"], kwargs["cache_params"]
        # SGLang builds a one-slot envelope (no real memory); its states then move onto kvcached memory.
        super().__init__(**dict(kwargs, size=0, envelope_layout=True))
        geometry = dict(
            layer_num=len(kwargs["mamba_layer_ids"]),
            conv_state_shapes=params.shape.conv,
            conv_dtype=params.dtype.conv,
            temporal_state_shape=params.shape.temporal,
            temporal_dtype=params.dtype.temporal,
        )
        build_views, entry_bytes = self.entry_layout()
        entry = entry_bytes(**geometry)
        manager = KVCacheManager(
            num_blocks=size + 1,
            block_bytes=entry,
            num_layers=1,
            num_kv_buffers=1,
            device=device_name(self.device),
            pool_name="mamba",
            name=instance_name(),
            engine="sglang",
            reserve_null_block=True,
        )
        self._raw = manager.buffer(0, 0)[: (size + 1) * entry]
        conv, temporal = build_views(self._raw, max_slots=size + 1, **geometry)
        self.mamba_cache = dataclasses.replace(self.mamba_cache, conv=conv, temporal=temporal)
        for name in self._LAYOUT_CACHES:
            self.__dict__.pop(name, None)
        self.size = size
        self.mem_usage = (size + 1) * entry / (1 << 30)
        self.kvcached_manager = manager
        logger.info("kvcached: Mamba state pool of %d slots x %d bytes is elastic", size, entry)


class ElasticMambaPoolPageMajor(ElasticMambaPool):
    """:class:`ElasticMambaPool` for SGLang 0.5.16 to 0.5.21, whose envelope helpers (the same layout) are
    named in ``sglang.srt.mem_cache.layout.page_major``."""

    @staticmethod
    def entry_layout() -> tuple[Callable[..., Any], Callable[..., int]]:
        """SGLang's builder of a slot's state views and its entry size, from where these releases keep them."""
        from sglang.srt.mem_cache.layout.page_major import build_page_major_mamba_views, mamba_entry_bytes

        return build_page_major_mamba_views, mamba_entry_bytes


def close_manager(pool: object) -> None:
    """Unmap and release a pool's kvcached memory (after SGLang dropped its views of it)."""
    manager = getattr(pool, "kvcached_manager", None)
    if manager is not None:
        pool.kvcached_manager = None
        manager.close()
