"""Elastic pools and allocators: SGLang's own pool and allocator classes (as the plugin replaces them), real
kvcached memory on the host backend. Nothing is faked."""

from __future__ import annotations

import gc
import random
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import elastic_class, make_mha_pool, make_paged_allocator, needs_cpu_paged_layout, rss_bytes, track

MiB = 1 << 20


def settle(read, want, timeout: float = 2.0):
    """``read()`` once it returns ``want`` (figures that follow the device are refreshed in the background)."""
    deadline = time.monotonic() + timeout
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == want
    return got


def steady(read, quiet: float = 0.1, timeout: float = 3.0):
    """``read()`` once it has not changed for ``quiet`` seconds: what earlier tests' pools give back to the
    shared host budget as they are collected moves it."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        if (got := read()) != last:
            last, since = got, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return got
    raise AssertionError(f"{read} still moving after {timeout} s")


class Requests:
    """Drives an allocator the way SGLang's scheduler does (extend, then decode) and checks what it gets."""

    def __init__(self, pool, allocator):
        self.pool, self.alloc, self.ps = pool, allocator, allocator.page_size
        self.locs: dict[int, list[int]] = {}
        self.next_id = 1

    def extend(self, rids: list[int], new_tokens: list[int]) -> bool:
        prefix = torch.tensor([len(self.locs.get(r, [])) for r in rids])
        seq = prefix + torch.tensor(new_tokens)
        last = torch.tensor([self.locs[r][-1] if self.locs.get(r) else -1 for r in rids])
        out = self.alloc.alloc_extend(prefix, prefix, seq, seq, last, int(sum(new_tokens)))
        if out is None:
            return False
        start = 0
        for r, n in zip(rids, new_tokens, strict=True):
            self._append(r, out[start : start + n].tolist())
            start += n
        return True

    def decode(self, rids: list[int]) -> bool:
        seq = torch.tensor([len(self.locs[r]) + 1 for r in rids])
        last = torch.tensor([self.locs[r][-1] for r in rids])
        out = self.alloc.alloc_decode(seq, seq, last)
        if out is None:
            return False
        for r, loc in zip(rids, out.tolist(), strict=True):
            self._append(r, [loc])
        return True

    def _append(self, rid: int, new: list[int]) -> None:
        old = self.locs.setdefault(rid, [])
        for loc in new:
            assert loc >= self.ps, f"token placed in the padding page: {loc}"
            if len(old) % self.ps:
                assert loc == old[-1] + 1, "a page was not filled contiguously"
            else:
                assert loc % self.ps == 0, "a new page does not start at a page boundary"
            old.append(loc)
        self._write(rid, len(old) - len(new), new)

    def _write(self, rid: int, first_pos: int, locs: list[int]) -> None:
        heads, dim = self.pool.head_num, self.pool.head_dim
        values = torch.tensor([rid * 10_000 + first_pos + i for i in range(len(locs))], dtype=torch.float32)
        k = (values % 2048).to(torch.float16)[:, None, None].expand(len(locs), heads, dim).contiguous()
        for layer in range(self.pool.layer_num):
            self.pool.set_kv_buffer(None, torch.tensor(locs), k + layer, -(k + layer), layer_id_override=layer)

    def check(self) -> None:
        live = [loc for locs in self.locs.values() for loc in locs]
        assert len(live) == len(set(live)), "two live tokens share a slot"
        for rid, locs in self.locs.items():
            want = (torch.arange(len(locs), dtype=torch.float32) + rid * 10_000) % 2048
            for layer in range(self.pool.layer_num):
                k = self.pool.get_key_buffer(layer)[torch.tensor(locs)].float()
                v = self.pool.get_value_buffer(layer)[torch.tensor(locs)].float()
                assert torch.equal(k[:, 0, 0], want.half().float() + layer), f"K of request {rid} corrupted"
                assert torch.equal(v[:, -1, -1], -(want.half().float() + layer)), f"V of request {rid} corrupted"

    def finish(self, rid: int) -> None:
        self.alloc.free(torch.tensor(self.locs.pop(rid)))


def test_pool_and_allocator_are_elastic(sglang_loaded):
    pool = make_mha_pool(4096)
    allocator = make_paged_allocator(pool)
    assert type(pool) is elastic_class("mha-pool") and type(allocator) is elastic_class("paged-allocator")
    assert allocator.elastic
    mgr = pool.kvcached_manager
    assert mgr.pool_name == "mha" and mgr.engine == "sglang" and mgr.num_blocks == 4096 // 16 + 1
    # SGLang's shape contract: size + page_size rows, addresses fixed for the pool's life.
    assert pool.k_buffer[0].shape == (4096 + 16, 4, 64) and pool.k_buffer[0].dtype == torch.float16
    assert pool.k_data_ptrs.tolist() == [b.data_ptr() for b in pool.k_buffer]
    snap = mgr.snapshot()  # page 0, SGLang's padding page, is backed for good but never handed out
    assert snap["allocated_blocks"] == 0 and snap["mapped_pages"] == 1 and snap["total_blocks"] == 4096 // 16
    pool._clear_buffers()
    assert pool.kvcached_manager is None and mgr.closed


