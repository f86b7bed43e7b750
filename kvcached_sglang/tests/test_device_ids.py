"""DeviceIds: block ids between a real kvcached manager (host backend) and tensors, as SGLang's allocators
move them. The CUDA path (pinned buffers, copy events) runs where a CUDA device is usable and skips
elsewhere; the host path is the same code without the copies."""

from __future__ import annotations

import time

import pytest
import torch

from kvcached_core import KVCacheManager, load_settings
from kvcached_sglang.device_ids import DeviceIds


@pytest.fixture
def manager():
    """64 blocks with no host budget: what they can serve does not depend on what other tests hold."""
    mgr = KVCacheManager(
        64, 64 * 1024, 1, 2, device="cpu", name="device-ids", settings=load_settings(host_device_bytes=0)
    )
    yield mgr
    mgr.close()


def test_taken_ids_are_distinct_and_given_ids_come_back(manager):
    ids = DeviceIds(manager, "cpu", track_held=True)
    assert ids.available() == 64
    a, b = ids.take(10), ids.take(6)
    assert a.dtype == torch.int64 and len(set(a.tolist()) | set(b.tolist())) == 16
    assert ids.held == set(a.tolist()) | set(b.tolist())
    assert manager.snapshot()["allocated_blocks"] == 16
    ids.give(a.to(torch.int32))  # SGLang's req_to_token indices are int32
    assert manager.snapshot()["allocated_blocks"] == 6 and ids.held == set(b.tolist())
    assert ids.take(65) is None  # beyond what the scheduler was told: a refusal, nothing taken
    assert manager.snapshot()["allocated_blocks"] == 6


def test_a_bad_give_raises_and_frees_nothing(manager):
    ids = DeviceIds(manager, "cpu")
    taken = ids.take(4)
    with pytest.raises(ValueError):
        ids.give(torch.cat([taken[:1], taken[:1]]))  # a duplicate id
    assert manager.snapshot()["allocated_blocks"] == 4


def test_forget_drops_what_the_managers_clear_freed(manager):
    ids = DeviceIds(manager, "cpu", track_held=True)
    ids.take(8)
    manager.clear()
    ids.forget()
    manager.trim()  # the emptied page is unmapped now, not by the reclaimer at some moment in the assert
    assert ids.held == set() and ids.pending == 0 and ids.available() == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent H200)")
def test_cuda_ids_cross_without_waiting_and_frees_settle_by_event():
    mgr = KVCacheManager(4096, 64 * 1024, 1, 2, device="cuda:0", name="device-ids-cuda")
    try:
        ids = DeviceIds(mgr, "cuda:0")
        taken = ids.take(512)
        assert taken.is_cuda and len(set(taken.tolist())) == 512
        # A kernel of ~0.5 s ahead of the free's copy: the give returns at once, the ids count as coming back.
        torch.cuda._sleep(1_000_000_000)
        began = time.perf_counter()
        ids.give(taken[:256])
        assert time.perf_counter() - began < 0.1
        assert ids.pending == 256 and mgr.snapshot()["allocated_blocks"] == 512
        free_now = mgr.available_size()
        assert ids.available() == free_now + 256
        ids.settle(wait=True)
        assert ids.pending == 0 and mgr.snapshot()["allocated_blocks"] == 256
    finally:
        mgr.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent H200)")
def test_cuda_a_full_pool_reuses_ids_on_their_way_back_without_waiting():
    """SGLang's radix cache fills the pool, then evicts and allocates at once: the ids it just gave back are
    still being copied to the host behind the running forward pass. The take must not wait for that copy."""
    mgr = KVCacheManager(512, 64 * 1024, 1, 2, device="cuda:0", name="device-ids-reuse")
    try:
        ids = DeviceIds(mgr, "cuda:0")
        taken = ids.take(500)  # 12 blocks left in kvcached
        given = taken[:100].to(torch.int32)  # SGLang's req_to_token indices are int32
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU work ahead of the free's copy
        began = time.perf_counter()
        ids.give(given)
        again = ids.take(105)  # 100 on their way back and 5 fresh
        assert time.perf_counter() - began < 0.1
        assert ids.reused == 100 and ids.waits == 0 and ids.pending == 0
        values = again.tolist()  # waits for the GPU: the copies ran in order
        assert set(values[5:]) == set(given.tolist()) and len(set(values)) == 105
        assert not set(values[:5]) & set(taken.tolist())
        assert mgr.snapshot()["allocated_blocks"] == 505
        # Part of a free reused: the rest reaches kvcached when its copy is done.
        torch.cuda._sleep(1_000_000_000)
        ids.give(again[:40])
        assert ids.take(30) is not None and ids.reused == 130 and ids.pending == 10
        ids.settle(wait=True)
        assert ids.pending == 0 and mgr.snapshot()["allocated_blocks"] == 505 - 10
    finally:
        mgr.close()
