"""The CUDA backend on a real GPU (skipped where no CUDA device is usable; CI has none).

Run on the lent H200 by benchmarks/gpu/run_all.sh; results are kept in benchmarks/results/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import pytest
from conftest import requires_cuda, wait_for

import kvcached_core as kc

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, requires_cuda]

MiB = 1024 * 1024


@pytest.fixture
def cuda_manager(make_manager):
    """make_manager on the GPU (close() fences outstanding GPU work before it unmaps), with 2 MiB pages: the
    tests count pages and handles at the driver's granule, whatever size the default would pick."""
    return functools.partial(make_manager, device="cuda:0", num_blocks=4096, page_bytes=2 * MiB)


def test_large_cuda_buffers_get_large_pages_by_default(make_manager):
    big = make_manager(device="cuda:0", num_blocks=1 << 15, block_bytes=64 * 1024, num_layers=1)  # 2 GiB a buffer
    small = make_manager(device="cuda:0", num_blocks=1024, block_bytes=64 * 1024, num_layers=1)  # 64 MiB
    assert (big.page_bytes, small.page_bytes) == (32 * MiB, 2 * MiB)
    ids = big.alloc(1)
    assert big.snapshot()["mapped_bytes"] == 32 * MiB * big.num_buffers
    big.free(ids)


def test_map_write_read_unmap(cuda_manager):
    mgr = cuda_manager(reserved_pages=0)
    kv = mgr.kv_tensors((64, 256), torch.float32)
    assert kv[0][0].is_cuda and kv[0][0].shape == (4096, 64, 256)
    ids = mgr.alloc(100)
    idx = torch.tensor(ids, device="cuda")
    for layer in range(2):
        for k in range(2):
            kv[layer][k][idx] = (idx.float() * 10 + layer * 2 + k).view(-1, 1, 1).expand(-1, 64, 256)
    torch.cuda.synchronize()
    for layer in range(2):
        for k in range(2):
            expect = (idx.float() * 10 + layer * 2 + k).view(-1, 1, 1)
            assert torch.equal(kv[layer][k][idx], expect.expand(-1, 64, 256))
    flat = mgr.buffer(1, 1)
    b = ids[7]
    assert torch.all(flat[b * 64 * 1024 : (b + 1) * 64 * 1024].view(torch.float32) == b * 10 + 3)
    everything = mgr.flat_buffer()  # buffer 3 (layer 1, V) of one flat view
    start = 3 * mgr.buffer_stride + b * 64 * 1024
    assert everything.is_cuda and torch.all(everything[start : start + 64 * 1024].view(torch.float32) == b * 10 + 3)
    mapped = mgr.snapshot()["mapped_bytes"]
    assert mapped > 0
    mgr.free(ids)
    torch.cuda.synchronize()
    assert mgr.trim() == mapped
    assert mgr.snapshot()["mapped_bytes"] == 0


def test_data_survives_churn_on_gpu(cuda_manager):
    gen = torch.Generator().manual_seed(1)
    mgr = cuda_manager(reserved_pages=0, reclaim_delay_ms=0)
    buf = mgr.buffer(0, 1).view(torch.int32).view(4096, -1)
    held: dict[int, int] = {}
    for round_ in range(40):
        ids = mgr.alloc(int(torch.randint(1, 400, (1,), generator=gen))) or []
        for b in ids:
            held[b] = round_ * 100_000 + b
        if ids:
            idx = torch.tensor(ids, device="cuda")
            buf[idx] = torch.tensor([held[b] for b in ids], device="cuda", dtype=torch.int32).view(-1, 1)
        victims = [b for b in held if torch.rand(1, generator=gen).item() < 0.5]
        torch.cuda.synchronize()
        mgr.free(victims)
        for b in victims:
            del held[b]
        if held:
            keys = torch.tensor(list(held), device="cuda")
            expect = torch.tensor(list(held.values()), device="cuda", dtype=torch.int32)
            assert torch.equal(buf[keys].min(dim=1).values, expect)
            assert torch.equal(buf[keys].max(dim=1).values, expect)


def test_pool_refills_on_gpu(cuda_manager):
    mgr = cuda_manager(pool_target=8, pool_max=8)
    assert wait_for(lambda: mgr.snapshot()["pool_ready_handles"] == 8)
    mgr.alloc(1)  # one logical page = 4 physical handles
    assert wait_for(lambda: mgr.snapshot()["pool_ready_handles"] == 8)