def test_paged_frees_give_pages_back_in_and_out_of_free_groups(sglang_loaded):
    """Every way SGLang frees paged slots (a plain free, a free group flushed at its end; 0.5.16's own
    ``free`` and 0.5.17's ``_release_page_ids`` alike) gives the pages back to kvcached, and only once."""
    pool = make_mha_pool(4096)
    allocator = make_paged_allocator(pool)
    mgr = pool.kvcached_manager
    a = allocator.alloc(4 * 16)  # page-granular: SGLang's own layout over the pages kvcached gave
    b = allocator.alloc(2 * 16)
    assert a is not None and b is not None and mgr.snapshot()["allocated_blocks"] == 6
    assert 0 not in (a // 16).tolist() and not set((a // 16).tolist()) & set((b // 16).tolist())
    allocator.free_group_begin()
    allocator.free(a[:32])
    allocator.free(a[32:])
    assert mgr.snapshot()["allocated_blocks"] == 6  # held until the group ends
    allocator.free_group_end()
    assert mgr.snapshot()["allocated_blocks"] == 2
    allocator.free(b)
    assert mgr.snapshot()["allocated_blocks"] == 0
    assert allocator.logical_available_size() == 4096
    mgr.trim()
    assert mgr.snapshot()["mapped_pages"] == 1  # the padding page only


@needs_cpu_paged_layout
def test_kv_survives_alloc_free_churn(sglang_loaded):
    pool = make_mha_pool(16 * 256)
    reqs = Requests(pool, make_paged_allocator(pool))
    rng = random.Random(7)
    for step in range(120):
        running = list(reqs.locs)
        if rng.random() < 0.3 or not running:
            n = rng.randint(1, 3)
            rids = list(range(reqs.next_id, reqs.next_id + n))
            reqs.next_id += n
            assert reqs.extend(rids, [rng.randint(1, 70) for _ in rids])
        elif rng.random() < 0.2:
            rid = rng.choice(running)  # chunked prefill: a continuing extend on a partly filled page
            assert reqs.extend([rid], [rng.randint(1, 40)])
        else:
            assert reqs.decode(running)
        if rng.random() < 0.25 and running:
            reqs.finish(rng.choice(running))
        if step % 20 == 0:
            reqs.check()
    reqs.check()
    for rid in list(reqs.locs):
        reqs.finish(rid)
    assert pool.kvcached_manager.snapshot()["allocated_blocks"] == 0


def test_memory_and_rss_follow_use(sglang_loaded):
    pool = make_mha_pool(16 * 2048, layer_num=4)
    allocator = make_paged_allocator(pool)
    mgr = pool.kvcached_manager
    floor_mapped, floor_rss = mgr.snapshot()["mapped_bytes"], rss_bytes()
    held = allocator.alloc(16 * 1024)  # 1024 pages x 8 KiB = 8 MiB per buffer, 8 buffers
    pool.k_buffer[0][held] = 1.0  # touch the memory (the pages are committed at map time anyway)
    grown = mgr.snapshot()["mapped_bytes"]
    assert grown >= floor_mapped + 64 * MiB
    assert rss_bytes() >= floor_rss + 48 * MiB
    allocator.free(held)
    mgr.trim()  # reclaim runs in the background too (KVCACHED_RECLAIM_DELAY_MS=0); trim makes it immediate
    assert mgr.snapshot()["mapped_bytes"] == floor_mapped
    assert rss_bytes() <= floor_rss + 16 * MiB


def test_exhaustion_and_limit_are_a_none_never_an_error(sglang_loaded):
    # 40 logical pages x 8 MiB of virtual KV against a 256 MiB host budget.
    pool = make_mha_pool(16 * 256 * 40)
    allocator = make_paged_allocator(pool)
    mgr = pool.kvcached_manager
    gc.collect()  # earlier tests' pools give their pages back to the shared budget
    reported = steady(allocator.available_size)
    assert 0 < reported < pool.size, "available_size() must say what can be mapped now, not the virtual size"
    held = allocator.alloc(reported)  # everything it reported is really served...
    assert held is not None and held.numel() == reported
    assert allocator.alloc(16) is None  # ...and the next page is a plain None
    prefix = torch.tensor([0])
    assert (
        allocator.alloc_extend(prefix, prefix, torch.tensor([40]), torch.tensor([40]), torch.tensor([-1]), 40) is None
    )
    allocator.free(held)
    settle(allocator.available_size, reported)  # as pages are unmapped in the background

    mgr.set_memory_limit(16 * MiB)  # two logical pages of 8 MiB (256 SGLang pages each); page 0 is one of them
    # Pages unmapped by the limit count as free once the device figure is refreshed (within ~20 ms).
    capped = settle(allocator.available_size, (2 * 256 - 1) * 16)  # less SGLang's padding page
    assert allocator.alloc(capped + 16) is None
    held = allocator.alloc(capped)
    assert held is not None
    settle(lambda: mgr.snapshot()["mapped_bytes"] <= 16 * MiB, True)  # the cap's reclaim has unmapped the rest
    allocator.free(held)
    mgr.set_memory_limit(None)
    settle(allocator.available_size, reported)


def test_a_limit_between_the_schedulers_check_and_its_allocation_is_served(sglang_loaded):
    """SGLang checks ``available_size()``, then allocates, and treats a None in between as fatal. A ``kvctl
    limit`` applied meanwhile (by the control thread) must not produce that None: what was reported is served
    past the limit, and from the next check on the limit binds."""
    pool = make_mha_pool(16 * 256 * 4)
    allocator = make_paged_allocator(pool)
    mgr = pool.kvcached_manager
    reported = allocator.available_size()  # the scheduler's check
    assert reported > 300 * 16
    mgr.set_memory_limit(0)  # kvctl, from another thread, before the allocation
    assert mgr.alloc(1) is None  # kvcached alone now refuses
    held = allocator.alloc(300 * 16)  # more than the mapped page holds: a new page past the limit
    assert held is not None and held.numel() == 300 * 16
    assert allocator.available_size() == 0 and allocator.alloc(16) is None  # the next check: the limit binds
    allocator.free(held)
    mgr.set_memory_limit(None)


def test_reported_availability_is_always_served(sglang_loaded):
    pool = make_mha_pool(16 * 256 * 40)
    allocator = make_paged_allocator(pool)
    rng = random.Random(3)
    held = []
    for _ in range(200):
        available = allocator.available_size()
        if held and (rng.random() < 0.4 or available < 16):
            allocator.free(held.pop(rng.randrange(len(held))))
            continue
        want = rng.randint(1, max(1, min(available, 16 * 512)) // 16) * 16
        out = allocator.alloc(want)
        assert out is not None, f"refused {want} tokens after reporting {available}"
        held.append(out)
    for out in held:
        allocator.free(out)


def test_token_allocator_page_size_one(sglang_loaded):
    from sglang.srt.mem_cache import kv_cache_configurator as kc

    pool = make_mha_pool(8192, page_size=1)
    allocator = kc.TokenToKVPoolAllocator(8192, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False)
    assert type(allocator) is elastic_class("token-allocator") and allocator.elastic
    a = allocator.alloc(100)
    b = allocator.alloc(50)
    assert 0 not in a.tolist() and not set(a.tolist()) & set(b.tolist())
    assert allocator.logical_available_size() == 8192 - 150
    allocator.free_group_begin()
    allocator.free(a)
    assert allocator.logical_available_size() == 8192 - 150  # held until the group ends
    allocator.free_group_end()
    allocator.free(b)
    assert allocator.logical_available_size() == 8192
    c = allocator.alloc(10)
    allocator.clear()  # SGLang's flush: every slot free again, page 0 still reserved
    assert allocator.logical_available_size() == 8192 and c is not None


def test_mla_pool(sglang_loaded):
    from sglang.srt.mem_cache import kv_cache_configurator as kc

    pool = track(
        kc.MLATokenToKVPool(
            1024,
            page_size=16,
            dtype=torch.float16,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=1,
        )
    )
    assert type(pool) is elastic_class("mla-pool") and pool.kvcached_manager.pool_name == "mla"
    assert pool.kv_buffer[0].shape == (1024 + 16, 1, 80)
    allocator = make_paged_allocator(pool)
    locs = allocator.alloc(32)
    kv = torch.arange(32 * 80, dtype=torch.float16).view(32, 1, 80) % 1000
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False):  # no server published a parallel layout here
        pool.set_kv_buffer(SimpleNamespace(layer_id=1), locs, kv, None)  # what set_kv_buffer reads of a layer
    assert torch.equal(pool.get_key_buffer(1)[locs], kv)
    assert torch.equal(pool.get_value_buffer(1)[locs], kv[..., :64])
    allocator.free(locs)


@pytest.mark.parametrize("shape_mismatch", [True])
def test_unsplittable_layout_keeps_sglang_buffers(sglang_loaded, shape_mismatch):
    """K and V rows of different sizes cannot share one block size: SGLang's own buffers and allocator."""
    from sglang.srt.mem_cache import kv_cache_configurator as kc

    pool = kc.MHATokenToKVPool(
        1024,
        page_size=16,
        dtype=torch.float16,
        head_num=4,
        head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=32,
    )
    assert pool.kvcached_manager is None and pool.v_buffer[0].shape == (1040, 4, 32)
    allocator = make_paged_allocator(pool)
    assert not allocator.elastic and allocator.available_size() == 1024
    out = allocator.alloc(32)
    allocator.free(out)
    assert allocator.available_size() == 1024
