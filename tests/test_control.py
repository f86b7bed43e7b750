"""Control plane with real processes and real segment files: kvctl, kvtop, stale segments, bad files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
from conftest import wait_for
from hypothesis import given, settings

import kvcached_core as kc
from kvcached_core import _native, kvctl, kvtop
from kvcached_core.segment import scan, segment_dir
from kvcached_core.workload import Workload

MiB = 1024 * 1024
PAGE = 8 * MiB  # one logical page of the workloads below: 2 layers x K/V x 2 MiB


def workload(runtime: str, name: str, pages: int) -> Workload:
    """A real process owning a manager (2 layers x K/V, 32 blocks a page) that holds ``pages`` full pages."""
    return Workload(
        "--runtime-dir",
        runtime,
        "--name",
        name,
        "--blocks",
        "2048",
        "--reclaim-delay-ms",
        "5",
        "--pool-target",
        "4",
        "--hold",
        str(32 * pages),
        cwd=os.path.dirname(runtime),
    )


@pytest.fixture
def runtime(tmp_path):
    path = tmp_path / "rt"
    return str(path)


def run_cli(main, argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def list_json(runtime: str, capsys) -> list[dict]:
    code, out, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "list", "--json"], capsys)
    assert code == 0
    return json.loads(out)


def test_kvctl_limit_takes_effect_within_50ms_and_spares_the_other(runtime, capsys):
    a, b = workload(runtime, "engine-A", 4), workload(runtime, "engine-B", 4)
    try:

        def mapped() -> list[int]:  # state is republished every KVCACHED_WATCH_INTERVAL_MS (10 ms)
            return sorted(r["mapped_bytes"] for r in list_json(runtime, capsys))

        assert wait_for(lambda: mapped() == [4 * PAGE, 4 * PAGE])
        start = time.monotonic()
        code, out, err = run_cli(kvctl.main, ["--runtime-dir", runtime, "limit", "engine-A", "16M"], capsys)
        elapsed = time.monotonic() - start
        assert code == 0, err
        assert "deferred" in out  # 32 MiB in use > 16 MiB: nothing is taken back
        assert elapsed < 0.05, f"kvctl limit took {elapsed * 1000:.1f} ms to be acknowledged"
        assert a.ask("alloc 1") == "miss"  # allocation stops at once
        assert b.ask("alloc 32") == "ok"  # the other instance is untouched
        assert a.ask("free 96") == "ok"  # free 3 of 4 pages: under the cap again
        assert wait_for(lambda: a.ask("snap").split()[0] == str(PAGE))
        assert a.ask("alloc 32") == "ok" and a.ask("alloc 32") == "miss"  # may grow to the cap, not past it

        def rows() -> dict[str, dict]:
            return {r["name"]: r for r in list_json(runtime, capsys)}

        assert wait_for(lambda: rows()["engine-A"]["limit_status"] == "applied")  # the shrink completed
        assert rows()["engine-A"]["limit_bytes"] == 16 * MiB and rows()["engine-B"]["limit_bytes"] is None
        code, out, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "limit", "engine-A", "none"], capsys)
        assert code == 0 and "applied" in out
        assert a.ask("alloc 32") == "ok"
    finally:
        a.stop()
        b.stop()
    assert list_json(runtime, capsys) == []  # clean exits removed their segments


def test_limit_is_split_across_pools_by_virtual_capacity(runtime, capsys):
    s = kc.load_settings({}, runtime_dir=runtime)
    mha = kc.KVCacheManager(3072, 64 * 1024, 2, 2, name="multi", pool_name="mha", settings=s)
    mamba = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="multi", pool_name="mamba", settings=s)
    try:
        code, _, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "limit", "multi", "1G"], capsys)
        assert code == 0
        assert mha.snapshot()["limit_bytes"] + mamba.snapshot()["limit_bytes"] == 1 << 30
        assert mha.snapshot()["limit_bytes"] == pytest.approx(3 * mamba.snapshot()["limit_bytes"], rel=0.01)
        code, out, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "limit-percent", "multi", "50"], capsys)
        assert code == 0
        total = mha.snapshot()["limit_bytes"] + mamba.snapshot()["limit_bytes"]
        device_total = kc.backends.get_backend("cpu", s).mem_info()[1]
        assert total == device_total // 2
    finally:
        mha.close()
        mamba.close()


def test_sigkilled_owner_is_never_listed_live_and_gc_removes_it(runtime, capsys):
    w = workload(runtime, "doomed", 1)
    assert [r["name"] for r in list_json(runtime, capsys)] == ["doomed"]
    os.kill(w.proc.pid, signal.SIGKILL)
    w.proc.wait()
    assert list_json(runtime, capsys) == []  # at once: the owner's pid is checked on every read
    directory = segment_dir(kc.load_settings({}, runtime_dir=runtime))
    assert len(scan(directory).stale) == 1
    code, out, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "limit", "doomed", "1G"], capsys)
    assert code == 1
    code, out, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "gc"], capsys)
    assert code == 0 and "1 stale segment(s) and 0 stale page table(s) removed" in out
    assert os.listdir(directory) == []


def test_new_manager_takes_over_a_dead_namesake(runtime, capsys):
    w = workload(runtime, "phoenix", 1)
    w.proc.kill()
    w.proc.wait()
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(64, 64 * 1024, 1, 2, name="phoenix", settings=s) as mgr:
        directory = segment_dir(s)
        assert scan(directory).stale == []  # the dead one's file is gone
        assert [r["pid"] for r in list_json(runtime, capsys)] == [os.getpid()]
        assert mgr.alloc(1) is not None


@pytest.mark.parametrize("how", ["close", "exit", "sigterm"])
def test_clean_shutdown_removes_the_segment(runtime, how):
    script = textwrap.dedent(
        """
        import sys, time, kvcached_core as kc
        m = kc.KVCacheManager(64, 4096, 1, 2, settings=kc.load_settings({}, runtime_dir=sys.argv[1]))
        if sys.argv[2] == "close":
            m.close()
        print("up", flush=True)
        if sys.argv[2] == "sigterm":
            time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, runtime, how], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(runtime)
    )
    assert proc.stdout.readline().strip() == "up"
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == (-signal.SIGTERM if how == "sigterm" else 0)
    assert os.listdir(segment_dir(kc.load_settings({}, runtime_dir=runtime))) == []