def test_idle_pool_shrinks_back_to_its_target(cuda_manager):
    mgr = cuda_manager(pool_target=2, pool_max=64, reserved_pages=0, reclaim_delay_ms=0)
    ids = mgr.alloc(32 * 8)  # 8 logical pages = 32 physical handles
    mgr.free(ids)
    mgr.trim()  # unmapped handles go back to the pool, up to pool_max
    assert mgr.snapshot()["pool_ready_handles"] > 2
    assert wait_for(lambda: mgr.snapshot()["pool_ready_handles"] == 2, timeout=3.0)


@contextlib.contextmanager
def device_left_with(left_bytes: int) -> Iterator[None]:
    """Another user holds all the device's free memory but ``left_bytes`` while the block runs."""
    free, _total = torch.cuda.mem_get_info()
    hog = torch.empty(free - left_bytes, dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del hog
        torch.cuda.empty_cache()


def one_buffer(cuda_manager, num_blocks: int, **kwargs) -> kc.KVCacheManager:
    """A manager of one buffer of 256 KiB blocks."""
    return cuda_manager(num_blocks=num_blocks, block_bytes=256 * 1024, num_layers=1, num_kv_buffers=1, **kwargs)


def take_all(mgr: kc.KVCacheManager) -> list[int]:
    """Allocate 64 blocks at a time until the device refuses."""
    got: list[int] = []
    while (ids := mgr.alloc(64)) is not None:
        got.extend(ids)
        assert len(got) < mgr.num_blocks, "never ran out of physical memory"
    return got


def test_physical_exhaustion_is_a_capacity_miss(cuda_manager, settings):
    no_headroom = dataclasses.replace(settings, device_headroom_bytes=0)  # the driver's last MiB only
    with device_left_with(512 * MiB):
        mgr = one_buffer(cuda_manager, 1 << 16, pool_target=0, settings=no_headroom)
        got = take_all(mgr)
        assert 0 < len(got) * 256 * 1024 <= 512 * MiB
        assert mgr.available_size() < 64 * 4  # it knows the device is full
        mgr.free(got)


def test_reported_availability_is_served_on_a_nearly_full_device(cuda_manager, settings):
    """With another user holding all but 512 MiB, whatever available_size() reports is served in one call
    (the pool's own refill never makes it fail), and the next page is a plain miss."""
    no_headroom = dataclasses.replace(settings, device_headroom_bytes=0)
    with device_left_with(512 * MiB):
        mgr = one_buffer(cuda_manager, 1 << 12, reserved_pages=0, settings=no_headroom)
        for _ in range(5):
            reported = mgr.available_size()
            assert 0 < reported < (1 << 12)
            ids = mgr.alloc(reported)
            assert ids is not None, f"refused the {reported} blocks it reported"
            mgr.free(ids)
            mgr.trim()
            assert wait_for(lambda: mgr.available_size() > 0, timeout=2.0)  # the device figure refreshed


def test_prepare_maps_ahead_and_counts_only_what_is_mapped_once_the_device_fills(cuda_manager, settings):
    """``prepare``: the pages a scheduler is about to take are mapped before it commits (its alloc then maps
    nothing), and once another user has filled the device since kvcached last read it, the count is what
    this process holds, not the stale reading."""
    no_headroom = dataclasses.replace(settings, device_headroom_bytes=0)
    mgr = one_buffer(cuda_manager, 1 << 12, reserved_pages=0, pool_target=0, settings=no_headroom)
    assert mgr.assured_size() == 0 and mgr.prepare(40) == mgr.assured_size() >= 40  # 8 blocks a 2 MiB page
    mapped = mgr.snapshot()["mapped_pages"]
    ids = mgr.alloc(40)
    assert ids is not None and mgr.snapshot()["mapped_pages"] == mapped
    with device_left_with(8 * MiB):
        assert mgr.prepare(1 << 11) == mgr.assured_size() < 1 << 11
        assert mgr.alloc(1 << 11) is None
    mgr.free(ids)


def test_pages_mapped_ahead_by_the_background_thread_hold_data(cuda_manager):
    """``map_ahead_pages`` on CUDA: the reclaimer thread (its own CUDA context binding) maps pages ahead of
    the load, and blocks on them are written and read back like any others."""
    mgr = one_buffer(cuda_manager, 1 << 10, reserved_pages=0, map_ahead_pages=4, reclaim_delay_ms=60_000)
    first = mgr.alloc(1)
    assert wait_for(lambda: mgr.snapshot()["mapped_pages"] == 5)
    assert mgr.assured_size() == 4 * 8 + 7 and mgr.operation_snapshot()["last_error_code"] == 0
    mgr.set_memory_limit(5 * 2 * MiB)  # what follows is served from those pages alone
    ids = mgr.alloc(4 * 8 + 7)
    assert ids is not None
    buf = mgr.buffer(0, 0).view(torch.int32).view(1 << 10, -1)
    idx = torch.tensor(first + ids, device="cuda")
    buf[idx] = idx.to(torch.int32).view(-1, 1)
    torch.cuda.synchronize()
    assert torch.equal(buf[idx], idx.to(torch.int32).view(-1, 1).expand(-1, buf.shape[1]))
    mgr.free(first + ids)


def test_the_default_headroom_stays_free_on_the_device(cuda_manager):
    """KVCACHED_DEVICE_HEADROOM's default (1 GiB on CUDA): with another user holding all but 1.5 GiB, the KV
    cache grows by at most 512 MiB, and the device keeps at least 1 GiB free for the engines' own tensors."""
    with device_left_with(1536 * MiB):
        mgr = one_buffer(cuda_manager, 1 << 14, pool_target=0)
        got = take_all(mgr)
        assert 0 < len(got) * 256 * 1024 <= 512 * MiB
        assert torch.cuda.mem_get_info()[0] >= 1024 * MiB
        mgr.free(got)


@pytest.mark.parametrize("page_mib", [2, 32])
def test_backstop_serves_reads_of_unallocated_blocks(make_manager, settings, page_mib):
    """With the backstop (the default), reading blocks nobody allocated reads zeros instead of faulting the
    CUDA context, before any page is mapped and after pages were unmapped again; writes to mapped pages
    never reach the shared backstop page. Pages larger than the granule have a backstop of their own size."""
    mgr = make_manager(
        device="cuda:0",
        num_blocks=4096,
        page_bytes=page_mib * MiB,
        reserved_pages=0,
        reclaim_delay_ms=60_000,  # pages stay mapped until trim(): the background reclaimer cannot race it
        settings=dataclasses.replace(settings, backstop=True),
    )
    whole = mgr.buffer(0, 1).view(torch.int32)
    assert int(whole.abs().sum()) == 0  # every page of the buffer read, none mapped
    ids = mgr.alloc(512)
    assert ids is not None, f"refused 512 blocks: device (free, total) {torch.cuda.mem_get_info()}, {mgr.snapshot()}"
    blocks = whole.view(4096, -1)
    blocks[torch.tensor(ids, device="cuda")] = 7
    assert int(whole.sum()) == 7 * 512 * blocks.shape[1]
    mgr.free(ids)
    torch.cuda.synchronize()
    assert mgr.trim() > 0 and mgr.snapshot()["mapped_bytes"] == 0
    assert int(whole.abs().sum()) == 0


@pytest.mark.parametrize("page_mib", [2, 32])
def test_backstop_costs_one_page_however_large_the_reservation(make_manager, settings, page_mib):
    """64 GiB of virtual KV with the backstop: the device loses one page of memory for it (the shared
    backstop of that page size, plus the driver's few MiB), not the reservation's size."""
    free_before, _ = torch.cuda.mem_get_info()
    mgr = make_manager(
        device="cuda:0",
        num_blocks=1 << 15,
        block_bytes=1 << 20,
        num_layers=1,
        num_kv_buffers=2,
        page_bytes=page_mib * MiB,
        pool_target=0,
        settings=dataclasses.replace(settings, backstop=True),
    )
    assert mgr.buffer(0, 1).numel() == 32 << 30
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after <= (16 + page_mib) * MiB


def test_the_activation_peak_stays_in_torchs_cache():
    """kvcached_core.activations on a real device: after a transient 256 MiB peak that torch handed back, the
    hold makes torch cache it again on the engine's forward stream, and an allocation of the held size on
    that stream then takes nothing from the device."""
    from kvcached_core.activations import hold_activation_peak

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    peak = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del peak
    torch.cuda.empty_cache()  # as the engines do after start-up: the device has the peak back
    stream = torch.cuda.Stream()
    held = hold_activation_peak(torch.device("cuda:0"), stream=stream)
    assert 250 * MiB <= held <= 256 * MiB  # less what torch still caches unused (a partly used small segment)
    free_before, _ = torch.cuda.mem_get_info()
    with torch.cuda.stream(stream):
        activation = torch.empty(held, dtype=torch.uint8, device="cuda")
    assert torch.cuda.mem_get_info()[0] == free_before
    del activation
    torch.cuda.empty_cache()
