"""The cache policy (``kvcached_sglang.cache_policy``) over SGLang's own RadixCache, MHA pool and paged allocator
on the host backend: an idle engine's radix cache is kept within ``KVCACHED_PREFIX_CACHE_BYTES``, another
engine's shortfall makes it give back down to the floor and unmap, and requests waiting for memory the device
lacks are reported to the other engines.

SGLang's Scheduler cannot be built on CPU without a model runner, so the scheduler is a stand-in carrying the
attributes the policy reads (``tree_cache``, the allocator, ``req_to_token_pool``, ``waiting_queue``,
``is_fully_idle``); the radix cache, pool, allocator and the pressure record are the real ones.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch
from conftest import make_mha_pool, make_paged_allocator, run_python

PAGE = 16  # tokens per SGLang page = per kvcached block
BLOCK_BYTES = 2 * 2 * PAGE * 4 * 64 * 2  # 2 layers x (K, V) x 16 tokens x 4 heads x 64 x fp16


def radix_engine(pages: int, cached_pages: int) -> SimpleNamespace:
    """A stand-in scheduler over a real RadixCache holding ``cached_pages`` finished requests' pages."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    pool = make_mha_pool(PAGE * pages)
    allocator = make_paged_allocator(pool)
    cache = RadixCache(
        CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=PAGE)
    )
    for i in range(cached_pages):  # one finished request of one page each, distinct first tokens
        slots = allocator.alloc(PAGE)
        assert slots is not None
        cache.insert(InsertParams(key=RadixKey([1000 + i] + [7] * (PAGE - 1)), value=slots.to(torch.int64)))
    assert cache.evictable_size() == cached_pages * PAGE
    return SimpleNamespace(
        tree_cache=cache,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=SimpleNamespace(),
        waiting_queue=[],
        is_fully_idle=lambda: True,
        manager=allocator._manager,
    )


def idle_turn(engine: SimpleNamespace) -> None:
    from kvcached_sglang.cache_policy import keep_cache_within_budget

    keep_cache_within_budget(lambda _scheduler: None, engine)


def test_an_idle_engine_keeps_its_radix_cache_within_the_budget(sglang_loaded, monkeypatch):
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_BYTES", str(8 * BLOCK_BYTES))
    engine = radix_engine(pages=128, cached_pages=40)
    assert engine.manager.snapshot()["allocated_blocks"] == 40
    idle_turn(engine)
    assert engine.tree_cache.evictable_size() == 8 * PAGE  # least recently used first, down to the budget
    assert engine.manager.snapshot()["allocated_blocks"] == 8  # evicted pages went back to kvcached


def test_a_busy_engine_keeps_its_radix_cache(sglang_loaded, monkeypatch):
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_BYTES", str(8 * BLOCK_BYTES))
    engine = radix_engine(pages=128, cached_pages=40)
    engine.is_fully_idle = lambda: False
    idle_turn(engine)
    assert engine.tree_cache.evictable_size() == 40 * PAGE


SIGNAL_SHORTFALL = """
import kvcached_core as kc
from kvcached_core.pressure import DevicePressure
DevicePressure(kc.load_settings(), "cpu").signal()
"""


def test_another_engines_shortfall_makes_an_idle_engine_give_back_to_its_floor_and_unmap(sglang_loaded, monkeypatch):
    from kvcached_sglang.cache_policy import CachePolicy

    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_BYTES", str(64 * BLOCK_BYTES))
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_FLOOR_BYTES", str(4 * BLOCK_BYTES))
    engine = radix_engine(pages=128, cached_pages=40)
    idle_turn(engine)
    assert engine.tree_cache.evictable_size() == 40 * PAGE  # within the budget: kept
    policy = CachePolicy.of(engine)
    peer = run_python(SIGNAL_SHORTFALL)
    assert peer.wait() == 0, peer.stderr.read()
    deadline = time.monotonic() + 5
    while not policy.watch.pending.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert policy.watch.pending.is_set(), "the watcher did not notice the other process's shortfall"
    idle_turn(engine)
    assert engine.tree_cache.evictable_size() == 4 * PAGE
    snap = engine.manager.snapshot()
    assert snap["allocated_blocks"] == 4 and snap["mapped_pages"] == snap["used_pages"]  # unmapped at once
    assert policy.given_back == 36 * PAGE
    policy.close()


