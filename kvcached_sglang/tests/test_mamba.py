"""Elastic Mamba state pool: SGLang's own HybridReqToTokenPool, MambaPool and slot allocator (as the plugin
replaces them) on CPU with real kvcached memory. Nothing is faked."""

from __future__ import annotations

import torch
from conftest import elastic_class, needs_cpu_spec_scratch

MiB = 1 << 20


def make_hybrid_req_pool(mamba_size: int = 16, **extra):
    """A HybridReqToTokenPool built with the arguments SGLang's KVCacheConfigurator passes, for a two-layer
    Mamba2 model whose per-slot state (~1 MiB) spans about one 2 MiB page."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=256, n_groups=1, num_heads=32, head_dim=64, state_size=64, conv_kernel=4
    )
    params = Mamba2CacheParams(
        shape=shape, layers=[0, 1], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    kwargs = dict(
        size=8,
        mamba_size=mamba_size,
        mamba_spec_state_size=8,
        max_context_len=128,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=[0, 1],
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=None,
        enable_overlap_schedule=False,
    )
    return HybridReqToTokenPool(**dict(kwargs, **extra))


def test_mamba_pool_is_elastic(sglang_loaded):
    from kvcached_sglang.allocators import ElasticMambaSlotAllocator
    from kvcached_sglang.pools import close_manager

    req_pool = make_hybrid_req_pool()
    pool, slots = req_pool.mamba_pool, req_pool.mamba_allocator
    try:
        assert type(pool) is elastic_class("mamba-pool") and type(slots) is ElasticMambaSlotAllocator
        mgr = pool.kvcached_manager
        assert mgr.pool_name == "mamba" and pool.size == 16
        state = pool.mamba_cache
        assert state.temporal.shape == (2, 17, 32, 64, 64) and state.conv[0].shape[:2] == (2, 17)
        floor = mgr.snapshot()["mapped_bytes"]

        got = slots.alloc(8)
        assert got is not None and 0 not in got.tolist() and slots.logical_available_size() == 8
        assert mgr.snapshot()["mapped_bytes"] >= floor + 8 * MiB
        # Write every slot's state through SGLang's views, then check no slot touched another.
        for i, slot in enumerate(got.tolist()):
            state.temporal[:, slot] = float(i + 1)
            state.conv[0][:, slot] = float(-(i + 1))
        for i, slot in enumerate(got.tolist()):
            assert torch.all(state.temporal[:, slot] == i + 1) and torch.all(state.conv[0][:, slot] == -(i + 1))
        pool.clear_slots(got[:2])  # SGLang zeroes a slot before a new request uses it
        assert torch.all(state.temporal[:, got[0]] == 0) and torch.all(state.temporal[:, got[2]] == 3)

        assert slots.free_slots.numel() == 8 and not set(slots.free_slots.tolist()) & set(got.tolist())
        slots.free(got)
        mgr.trim()
        assert mgr.snapshot()["mapped_bytes"] == floor and slots.logical_available_size() == 16
    finally:
        close_manager(pool)


def test_mamba_exhaustion_is_a_none(sglang_loaded):
    from kvcached_sglang.pools import close_manager

    req_pool = make_hybrid_req_pool(mamba_size=64)
    pool, slots = req_pool.mamba_pool, req_pool.mamba_allocator
    try:
        pool.kvcached_manager.set_memory_limit(10 * 2 * MiB)  # ten pages, one of them the dummy slot's
        available = slots.available_size()
        assert 0 < available < 64
        held = slots.alloc(available)
        assert held is not None and slots.alloc(1) is None
        slots.free(held)
    finally:
        close_manager(pool)


@needs_cpu_spec_scratch
def test_speculative_decoding_keeps_sglang_state(sglang_loaded):
    """Speculative scratch lives outside the per-slot entry: that pool stays SGLang's own."""
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    from kvcached_sglang.allocators import ElasticMambaSlotAllocator

    req_pool = make_hybrid_req_pool(mamba_size=4, speculative_num_draft_tokens=2)
    assert req_pool.mamba_pool.kvcached_manager is None
    assert type(req_pool.mamba_allocator) is MambaSlotAllocator
    assert not isinstance(req_pool.mamba_allocator, ElasticMambaSlotAllocator)
