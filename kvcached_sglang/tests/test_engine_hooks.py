"""The engine-facing hooks and the control plane: start-up capacity, the idle leak check, kvctl/kvtop
visibility and limits, and cleanup on graceful exit and after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

from conftest import RUNTIME_DIR, make_mha_pool, make_paged_allocator, run_python

from kvcached_core.workload import Workload

MiB = 1 << 20


def test_profiling_counts_memory_other_elastic_engines_hold(sglang_loaded):
    from kvcached_sglang.capacity import free_memory_with_elastic_peers, profile_virtual_capacity

    def measured_free(*_args, **_kwargs):  # what SGLang's own measurement returns, in GB
        return 1.0

    # Another engine's pool in its own process, holding 24 MiB of host memory.
    peer = Workload(
        "--name",
        "peer",
        "--engine",
        "sglang",
        "--blocks",
        "64",
        "--block-bytes",
        str(MiB),
        "--layers",
        "1",
        "--kv-buffers",
        "1",
        "--hold",
        "24",
        cwd=tempfile.gettempdir(),
    )
    try:
        assert peer.ready_line == "ready"
        held = int(peer.ask("snap").split()[0])
        assert held >= 24 * MiB
        # Outside SGLang's KV budget profiling, free memory is what SGLang measured.
        assert free_memory_with_elastic_peers(measured_free, "cpu", 0) == 1.0
        deadline = time.monotonic() + 2.0  # the peer publishes its figures every KVCACHED_WATCH_INTERVAL_MS
        while True:
            during = profile_virtual_capacity(lambda _c: free_memory_with_elastic_peers(measured_free, "cpu", 0), None)
            if during == 1.0 + held / (1 << 30) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert during == 1.0 + held / (1 << 30)
    finally:
        peer.kill()


def test_the_activation_reserve_is_held_for_cuda_pools_only(sglang_loaded):
    """The end-of-start-up unit over SGLang's own elastic MHA pool on the host: nothing to hold (SGLang's CPU
    activations are not in any device budget), and torch.cuda is not touched. Holding on a GPU is
    tests/test_gpu.py's (the core function) and the SGLang GPU harness's (a real server's log)."""
    from types import SimpleNamespace

    from kvcached_sglang.capacity import hold_activation_peak

    pool = make_mha_pool(1024)
    assert pool.kvcached_manager is not None
    assert hold_activation_peak(None, SimpleNamespace(forward_stream=None, enable_overlap=True)) == 0


def test_idle_check_sees_logical_free_tokens(sglang_loaded):
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    from kvcached_sglang.capacity import check_full_pool_logically

    pool = make_mha_pool(16 * 256 * 40)
    allocator = make_paged_allocator(pool)
    held = allocator.alloc(16 * 100)
    physical = allocator.available_size()
    assert physical < pool.size - 16 * 100  # the 256 MiB budget, not the virtual size, bounds it

    class Checker:  # the two attributes the hook reads; SGLang's check itself is `original` below
        token_to_kv_pool_allocator = allocator

    stats = PoolStats(full_num_used=0, full_token_usage=0.0, full_available_size=physical, full_evictable_size=0)
    seen = check_full_pool_logically(lambda _checker, ps: ps.full_available_size, Checker(), stats)
    assert seen == pool.size - 16 * 100  # available + held == total holds with the logical figure
    allocator.free(held)


def test_pools_show_in_kvctl_and_obey_limits(sglang_loaded, capsys):
    from kvcached_core import kvctl

    pool = make_mha_pool(16 * 256 * 40)
    allocator = make_paged_allocator(pool)
    name = pool.kvcached_manager.name
    assert kvctl.main(["--runtime-dir", RUNTIME_DIR, "list", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["pid"] == os.getpid() and r["name"] == name]
    assert [(r["engine"], r["pool_name"]) for r in rows] == [("sglang", "mha")]

    assert kvctl.main(["--runtime-dir", RUNTIME_DIR, "limit", name, "16M"]) == 0
    assert allocator.available_size() == (2 * 256 - 1) * 16  # the watcher applied it: two 8 MiB pages
    assert allocator.alloc(2 * 256 * 16) is None
    assert kvctl.main(["--runtime-dir", RUNTIME_DIR, "limit", name, "none"]) == 0


POOL_PROCESS = """
import os, sys, torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
pool = MHATokenToKVPool(4096, page_size=16, dtype=torch.float16, head_num=4, head_dim=64, layer_num=2,
                        device="cpu", enable_memory_saver=False)
print("ready", pool.kvcached_manager.name, flush=True)
"""


def test_segments_are_removed_on_exit_and_collected_after_sigkill(sglang_loaded, capsys):
    from kvcached_core import kvctl, load_settings
    from kvcached_core.segment import scan, segment_dir

    def live_names():
        assert kvctl.main(["--runtime-dir", RUNTIME_DIR, "list", "--json"]) == 0
        return {r["name"] for r in json.loads(capsys.readouterr().out)}

    graceful = run_python(POOL_PROCESS)
    killed = run_python(POOL_PROCESS + "sys.stdin.readline()\n")
    out, err = graceful.communicate(timeout=300)
    assert graceful.returncode == 0, err[-2000:]
    assert out.split()[0] == "ready" and out.split()[1] not in live_names()

    line = killed.stdout.readline().split()
    assert line and line[0] == "ready", killed.stderr.read()[-2000:]
    assert line[1] in live_names()
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert line[1] not in live_names()  # a dead owner's segment is not listed as live...
    stale = [s.info["name"] for s in scan(segment_dir(load_settings())).stale]
    assert line[1] in stale
    assert kvctl.main(["--runtime-dir", RUNTIME_DIR, "gc"]) == 0  # ...and gc removes it
    capsys.readouterr()
    assert line[1] not in [s.info["name"] for s in scan(segment_dir(load_settings())).stale]
