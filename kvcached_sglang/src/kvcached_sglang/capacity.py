"""Start-up memory planning and the idle accounting check, made aware of elastic memory.

SGLang sizes its KV pool from the device's free memory at start-up, leaves the rest for activations, and
when idle checks that free + cached + held tokens add up to the pool size. With kvcached, memory another
elastic engine holds right now comes back when that engine idles, and a free page may be unmapped: both
checks are given the figures that mean what SGLang intends, and the room for activations is held in
torch's cache at the end of start-up, where other engines' KV caches cannot take it.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

from kvcached_core import activations, load_settings, registry
from kvcached_core.backends import cuda_device
from kvcached_core.segment import held_by_other_processes

_profiling: contextvars.ContextVar[bool] = contextvars.ContextVar("kvcached_sglang_profiling", default=False)


def profile_virtual_capacity(original: Callable[..., int], configurator: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``KVCacheConfigurator._profile_available_bytes``: SGLang's own profiling, during which free
    memory reads include what other kvcached engines hold (see :func:`free_memory_with_elastic_peers`)."""
    token = _profiling.set(True)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        _profiling.reset(token)


def free_memory_with_elastic_peers(
    original: Callable[..., float], device: str, gpu_id: int, *args: Any, **kwargs: Any
) -> float:
    """AROUND ``sglang.srt.utils.common.get_available_gpu_memory`` (GB): unchanged, except while SGLang
    profiles the KV budget, when memory mapped by other live kvcached pools on this device counts as free."""
    free_gb = original(device, gpu_id, *args, **kwargs)
    if not _profiling.get():
        return free_gb
    label = cuda_device(gpu_id) if device == "cuda" else device
    return free_gb + held_by_other_processes(load_settings(), label) / (1 << 30)


def _with_logical(ps: Any, field: str, allocator: Any) -> Any:
    if getattr(allocator, "elastic", False):
        return dataclasses.replace(ps, **{field: allocator.logical_available_size()})
    return ps


def check_full_pool_logically(original: Callable[..., Any], checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerInvariantChecker._check_full_pool``: over an elastic allocator, the identity
    ``available + evictable + protected == total`` is checked with the logical free count (tokens no one
    holds), not the physical one, which also drops when another engine holds memory."""
    ps = _with_logical(ps, "full_available_size", checker.token_to_kv_pool_allocator)
    return original(checker, ps, *args, **kwargs)


def check_mamba_pool_logically(original: Callable[..., Any], checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerInvariantChecker._check_mamba_pool``: the same for Mamba slots."""
    ps = _with_logical(ps, "mamba_available_size", getattr(checker.req_to_token_pool, "mamba_allocator", None))
    return original(checker, ps, *args, **kwargs)


def hold_activation_peak(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> int:
    """AFTER ``Scheduler.init_model_worker`` (weights, KV pools, CUDA graphs: the last start-up step that
    moves device memory): torch caches the start-up's activation peak on each CUDA device this process's
    elastic pools are on (:mod:`kvcached_core.activations`), so other engines' KV caches cannot take the
    room SGLang leaves for activations. SGLang measures no peak, but its start-up runs a full prefill chunk
    eagerly before capturing prefill graphs, so torch's own peak covers one. Returns the bytes newly held."""
    devices = {m.device for m in registry.live_managers() if str(m.device).startswith("cuda")}
    if not devices:
        return 0
    import torch

    # The stream SGLang runs the forward pass on (torch caches per stream): the model runner's with overlap
    # scheduling (the default), else the scheduler's own where this release has made it already.
    stream = getattr(scheduler, "forward_stream", None) if getattr(scheduler, "enable_overlap", True) else None
    stream = stream or getattr(scheduler, "schedule_stream", None)
    return sum(activations.hold_activation_peak(torch.device(d), stream=stream) for d in sorted(devices))