def test_requests_waiting_for_memory_the_device_lacks_are_reported(sglang_loaded):
    from kvcached_core import load_settings
    from kvcached_core.pressure import DevicePressure
    from kvcached_sglang.cache_policy import report_waiting_for_memory

    engine = radix_engine(pages=16 * 256 * 40 // PAGE, cached_pages=0)  # virtual size beyond the host budget
    allocator = engine.token_to_kv_pool_allocator
    held = allocator.alloc(allocator.available_size())  # all the host budget lets it map
    assert held is not None and engine.manager.physically_short()
    record = DevicePressure(load_settings(), "cpu")
    before = record.read()
    engine.waiting_queue = [SimpleNamespace(origin_input_ids=[5] * (4 * PAGE))]
    report_waiting_for_memory(None, engine)
    after = record.read()
    assert after is not None and after.sequence == (before.sequence if before else 0) + 1
    assert after.pid == os.getpid()


def test_releasing_the_kv_cache_unmaps_its_pages_at_once(sglang_loaded, monkeypatch):
    """``release_memory_occupation`` (the weight updater is a stand-in holding the scheduler stand-in)."""
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    from kvcached_sglang.cache_policy import release_kv_memory

    monkeypatch.setenv("KVCACHED_RECLAIM_DELAY_MS", "60000")  # the window alone would keep them a minute
    engine = radix_engine(pages=1024, cached_pages=300)
    engine.tree_cache.reset()  # SGLang's flush_cache: the radix cache and the allocator are cleared
    engine.token_to_kv_pool_allocator.clear()
    snap = engine.manager.snapshot()
    assert snap["allocated_blocks"] == 0 and snap["mapped_pages"] > 0
    updater = SimpleNamespace(scheduler=engine)
    release_kv_memory(None, updater, ReleaseMemoryOccupationReqInput(tags=["weights"]))
    assert engine.manager.snapshot()["mapped_pages"] == snap["mapped_pages"]  # the KV cache was not released
    release_kv_memory(None, updater, ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
    after = engine.manager.snapshot()
    assert after["mapped_pages"] == after["used_pages"] < snap["mapped_pages"]  # only SGLang's null page stays


FILL_THE_BUDGET = """
import sys, kvcached_core as kc
m = kc.KVCacheManager(num_blocks=512, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1, reserved_pages=0,
                      pool_target=0, pool_max=0, name="neighbour")
held = m.alloc(m.available_size())
assert held, "nothing of the host budget was left to fill"
print(len(held), flush=True)
sys.stdin.readline()
"""


def test_a_device_filled_after_the_check_is_met_from_the_engines_own_radix_cache(sglang_loaded, monkeypatch):
    """SGLang checks ``available_size()``, then allocates, and dies if the allocation fails. When another
    process fills the device in between (here: the host budget), the allocation the check promised takes
    room from the engine's own radix cache (as much as it needs, the rest stays cached) and tells the other
    engines, instead of waiting for memory no one gives back and failing. Without the policy's ``make_room``
    the same allocation raises after 5 s."""
    from kvcached_core import load_settings
    from kvcached_core.pressure import DevicePressure
    from kvcached_sglang.cache_policy import CachePolicy

    monkeypatch.setenv("KVCACHED_POOL_TARGET", "0")  # no physical pages kept ready: a new page needs the budget
    monkeypatch.setenv("KVCACHED_POOL_MAX", "0")
    engine = radix_engine(pages=1024, cached_pages=64)
    allocator, manager = engine.token_to_kv_pool_allocator, engine.manager
    policy = CachePolicy.of(engine)
    running = allocator.alloc(manager.assured_size() * PAGE)  # requests fill every mapped page
    assert running is not None and manager.assured_size() == 0
    reported = allocator.available_size()  # the scheduler's check: the budget still has room
    assert reported >= 8 * PAGE
    neighbour = run_python(FILL_THE_BUDGET)
    try:
        assert int(neighbour.stdout.readline()) > 0, neighbour.stderr.read()
        assert manager.device_spare_bytes() < manager.page_bytes * manager.num_buffers
        record = DevicePressure(load_settings(), "cpu")
        before = record.read()
        started = time.monotonic()
        out = allocator.alloc(8 * PAGE)
        assert out is not None and out.numel() == 8 * PAGE
        assert time.monotonic() - started < 1  # no wait for the neighbour
        assert engine.tree_cache.evictable_size() == (64 - 8) * PAGE  # what it needed, no more
        after = record.read()
        assert after is not None and after.pid == os.getpid()
        assert after.sequence == (before.sequence if before else 0) + 1
    finally:
        neighbour.kill()
        neighbour.wait()
        policy.close()
