"""Shared set-up for the SGLang plugin tests: real SGLang 0.5.23 classes on CPU, kvcached's host backend.

The environment is fixed before SGLang or kvcached is imported: a private runtime directory (segments,
host budget ledger), a 256 MiB host budget so exhaustion is reachable, immediate reclaim and no reserved
pages so memory returns to the floor at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

RUNTIME_DIR = tempfile.mkdtemp(prefix="kvcached-sglang-tests-")
TEST_ENV = {
    "KVCACHED_RUNTIME_DIR": RUNTIME_DIR,
    "KVCACHED_HOST_DEVICE_BYTES": "256M",
    "KVCACHED_RECLAIM_DELAY_MS": "0",
    "KVCACHED_RESERVED_PAGES": "0",
}
os.environ.update(TEST_ENV)
os.environ.pop("SGLANG_PLUGINS", None)
os.environ.pop("KVCACHED_ENABLE", None)

import torch  # noqa: E402


@pytest.fixture(scope="session")
def sglang_loaded():
    """SGLang's own plugin loading, once for the session (it runs once per process)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import kvcached_sglang

    assert kvcached_sglang.active(), "kvcached did not register its patches"
    return kvcached_sglang


_made_pools: list = []


@pytest.fixture(autouse=True)
def close_pools():
    """Each test's pools give their memory back when it ends, so the next one starts from an empty budget."""
    yield
    from kvcached_sglang.pools import close_manager

    while _made_pools:
        close_manager(_made_pools.pop())


def track(pool):
    _made_pools.append(pool)
    return pool


def make_mha_pool(size: int, page_size: int = 16, layer_num: int = 2, head_num: int = 4, head_dim: int = 64):
    """An MHA pool built with the arguments SGLang's KVCacheConfigurator passes (CPU, no memory saver)."""
    from sglang.srt.mem_cache import kv_cache_configurator as kc

    return track(
        kc.MHATokenToKVPool(
            size,
            page_size=page_size,
            dtype=torch.float16,
            head_num=head_num,
            head_dim=head_dim,
            layer_num=layer_num,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=layer_num - 1,
        )
    )


def make_paged_allocator(pool):
    from sglang.srt.mem_cache import kv_cache_configurator as kc

    return kc.PagedTokenToKVPoolAllocator(
        pool.size, page_size=pool.page_size, dtype=pool.dtype, device="cpu", kvcache=pool, need_sort=False
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter of this venv, outside the repository (so the installed packages
    are what is imported), with the test environment plus ``env``."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tempfile.gettempdir(),
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
