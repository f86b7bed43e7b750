"""Memory is real: data survives churn, RSS follows mapping, and the host budget is shared by processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import rss_bytes, wait_for

import kvcached_core as kc
from kvcached_core import backends
from kvcached_core.workload import Workload

MiB = 1024 * 1024


def test_rss_rises_on_map_and_falls_on_unmap(make_manager):
    mgr = make_manager(num_blocks=4096, num_layers=4, reserved_pages=0, pool_target=0)
    base = rss_bytes()
    ids = mgr.alloc(2048)  # 64 pages x 8 buffers x 2 MiB = 1 GiB of host memory
    mapped = mgr.snapshot()["mapped_bytes"]
    assert mapped == 1024 * MiB
    grown = rss_bytes()
    assert grown - base >= 0.9 * mapped, (base, grown)
    mgr.free(ids)
    mgr.trim()
    assert mgr.snapshot()["mapped_bytes"] == 0
    assert rss_bytes() - base < 0.1 * mapped


def test_data_survives_alloc_free_map_unmap_churn(make_manager):
    gen = torch.Generator().manual_seed(0)
    mgr = make_manager(num_blocks=2048, block_bytes=16 * 1024, reserved_pages=0, reclaim_delay_ms=0)
    kv = mgr.kv_tensors((16, 256), torch.float32)  # per-layer K and V views
    flat = mgr.buffer(1, 1)  # the same memory seen as one flat backing buffer
    held: dict[int, float] = {}
    for round_ in range(30):
        ids = mgr.alloc(int(torch.randint(1, 300, (1,), generator=gen)))
        if ids is None:
            ids = []
        for b in ids:
            value = float(round_ * 10_000 + b)
            for layer in range(2):
                for k in range(2):
                    kv[layer][k][b].fill_(value)
            held[b] = value
        # Free a random half of what is held: pages empty out and are unmapped under the survivors.
        victims = [b for b in held if torch.rand(1, generator=gen).item() < 0.5]
        mgr.free(victims)
        for b in victims:
            del held[b]
        for b, value in held.items():
            for layer in range(2):
                for k in range(2):
                    assert torch.all(kv[layer][k][b] == value), f"block {b} layer {layer} kv {k} lost its data"
            raw = flat[b * 16 * 1024 : (b + 1) * 16 * 1024].view(torch.float32)
            assert torch.all(raw == value)
    assert mgr.snapshot()["allocated_blocks"] == len(held)


def test_flat_buffer_strides_all_layers_like_one_backing_buffer(make_manager):
    mgr = make_manager(num_blocks=256, block_bytes=16 * 1024, num_layers=3, num_kv_buffers=1)
    assert mgr.buffer_stride == 256 * 16 * 1024  # a whole number of pages: no padding between layers
    flat = mgr.flat_buffer()
    assert flat.numel() == 3 * mgr.buffer_stride
    ids = mgr.alloc(40)
    for layer in range(3):
        mgr.buffer(layer, 0)[ids[7] * 16 * 1024 : (ids[7] + 1) * 16 * 1024].fill_(layer + 1)
    for layer in range(3):
        start = layer * mgr.buffer_stride + ids[7] * 16 * 1024
        assert torch.all(flat[start : start + 16 * 1024] == layer + 1)


def test_kv_tensors_reject_shapes_that_do_not_match_the_block(make_manager):
    mgr = make_manager()
    with pytest.raises(ValueError, match="bytes"):
        mgr.kv_tensors((16, 255), torch.float32)
    with pytest.raises(ValueError, match="layer"):
        mgr.buffer(5, 0)


def test_views_keep_address_space_reserved_after_close(make_manager):
    mgr = make_manager()
    view = mgr.buffer(0, 0)
    mgr.close()  # physical memory goes; the view's address range stays reserved until the view dies
    assert view.numel() == 1024 * 64 * 1024
    del view
    with pytest.raises(kc.ClosedError):
        mgr.buffer(0, 0)  # no new view of memory that is gone


def start_holder(runtime: str, budget: int, blocks: int) -> Workload:
    """Another process on the same host budget, holding ``blocks`` (2 layers x K/V: 32 blocks a page)."""
    return Workload(
        "--runtime-dir",
        runtime,
        "--host-device-bytes",
        str(budget),
        "--hold",
        str(blocks),
        cwd=os.path.dirname(runtime),
    )


def test_host_budget_is_shared_between_processes(tmp_path, settings):
    runtime = str(tmp_path / "rt")
    budget = 64 * MiB  # 8 logical pages of 8 MiB
    other = start_holder(runtime, budget, 32 * 6)  # takes 6 pages = 48 MiB
    try:
        assert other.ready_line == "ready" and other.ask("snap").split()[0] == str(48 * MiB)
        # A long demand window: the pages a missed alloc mapped stay mapped for the next one (a reclaim racing
        # that next alloc would hold their memory for a moment and make it miss on a loaded machine).
        s = kc.load_settings({}, runtime_dir=runtime, host_device_bytes=budget, reclaim_delay_ms=60_000)
        mgr = kc.KVCacheManager(1024, 64 * 1024, 2, 2, device="cpu", settings=s, reserved_pages=0, pool_target=0)
        try:
            assert mgr.alloc(32 * 3) is None  # 3 pages do not fit next to the other's 6: a miss, no crash
            time.sleep(0.2)  # the reclaimer has run (the miss asked it to)
            assert mgr.snapshot()["mapped_pages"] == 2, "the pages the miss mapped were not kept for its retry"
            mine = mgr.alloc(32 * 2)
            assert mine is not None
            assert other.ask("free") == "ok"
            assert wait_for(lambda: other.ask("snap").split()[0] == "0")  # reclaimed after its 10 ms window
            more = mgr.alloc(32 * 6)  # the memory the other process gave back
            assert more is not None
            assert mgr.snapshot()["mapped_bytes"] == budget
        finally:
            mgr.close()
    finally:
        other.kill()


def test_every_manager_leaves_the_device_headroom_free(tmp_path):
    """``KVCACHED_DEVICE_HEADROOM``: managers stop mapping that far above empty, counting what another process
    (without a headroom of its own) holds, and refuse as a miss, never an error; what is freed comes back."""
    runtime = str(tmp_path / "rt")
    budget = 64 * MiB  # 8 logical pages of 8 MiB
    other = start_holder(runtime, budget, 32 * 3)  # 24 MiB in another process
    s = kc.load_settings({"KVCACHED_DEVICE_HEADROOM": "16M"}, runtime_dir=runtime, host_device_bytes=budget)
    kw = dict(device="cpu", settings=s, reserved_pages=0, pool_target=0)
    a = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="a", **kw)
    b = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="b", **kw)
    try:
        assert backends.get_backend("cpu", s).headroom == 16 * MiB
        assert other.ready_line == "ready"
        assert a.alloc(32 * 3) is not None  # 24 MiB: the other's 24 + these 24 + 16 MiB of headroom = 64
        assert a.alloc(1) is None and b.alloc(1) is None  # one more page would leave 8 MiB free
        assert a.available_size() == 0 and b.available_size() == 0
        assert a.snapshot()["mapped_bytes"] + b.snapshot()["mapped_bytes"] == 24 * MiB
        assert other.ask("free") == "ok"
        assert wait_for(lambda: other.ask("snap").split()[0] == "0")  # 24 MiB back on the device
        assert wait_for(lambda: b.available_size() == 32 * 3, timeout=2)
        assert b.alloc(32 * 3) is not None and b.alloc(1) is None
    finally:
        a.close()
        b.close()
        other.kill()


def test_headroom_defaults_to_none_on_the_host_and_parses_sizes():
    assert kc.load_settings({}).device_headroom_bytes is None
    assert backends.device_headroom("host", kc.load_settings({})) == 0
    assert backends.device_headroom("cuda", kc.load_settings({})) == 1 << 30
    assert backends.device_headroom("cuda", kc.load_settings({"KVCACHED_DEVICE_HEADROOM": "0"})) == 0
    with pytest.raises(kc.ConfigError, match="KVCACHED_DEVICE_HEADROOM='lots'"):
        kc.load_settings({"KVCACHED_DEVICE_HEADROOM": "lots"})


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_budget_held_by_a_killed_process_comes_back(tmp_path):
    runtime = str(tmp_path / "rt")
    budget = 64 * MiB
    other = start_holder(runtime, budget, 32 * 8)  # the whole budget
    assert other.ready_line == "ready" and other.ask("snap").split()[0] == str(budget)
    s = kc.load_settings({}, runtime_dir=runtime, host_device_bytes=budget, reclaim_delay_ms=10)
    mgr = kc.KVCacheManager(1024, 64 * 1024, 2, 2, device="cpu", settings=s, reserved_pages=0, pool_target=0)
    try:
        assert mgr.alloc(1) is None
        os.kill(other.pid, signal.SIGKILL)
        assert wait_for(lambda: proc_state(other.pid) == "Z")  # dead, not yet reaped by its parent
        assert mgr.alloc(32 * 8) is not None  # the dead owner's share counts as free at once
    finally:
        mgr.close()
        other.proc.wait()
    ledger = os.path.join(runtime, "host-device.ledger")
    assert os.stat(ledger).st_mode & 0o777 == 0o600
    assert os.stat(runtime).st_mode & 0o777 == 0o700


def test_pool_thread_keeps_handles_ready(make_manager):
    mgr = make_manager(pool_target=6, pool_max=6)
    assert wait_for(lambda: mgr.snapshot()["pool_ready_handles"] == 6)
    mgr.alloc(1)  # maps one logical page = 4 handles from the pool
    assert wait_for(lambda: mgr.snapshot()["pool_ready_handles"] == 6)  # refilled in the background
    idle = make_manager(pool_target=0)
    assert idle.snapshot()["pool_ready_handles"] == 0
    assert idle.alloc(1) is not None  # without a pool the page is created on the path


def test_available_size_recovers_after_a_miss_without_a_pool(tmp_path):
    """With nothing created ahead, the free-memory figure still follows the device: a miss (another pool
    held the budget) must not hide new pages once the memory is back."""
    s = kc.load_settings({}, runtime_dir=str(tmp_path / "rt"), host_device_bytes=64 * MiB, reclaim_delay_ms=0)
    kw = dict(device="cpu", settings=s, reserved_pages=0, pool_target=0)
    a = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="a", **kw)
    b = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="b", **kw)
    try:
        held = a.alloc(32 * 8)  # the whole 64 MiB budget
        assert held is not None
        assert b.alloc(1) is None and b.available_size() == 0
        a.free(held)
        a.trim()
        assert wait_for(lambda: b.available_size() >= 32 * 8, timeout=2)
        assert b.alloc(32 * 8) is not None
    finally:
        a.close()
        b.close()


def test_a_promised_allocation_passes_a_new_limit_and_waits_for_memory_a_neighbour_gives_back(tmp_path):
    """``alloc_promised``: what an engine already promised its scheduler is served past a limit that arrived
    since, and, when another pool holds the memory, once that pool gives it back (``on_short`` asks it to);
    if nothing comes back in time, one RuntimeError naming the fix, and nothing is held."""
    s = kc.load_settings({}, runtime_dir=str(tmp_path / "rt"), host_device_bytes=64 * MiB, reclaim_delay_ms=0)
    kw = dict(device="cpu", settings=s, reserved_pages=0, pool_target=0)
    a = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="a", **kw)
    b = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="b", **kw)
    try:
        b.set_memory_limit(0)
        assert b.alloc(8) is None
        got = b.alloc_promised(8)
        assert len(got) == 8 and b.alloc(1) is None  # past the limit once; the limit still binds
        b.free(got)
        b.set_memory_limit(None)
        b.trim()

        held = a.alloc(32 * 8)  # the whole 64 MiB budget
        assert held is not None and b.alloc(1) is None
        with pytest.raises(RuntimeError, match=r"could not be mapped within 0.2 s.*kvctl limit"):
            b.alloc_promised(1, wait_s=0.2)
        assert b.snapshot()["allocated_blocks"] == 0

        asked = []

        def give_back() -> None:  # what the neighbour does when told the device is short
            if not asked:
                a.free(held)
                a.trim()
            asked.append(1)

        got = b.alloc_promised(32, wait_s=3.0, on_short=give_back)
        assert len(got) == 32 and asked
    finally:
        a.close()
        b.close()


def test_prepare_maps_what_a_scheduler_will_take_and_counts_only_memory_this_process_holds(tmp_path):
    """``assured_size`` and ``prepare``: a scheduler about to commit to blocks learns how many it will really
    get before it commits. Memory another process took since kvcached last read the device shows as a smaller
    count there, not as a refused ``alloc`` after the commitment; the memory limit binds ``prepare`` too."""
    s = kc.load_settings({}, runtime_dir=str(tmp_path / "rt"), host_device_bytes=64 * MiB)
    kw = dict(device="cpu", settings=s, reserved_pages=0, pool_target=0)
    a = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="a", **kw)  # 32 blocks on a page row of 8 MiB
    b = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="b", **kw)
    try:
        assert a.assured_size() == 0 < a.available_size()
        assert a.prepare(40) == a.assured_size() == 64  # two page rows mapped, no block taken
        assert a.snapshot()["mapped_pages"] == 2 and a.snapshot()["allocated_blocks"] == 0
        ids = a.alloc(40)
        assert ids is not None and a.snapshot()["mapped_pages"] == 2, "alloc mapped what prepare had not"
        assert b.alloc(32 * 6) is not None  # the rest of the 64 MiB device, taken by another pool
        assert a.prepare(64) == a.assured_size() == 24  # what its own pages hold, not what it read before
        assert a.alloc(64) is None
        b.close()  # its memory goes back
        assert a.prepare(64) >= 64 and a.alloc(64) is not None
        a.set_memory_limit(a.snapshot()["mapped_bytes"])
        assert a.prepare(1000) == a.assured_size() and a.snapshot()["mapped_bytes"] <= a.snapshot()["limit_bytes"]
        a.free(ids)
    finally:
        a.close()
        b.close()


def test_scheduler_count_serves_what_was_counted_and_refuses_beyond(make_manager):
    """``SchedulerCount``: a refusal within the scheduler's last count (less what it took since) is served
    anyway, one beyond it stays a refusal, as an engine's own pool would answer."""
    from kvcached_core.promise import SchedulerCount

    mgr = make_manager(reserved_pages=0)
    count = SchedulerCount(mgr)
    assert count.report(mgr.available_size()) == 1024
    mgr.set_memory_limit(0)  # arrives after the count
    first = count.honour(40, mgr.alloc(40))
    assert first is not None and len(first) == 40 and count.counted == 1024 - 40
    assert count.honour(1000, mgr.alloc(1000)) is None  # beyond what is left of the count
    assert count.report(mgr.available_size()) == 0 and count.honour(1, mgr.alloc(1)) is None
    mgr.free(first)