def write_bad_files(directory: str) -> dict[str, str]:
    """Files a segment directory may hold that are not usable segments, with the reason kvctl gives."""
    good = Path(next(p for p in Path(directory).iterdir() if p.suffix == ".seg"))
    raw = good.read_bytes()
    cases = {
        "truncated.seg": (raw[:100], "truncated"),
        "garbage.seg": (os.urandom(len(raw)), "bad magic"),
        "future.seg": (raw[:8] + (99).to_bytes(4, "little") + raw[12:], "layout version 99"),
        "foreign.seg": (raw, "not by you"),
        "open.seg": (raw, "open to other users"),
    }
    for name, (data, _) in cases.items():
        path = Path(directory) / name
        path.write_bytes(data)
        path.chmod(0o600)
    os.chown(Path(directory) / "foreign.seg", 4242, 4242)  # the tests run as root in CI
    (Path(directory) / "open.seg").chmod(0o644)
    return {name: why for name, (_, why) in cases.items()}


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_bad_files_are_skipped_with_one_line_warnings(runtime, capsys):
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(64, 4096, 1, 2, name="healthy", settings=s):
        directory = segment_dir(s)
        expected = write_bad_files(directory)
        for main, argv in (
            (kvctl.main, ["--runtime-dir", runtime, "list"]),
            (kvtop.main, ["--runtime-dir", runtime, "--once"]),
        ):
            code, out, err = run_cli(main, argv, capsys)
            assert code == 0
            assert "healthy" in out
            lines = err.strip().splitlines()
            assert len(lines) == len(expected), err
            for name, why in expected.items():
                assert any(name in line and why in line for line in lines), (name, err)
        code, _, _ = run_cli(kvctl.main, ["--runtime-dir", runtime, "gc"], capsys)
        assert code == 0
        assert len(os.listdir(directory)) == 1 + len(expected)  # gc touches only stale segments of its own


