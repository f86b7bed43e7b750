"""Worker side: the KV backing buffer comes from kvcached memory, and each step first follows the planner."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from kvcached_core import PageMirror, load_settings
from kvcached_core.segment import mapped_by_other_processes

from . import runtime


def _device_label(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


def allocate_kv_cache(
    original: Callable[..., dict],
    kv_cache_config: Any,
    device: torch.device,
    layout: Any,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """AROUND ``vllm.v1.worker.utils.allocate_kv_cache`` (and its by-name imports): the same per-layer views,
    over kvcached memory that this worker maps as the scheduler's planner asks.

    Configs without a planner (vLLM's profiling pass, layouts kvcached does not serve) go to vLLM's own.
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    info = getattr(kv_cache_config, "kvcached", None)
    if info is None or not kv_cache_config.kv_cache_tensors:
        return original(kv_cache_config, device, layout, kernel_block_sizes)
    if info.get("direct"):  # the worker runs in EngineCore: the scheduler's manager maps, no mirror
        memory = runtime.planner_for(kv_cache_config.num_blocks)
    else:
        memory = PageMirror(info["page_table"], _device_label(device))
        runtime.add_mirror(memory)
        runtime.sync_mirrors()
    raw = memory.flat_buffer()[: info["size"]].view(torch.int8)

    caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        group_id, group = next(
            (i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if tensor.layers[0] in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        if not spec.has_layer_views:
            caches.update((name, raw) for name in tensor.layers)
            continue
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            raw, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor, kernel_block_size=kernel_block_size
        )
        caches.update(zip(tensor.layers, views, strict=True))
    return caches


def sync_before_step(original: Callable[..., Any], wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WorkerWrapperBase.execute_model``: map the pages this step's blocks use (and unmap, after a
    fence, those the planner gave up) before the step runs; idle syncs wait for the step to end."""
    return runtime.run_step(lambda: original(wrapper, *args, **kwargs))


def virtual_cpu_kv_memory(original: Callable[..., int], worker: Any) -> int:
    """AROUND ``CPUWorker.determine_available_memory``: an explicit KV size (``VLLM_CPU_KVCACHE_SPACE``,
    ``--kv-cache-memory-bytes``) is virtual, so it is not refused because other processes hold memory now."""
    explicit = worker.cache_config.kv_cache_memory_bytes
    if explicit is None:
        return original(worker)
    if worker._should_warm_up_model():
        worker.model_runner.warming_up_model()
    return explicit


def request_memory_with_elastic_peers(
    original: Callable[..., int], init_snapshot: Any, *args: Any, **kwargs: Any
) -> int:
    """AROUND ``vllm.v1.worker.utils.request_memory`` (GPU workers): the start-up check that free memory
    covers ``gpu_memory_utilization`` counts memory other kvcached engines hold on this device as free, since
    it comes back when they idle. The snapshot vLLM keeps is not changed."""
    held = mapped_by_other_processes(load_settings(), _device_label(init_snapshot.device_))
    if held:
        init_snapshot = copy.copy(init_snapshot)
        init_snapshot.free_memory += held
    return original(init_snapshot, *args, **kwargs)
