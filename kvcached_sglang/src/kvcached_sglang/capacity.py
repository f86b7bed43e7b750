"""Start-up memory planning and the idle accounting check, made aware of elastic memory.

SGLang sizes its KV pool from the device's free memory at start-up and, when idle, checks that free +
cached + held tokens add up to the pool size. With kvcached, memory another elastic engine holds right now
comes back when that engine idles, and a free page may be unmapped: both checks are given the figures that
mean what SGLang intends.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

from kvcached_core import load_settings
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