@pytest.mark.parametrize(
    "argv",
    [
        ["limit", "x"],
        ["limit", "x", "12X"],
        ["limit", "x", "-1G"],
        ["limit-percent", "x", "0"],
        ["limit-percent", "x", "101"],
        ["limit-percent", "x", "nan"],
        ["frobnicate"],
        [],
        ["list", "--yaml"],
    ],
)
def test_kvctl_bad_input_is_one_line_and_exit_2(runtime, capsys, argv):
    code, out, err = run_cli(kvctl.main, ["--runtime-dir", runtime, *argv], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvctl: ")
    assert "Traceback" not in err


def test_kvtop_frame_and_json(runtime, capsys):
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="shown", settings=s) as mgr:
        mgr.alloc(100)
        mgr.set_memory_limit(64 * MiB)
        mgr._control.publish()
        code, out, _ = run_cli(kvtop.main, ["--runtime-dir", runtime, "--once"], capsys)
        assert code == 0
        row = next(line for line in out.splitlines() if line.startswith("shown"))
        assert "64.0M" in row and "32.0M" in row and "[####" in row
        code, out, _ = run_cli(kvtop.main, ["--runtime-dir", runtime, "--once", "--json"], capsys)
        (entry,) = json.loads(out)
        assert entry["limit_bytes"] == 64 * MiB and entry["mapped_bytes"] == 32 * MiB
    assert run_cli(kvtop.main, ["--runtime-dir", runtime, "--json"], capsys)[0] == 2


def test_fair_share_caps_are_shown_beside_the_limit(runtime, capsys):
    """A pool that fair share caps while a neighbour is short (caps set by hand here; the policy that sets them:
    tests/test_coordination.py) shows the cap and what it stops in `kvctl list`, `kvtop --once` and the JSON
    rows, published from the real allocator through its control segment; without caps, nothing shows."""
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="capped", settings=s) as mgr:
        mgr.alloc(100)

        def shown() -> tuple[str, str, dict]:
            mgr._control.publish()
            listed = run_cli(kvctl.main, ["--runtime-dir", runtime, "list"], capsys)[1]
            top = run_cli(kvtop.main, ["--runtime-dir", runtime, "--once"], capsys)[1]
            (row,) = list_json(runtime, capsys)
            line = next(line for line in listed.splitlines() if line.startswith("capped"))
            return line, top, row

        line, top, row = shown()
        assert row["admit_cap_bytes"] is None and row["yield_cap_bytes"] is None
        assert "admitting" not in line and "yielding" not in line and "a/y:" not in top
        mgr.admit_cap = 48 * MiB
        line, top, row = shown()
        assert row["admit_cap_bytes"] == 48 * MiB and "48.0M (admitting)" in line
        assert "48.0Ma" in top and "a/y: a neighbour is short" in top
        mgr.yield_cap = 40 * MiB
        line, top, row = shown()
        assert row["yield_cap_bytes"] == 40 * MiB and "40.0M (yielding)" in line and "40.0My" in top
        mgr.admit_cap = mgr.yield_cap = None
        line, top, row = shown()
        assert row["admit_cap_bytes"] is None and row["yield_cap_bytes"] is None and "a/y:" not in top


