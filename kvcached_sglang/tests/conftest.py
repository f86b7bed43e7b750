"""Shared set-up for the SGLang plugin tests: the installed SGLang's real classes on CPU (CI runs them under
0.5.16 and 0.5.23, the ends of the supported range), kvcached's host backend.

The environment is fixed before SGLang or kvcached is imported: a private runtime directory (segments,
host budget ledger), a 256 MiB host budget so exhaustion is reachable, immediate reclaim and no reserved
pages so memory returns to the floor at once (no idle hold either: a test's pool is mostly alone on the
host; the hold has its own tests in tests/test_coordination.py).
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
    "KVCACHED_IDLE_HOLD_MS": "0",
}
os.environ.update(TEST_ENV)
os.environ.pop("SGLANG_PLUGINS", None)
os.environ.pop("KVCACHED_ENABLE", None)

import torch  # noqa: E402


def release_units() -> tuple[list, list[str]]:
    """The patch units and the read symbols of the installed SGLang release, as the plugin selects them."""
    from kvcached_core.patches import for_release
    from kvcached_sglang import SUPPORT
    from kvcached_sglang.patches import PATCHES, USED_SYMBOLS

    version = SUPPORT.installed_version()
    ranged = for_release([u for u in USED_SYMBOLS if not isinstance(u, str)], version)
    used = [u for u in USED_SYMBOLS if isinstance(u, str)] + [u.target for u in ranged]
    return for_release(PATCHES, version), used


def elastic_class(unit: str) -> type:
    """The class the plugin's ``unit`` puts in place for the installed SGLang release."""
    (patch,) = [p for p in release_units()[0] if p.name == unit]
    return patch.hook


def sglang_release() -> tuple[int, ...]:
    """The installed SGLang release numbers (read from package metadata: SGLang is not imported)."""
    from kvcached_core.patches import release
    from kvcached_sglang import SUPPORT

    return release(SUPPORT.installed_version() or "")


# SGLang code that cannot run on a CPU in some releases of the range (CI runs 0.5.16 and 0.5.23 on CPU; the
# GPU runs cover what is skipped here).
needs_cpu_paged_layout = pytest.mark.skipif(
    sglang_release() < (0, 5, 22),
    reason="SGLang before 0.5.22 lays out paged extend/decode allocations with Triton kernels only (no CPU path)",
)
needs_cpu_spec_scratch = pytest.mark.skipif(
    sglang_release() < (0, 5, 20),
    reason="SGLang before 0.5.20 puts Mamba speculative scratch on 'cuda' whatever the pool's device",
)


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
