"""Shared fixtures. Every test here runs the real native module; allocator tests use the host backend."""

from __future__ import annotations

import os

import pytest

import kvcached_core as kc


def cuda_available() -> bool:
    return "cuda" in kc.available_backends()


requires_cuda = pytest.mark.skipif(not cuda_available(), reason=f"no usable CUDA: {kc.cuda_unavailable_reason()}")


@pytest.fixture
def settings(tmp_path):
    """Settings isolated from the environment: a private runtime dir, no host budget, quick reclaim."""
    runtime = tmp_path / "runtime"
    return kc.load_settings({}, runtime_dir=str(runtime), reclaim_delay_ms=10)


@pytest.fixture
def make_manager(settings):
    """Builds host-backend managers and closes them after the test."""
    made: list[kc.KVCacheManager] = []

    def make(**kwargs) -> kc.KVCacheManager:
        params = dict(num_blocks=1024, block_bytes=64 * 1024, num_layers=2, num_kv_buffers=2, device="cpu")
        params.update(kwargs)
        params.setdefault("settings", settings)
        mgr = kc.KVCacheManager(**params)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.close()


def rss_bytes() -> int:
    """Resident set size of this process, read from /proc (what `ps` and the OOM killer see)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Polls `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