@pytest.mark.parametrize("tool", ["kvctl", "kvtop"])
def test_cli_tools_do_not_import_torch(runtime, tool):
    code = (
        f"import sys; from kvcached_core import {tool}; "
        f"{tool}.main(['--runtime-dir', {runtime!r}, {'list' if tool == 'kvctl' else '--once'!r}]); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.path.dirname(runtime)
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


class LimitModel:
    """The revision rules, written plainly: what set_memory_limit must answer."""

    def __init__(self) -> None:
        self.limit: int | None = None
        self.revision = 0

    def apply(self, limit: int | None, revision: int | None, in_use: int) -> tuple[str, int | None]:
        rev = self.revision + 1 if revision is None else revision
        if rev < self.revision:
            return "stale", self.limit
        if rev == self.revision and revision is not None and limit != self.limit:
            return "conflict", self.limit
        self.limit, self.revision = limit, rev
        return ("deferred" if limit is not None and in_use > limit else "applied"), limit


limits = st.one_of(st.none(), st.integers(min_value=0, max_value=8).map(lambda pages: pages * PAGE))
requests = st.lists(st.tuples(limits, st.one_of(st.none(), st.integers(min_value=0, max_value=6))), max_size=25)


@given(requests=requests, held_pages=st.integers(min_value=0, max_value=4))
@settings(max_examples=80, deadline=None)
def test_revision_rules_match_the_model(tmp_path_factory, requests, held_pages):
    s = kc.load_settings({}, runtime_dir=str(tmp_path_factory.mktemp("rt")), control=False)
    with kc.KVCacheManager(1024, 64 * 1024, 2, 2, settings=s, reserved_pages=0) as mgr:
        if held_pages:
            mgr.alloc(32 * held_pages)
        model = LimitModel()
        for limit, revision in requests:
            expected_status, expected_limit = model.apply(limit, revision, held_pages * PAGE)
            result = mgr.set_memory_limit(limit, revision)
            assert result["status"] == expected_status, (limit, revision)
            assert mgr.snapshot()["limit_bytes"] == expected_limit
            assert mgr.snapshot()["limit_revision"] == model.revision


@given(requests=requests)
@settings(max_examples=25, deadline=None)
def test_revision_rules_hold_through_the_segment(tmp_path_factory, requests):
    """The same rules when the request comes through the shared-memory segment, as kvctl sends it."""
    s = kc.load_settings({}, runtime_dir=str(tmp_path_factory.mktemp("rt")))
    with kc.KVCacheManager(1024, 64 * 1024, 2, 2, settings=s) as mgr:
        path = mgr._control.path
        model = LimitModel()
        for limit, revision in requests:
            rev = model.revision + 1 if revision is None else revision
            expected_status, expected_limit = model.apply(limit, rev, 0)
            before = _native.read_segment(path)["handled_revision"]
            _native.request_limit(path, limit, rev)
            if rev > before:
                assert wait_for(lambda r=rev: _native.read_segment(path)["handled_revision"] >= r, timeout=2)
                assert _native.read_segment(path)["limit_status"] == expected_status
            else:  # the outcome can only be seen through the allocator's state
                assert wait_for(lambda: mgr.snapshot()["limit_revision"] == model.revision, timeout=2)
            assert mgr.snapshot()["limit_bytes"] == expected_limit


def test_the_control_module_sets_limits_and_lists_instances_without_the_cli(runtime):
    """What kvctl prints comes from kvcached_core.control, which plugins and examples call directly: a limit
    on a live process is split across its pools, acknowledged, and shows in the instance rows."""
    from kvcached_core import control

    w = workload(runtime, "ctl", 2)
    try:
        s = control.settings_for(runtime)
        # The owner publishes its state every watch interval: wait for the snapshot after its alloc.
        assert wait_for(lambda: control.instances(s, name="ctl")[0]["mapped_bytes"] == 2 * PAGE)
        (row,) = control.instances(s, name="ctl")
        assert (row["pid"], row["engine"]) == (w.proc.pid, "python")
        assert control.instances(s, name="ctl", engine="vllm") == []
        outcomes = control.set_limit(control.scan_segments(s), "ctl", lambda pools: PAGE)
        assert [(o.pid, o.share, o.status) for o in outcomes] == [(w.proc.pid, PAGE, "deferred")]
        assert control.instances(s, name="ctl")[0]["limit_bytes"] == PAGE
        with pytest.raises(control.InstanceGone, match="no live instance named 'nobody'"):
            control.set_limit(control.scan_segments(s), "nobody", lambda pools: PAGE)
    finally:
        w.stop()
    assert control.instances(control.settings_for(runtime)) == []
