"""The runtime directory is hostile ground: whatever another process of the user leaves in it, the tools and
new managers carry on, nothing outside it is touched, one process keeps one host budget, a copy of a segment
is not a pool, and a stopped owner or a held lock never hangs kvctl.

Real files, directories, FIFOs and links in a real runtime directory; the real native module and CLIs.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import string
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
from conftest import wait_for
from hypothesis import HealthCheck, given, settings

import kvcached_core as kc
from kvcached_core import control, kvctl, kvtop
from kvcached_core.segment import creator_pid, page_table_dir, scan, segment_dir
from kvcached_core.workload import Workload

MiB = 1 << 20

# A name: a pid-like head (sometimes beyond any integer type), a tail, and one of kvcached's suffixes.
heads = st.one_of(
    st.integers(0, 10**30).map(str),
    st.text(string.ascii_letters + string.digits + "_.", min_size=0, max_size=12),
)
suffixes = st.sampled_from([".seg", ".seg.tmp", ".pt", ".pt.tmp", ".ledger", ""])
kinds = st.sampled_from(["bytes", "empty", "directory", "fifo", "link-outside", "dangling-link"])
entries = st.lists(
    st.tuples(st.sampled_from(["segments", "pagetables"]), heads, suffixes, kinds, st.binary(max_size=2048)),
    min_size=1,
    max_size=6,
)


def plant(directory: Path, name: str, kind: str, data: bytes, outside: Path) -> Path | None:
    path = directory / name
    if path.exists() or path.is_symlink() or name in ("", ".", ".."):
        return None
    if kind == "bytes":
        path.write_bytes(data)
        path.chmod(0o600)
    elif kind == "empty":
        path.touch(0o600)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link-outside":
        path.symlink_to(outside)
    else:
        path.symlink_to(directory / "nowhere")
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(planted=entries)
def test_stray_entries_never_break_the_tools_or_a_new_manager(tmp_path_factory, capsys, planted):
    root = tmp_path_factory.mktemp("hostile")
    outside = root / "outside.txt"
    outside.write_text("not kvcached's")
    runtime = str(root / "rt")
    s = kc.load_settings({}, runtime_dir=runtime)
    dirs = {"segments": Path(segment_dir(s)), "pagetables": Path(page_table_dir(s))}
    kept = []  # what must survive: everything but regular files kvcached may collect
    for where, head, tail, kind, data in planted:
        name = f"{head}-x{tail}"
        path = plant(dirs[where], name, kind, data, outside)
        if path is not None and kind not in ("bytes", "empty"):
            kept.append(path)
    with kc.KVCacheManager(64, 4096, 1, 2, name="healthy", settings=s) as mgr:
        assert mgr.alloc(4) is not None
        for main, argv in (
            (kvctl.main, ["--runtime-dir", runtime, "list"]),
            (kvctl.main, ["--runtime-dir", runtime, "list", "--json"]),
            (kvtop.main, ["--runtime-dir", runtime, "--once"]),
            (kvctl.main, ["--runtime-dir", runtime, "gc"]),
        ):
            code = main(argv)
            out, err = capsys.readouterr()
            assert code == 0, (argv, err)
            assert "Traceback" not in err
            if argv[-1] != "gc":
                assert "healthy" in out
    for path in kept:
        assert path.is_symlink() or path.exists(), f"{path} was removed"
    assert outside.read_text() == "not kvcached's"


@pytest.mark.parametrize(
    "name, pid",
    [
        ("123-abc.seg", 123),
        ("99999999999999999999-x.seg.tmp", None),
        ("0-x.pt", None),
        ("4194304-x.pt", None),
        ("4194303-x.pt", 4194303),
        ("١٢٣-x.seg", None),
        ("abc-1.seg", None),
        ("-1.seg", None),
    ],
)
def test_only_names_a_process_can_have_are_read_as_pids(name, pid):
    assert creator_pid(name) == pid


def test_one_process_keeps_one_host_budget(tmp_path):
    """Two managers of one process naming different host budgets for the same ledger: the second is refused
    (each would claim the process's one slot in the ledger and undo the other's accounting)."""
    runtime = str(tmp_path / "rt")
    small = kc.load_settings({}, runtime_dir=runtime, host_device_bytes=64 * MiB, reclaim_delay_ms=0)
    large = kc.load_settings({}, runtime_dir=runtime, host_device_bytes=128 * MiB, reclaim_delay_ms=0)
    params = dict(
        num_blocks=256, block_bytes=MiB, num_layers=1, num_kv_buffers=1, device="cpu", reserved_pages=0, pool_target=0
    )
    with kc.KVCacheManager(**params, settings=small) as first:
        with pytest.raises(kc.ConfigError, match="KVCACHED_HOST_DEVICE_BYTES=134217728.*same host budget"):
            kc.KVCacheManager(**params, settings=large)
        with kc.KVCacheManager(**params, settings=small) as second:  # the same budget: shared, as it must be
            assert first.alloc(48) is not None
            assert second.alloc(8) is not None
            assert second.alloc(16) is None  # 72 MiB would exceed the 64 MiB budget


def test_a_byte_copy_of_a_live_segment_is_not_a_second_pool(tmp_path, capsys):
    """A copy (a backup tool's) carries the owner's identity; counted as a pool, a limit would be split in
    two and half of it applied."""
    runtime = str(tmp_path / "rt")
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(64, 64 * 1024, 1, 2, name="copied", settings=s) as mgr:
        original = next(Path(segment_dir(s)).glob("*.seg"))
        copy = original.with_name(f"{os.getpid()}-backup.seg")
        copy.write_bytes(original.read_bytes())
        copy.chmod(0o600)
        found = scan(segment_dir(s))
        assert [seg.path for seg in found.live] == [str(original)]
        assert any(path == str(copy) and "a copy" in why for path, why in found.bad)
        assert kvctl.main(["--runtime-dir", runtime, "limit", "copied", "1M"]) == 0
        assert mgr.snapshot()["limit_bytes"] == MiB  # the whole limit, not half of it
    capsys.readouterr()


@pytest.fixture
def owner(tmp_path):
    runtime = str(tmp_path / "rt")
    w = Workload("--runtime-dir", runtime, "--name", "owner", "--blocks", "64", "--layers", "1")
    yield runtime, w
    os.kill(w.pid, signal.SIGCONT)
    w.kill()


def test_a_stopped_owner_is_waited_for_a_bounded_time_and_named_as_stopped(owner, capsys):
    runtime, w = owner
    os.kill(w.pid, signal.SIGSTOP)
    assert wait_for(lambda: control.process_state(w.pid) == "T")  # the signal is delivered asynchronously
    started = time.monotonic()
    assert kvctl.main(["--runtime-dir", runtime, "limit", "owner", "1M"]) == 3
    assert time.monotonic() - started < 5
    assert "stopped (SIGSTOP or a debugger)" in capsys.readouterr().out
    os.kill(w.pid, signal.SIGCONT)  # it takes the recorded request when it runs again
    deadline = time.monotonic() + 5
    while kvctl.main(["--runtime-dir", runtime, "list", "--json"]) == 0:
        rows = json.loads(capsys.readouterr().out)
        if rows and rows[0]["limit_bytes"] == MiB or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert rows[0]["limit_bytes"] == MiB


def test_a_segment_locked_by_another_process_does_not_hang_kvctl(owner, capsys):
    runtime, _w = owner
    s = kc.load_settings({}, runtime_dir=runtime)
    path = next(Path(segment_dir(s)).glob("*.seg"))
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: the same as another process's
        started = time.monotonic()
        assert kvctl.main(["--runtime-dir", runtime, "limit", "owner", "1M"]) == 3
        assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "locked by another process" in err and "try again" in err


def test_a_hard_link_to_a_live_segment_is_not_a_second_pool(tmp_path, capsys):
    runtime = str(tmp_path / "rt")
    s = kc.load_settings({}, runtime_dir=runtime)
    with kc.KVCacheManager(64, 64 * 1024, 1, 2, name="linked", settings=s) as mgr:
        original = next(Path(segment_dir(s)).glob("*.seg"))
        os.link(original, original.with_name("0000-alias.seg"))
        assert len(scan(segment_dir(s)).live) == 1
        assert kvctl.main(["--runtime-dir", runtime, "limit", "linked", "1M"]) == 0
        assert mgr.snapshot()["limit_bytes"] == MiB
    capsys.readouterr()


def test_links_planted_at_kvcached_paths_are_refused_and_nothing_outside_is_written(tmp_path):
    """Hard links pass O_NOFOLLOW: the ledger and the pressure record check the link count before writing."""
    from kvcached_core.pressure import DevicePressure, pressure_dir

    outside = tmp_path / "precious"
    outside.write_bytes(b"")  # empty: a fresh ledger or record would be written into it
    outside.chmod(0o600)
    runtime = tmp_path / "rt"
    s = kc.load_settings({}, runtime_dir=str(runtime), host_device_bytes=64 * MiB)
    os.link(outside, Path(pressure_dir(s)) / "cpu")
    DevicePressure(s, "cpu").signal()
    os.link(outside, runtime / "host-device.ledger")
    with pytest.raises(RuntimeError, match="host budget ledger .* not a private file of this user.*remove it"):
        kc.KVCacheManager(64, 4096, 1, 2, device="cpu", name="planted", settings=s)
    assert outside.read_bytes() == b""


@pytest.mark.parametrize("how", ["truncate", "remove", "replace"])
def test_a_live_segment_torn_down_under_its_owner_is_written_again_and_the_owner_lives(owner, capsys, how):
    """Touching a truncated shared mapping raises SIGBUS; the owner's guard puts private pages in place, and
    its watcher writes the segment again, as it does when the file is removed or another is renamed over it."""
    runtime, w = owner
    s = kc.load_settings({}, runtime_dir=runtime)
    path = next(Path(segment_dir(s)).glob("*.seg"))
    if how == "truncate":
        os.truncate(path, 0)
    elif how == "remove":
        path.unlink()
    else:
        stranger = path.with_name("stranger")
        stranger.write_bytes(os.urandom(path.stat().st_size))
        stranger.chmod(0o600)
        stranger.rename(path)
    assert wait_for(lambda: [seg.info["name"] for seg in scan(segment_dir(s)).live] == ["owner"], timeout=15)
    assert kvctl.main(["--runtime-dir", runtime, "limit", "owner", "1M"]) == 0
    capsys.readouterr()
    assert w.ask("snap").split()[1] == str(MiB)  # alive, and the limit reached it
    assert w.proc.poll() is None


def test_a_ledger_truncated_under_a_running_process_fails_safe(tmp_path):
    """The ledger's claims are gone with the truncation: the process stops charging (it cannot know what
    others hold) instead of dying of SIGBUS or granting memory the budget may not have."""
    runtime = tmp_path / "rt"
    w = Workload(
        "--runtime-dir",
        str(runtime),
        "--name",
        "charged",
        "--host-device-bytes",
        str(64 << 20),
        "--reclaim-delay-ms",
        "0",
        "--blocks",
        "64",
        "--block-bytes",
        str(1 << 20),
        "--layers",
        "1",
        "--kv-buffers",
        "1",
        "--hold",
        "8",
    )
    try:
        assert w.ready_line == "ready"
        os.truncate(runtime / "host-device.ledger", 0)
        assert w.ask("alloc 8") == "miss"
        assert w.ask("free") == "ok"
        assert w.ask("trim").startswith("ok")
        assert w.ask("snap").split()[0] == "0"  # what it held is freed as usual
        assert w.stop(timeout=30) == 0
    finally:
        w.kill()
