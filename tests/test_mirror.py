"""Principle 6 on the host backend: a planner process decides, worker processes map (real processes,
a real shared page table, real memory in each worker)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from conftest import cuda_available, wait_for

import kvcached_core as kc

PER_PAGE = 32  # 64 KiB blocks in 2 MiB pages

WORKER = textwrap.dedent(
    """
    import json, sys, torch, kvcached_core as kc
    settings = kc.load_settings({}, runtime_dir=sys.argv[2], host_device_bytes=int(sys.argv[3]))
    mirror = kc.PageMirror(sys.argv[1], sys.argv[4], settings=settings, pool_target=0)
    kv = mirror.kv_tensors((16, 1024), torch.float32)      # 64 KiB blocks
    sync_device = torch.cuda.synchronize if sys.argv[4].startswith("cuda") else (lambda: None)
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sync":
            out = mirror.sync()
            out.update(mapped_pages=mirror.mapped_pages, rss=rss())
            print(json.dumps(out), flush=True)
        elif cmd == "write":                                  # write BLOCK:VALUE ...
            for item in args:
                b, v = map(int, item.split(":"))
                for layer in kv:
                    for t in layer:
                        t[b].fill_(v)
            sync_device()
            print("ok", flush=True)
        elif cmd == "check":                                  # check BLOCK:VALUE ...
            bad = [item for item in args for b, v in [map(int, item.split(":"))]
                   if not all(bool(torch.all(t[b] == v)) for layer in kv for t in layer)]
            print("bad " + " ".join(bad) if bad else "ok", flush=True)
    mirror.close()
    """
)


class Worker:
    def __init__(self, table: str, runtime: str, budget: int = 0, device: str = "cpu") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, table, runtime, str(budget), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(runtime),
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def ask(self, *words: object) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sync(self) -> dict:
        return json.loads(self.ask("sync"))

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=20) == 0


def make_planner(tmp_path, device: str = "cpu") -> tuple[kc.KVCacheManager, str]:
    runtime = str(tmp_path / "rt")
    s = kc.load_settings({}, runtime_dir=runtime, reclaim_delay_ms=60_000)  # pages go only at trim()
    mgr = kc.KVCacheManager(
        1024, 64 * 1024, 2, 2, device=device, name="planned", settings=s, reserved_pages=0, mapped_by_workers=True
    )
    return mgr, runtime


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture
def planner(tmp_path):
    mgr, runtime = make_planner(tmp_path)
    yield mgr, runtime
    mgr.close()


def test_planner_maps_nothing_itself(planner):
    mgr, _ = planner
    assert mgr.page_table_path and os.stat(mgr.page_table_path).st_mode & 0o777 == 0o600
    ids = mgr.alloc(100)
    assert mgr.snapshot()["mapped_pages"] == 4  # planned ...
    with pytest.raises(ValueError, match="only plans"):
        mgr.buffer(0, 0)  # ... but there is no memory here to view
    mgr.free(ids)


def test_two_workers_follow_the_planner_with_intact_data(planner):
    """TP=2 on the host: one planner, two worker processes, each mapping its own memory."""
    mgr, runtime = planner
    run_two_workers(mgr, [Worker(mgr.page_table_path, runtime) for _ in range(2)])


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available() or torch_cuda_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_workers_follow_the_planner_with_intact_data(tmp_path):
    """TP=2 on two GPUs: the planner maps nothing; each worker process maps its own GPU's memory."""
    mgr, runtime = make_planner(tmp_path, "cuda:0")
    try:
        run_two_workers(mgr, [Worker(mgr.page_table_path, runtime, device=f"cuda:{rank}") for rank in range(2)])
    finally:
        mgr.close()


def run_two_workers(mgr: kc.KVCacheManager, workers: list[Worker]) -> None:
    """Random steps: the planner allocates and frees; every worker syncs, writes new blocks, checks all."""
    rng = random.Random(7)
    held: dict[int, int] = {}
    try:
        for step in range(40):
            ids = mgr.alloc(rng.randint(1, 120)) or []
            for b in ids:
                held[b] = step * 10_000 + b
            victims = [b for b in held if b not in ids and rng.random() < 0.4]
            mgr.free(victims)
            for b in victims:
                del held[b]
            mgr.trim() if step % 5 == 0 else None
            planned = mgr.snapshot()["mapped_pages"]
            for w in workers:
                assert w.sync()["mapped_pages"] == planned  # the step starts with exactly the planned pages
                if ids:
                    assert w.ask("write", *(f"{b}:{held[b]}" for b in ids)) == "ok"
                assert w.ask("check", *(f"{b}:{v}" for b, v in held.items())) == "ok"
        mgr.free(list(held))
        mgr.trim()
        for w in workers:
            out = w.sync()
            assert out["mapped_pages"] == 0 and out["unmapped"] > 0
    finally:
        for w in workers:
            w.stop()


def test_worker_memory_follows_the_plan(planner):
    mgr, runtime = planner
    w = Worker(mgr.page_table_path, runtime)
    try:
        base = w.sync()["rss"]
        ids = mgr.alloc(PER_PAGE * 16)  # 16 logical pages x 4 buffers x 2 MiB = 128 MiB in the worker
        grown = w.sync()
        assert grown["mapped"] == 16
        assert w.ask("write", *(f"{b}:1" for b in ids)) == "ok"
        assert w.sync()["rss"] - base >= 120 * 2**20
        mgr.free(ids)
        mgr.trim()
        shrunk = w.sync()
        assert shrunk["unmapped"] == 16 and shrunk["rss"] - base < 16 * 2**20
    finally:
        w.stop()


def test_planner_plans_no_more_than_workers_can_hold(planner):
    mgr, runtime = planner
    budget = 64 * 2**20  # the worker's device: 8 logical pages
    w = Worker(mgr.page_table_path, runtime, budget)
    try:
        w.sync()  # reports what its device can give
        assert wait_for(lambda: mgr.available_size() <= 8 * PER_PAGE)
        assert mgr.available_size() >= 7 * PER_PAGE
    finally:
        w.stop()


def test_page_table_of_a_killed_planner_is_collected(tmp_path, capsys):
    runtime = str(tmp_path / "rt")
    script = (
        "import sys, kvcached_core as kc; "
        "m = kc.KVCacheManager(64, 65536, 1, 2, mapped_by_workers=True, "
        "settings=kc.load_settings({}, runtime_dir=sys.argv[1])); "
        "print(m.page_table_path, flush=True); sys.stdin.readline()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, runtime], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    proc.kill()
    proc.wait()
    from kvcached_core import kvctl

    assert kvctl.main(["--runtime-dir", runtime, "gc"]) == 0
    assert "1 stale segment(s) and 1 stale page table(s) removed" in capsys.readouterr().out
    assert not os.path.exists(path)


def test_foreign_or_bad_page_table_is_refused(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\0" * 4096)
    bad.chmod(0o600)
    with pytest.raises(kc.SegmentError, match="not a page table"):
        kc.PageMirror(str(bad), "cpu")
    with pytest.raises(kc.SegmentError, match="cannot open"):
        kc.PageMirror(str(tmp_path / "missing.pt"), "cpu")
