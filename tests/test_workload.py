"""The subprocess harness the other tests use (python -m kvcached_core.workload): a real manager in a real
process, driven over stdin, with the snapshot it reports checked against the control segment kvctl reads."""

from __future__ import annotations

import json
import os

import pytest
from conftest import wait_for

from kvcached_core import control
from kvcached_core.workload import Workload

MiB = 1 << 20
PAGE = 8 * MiB  # 2 layers x K/V x 2 MiB: 32 blocks of 64 KiB


def test_commands_drive_a_real_manager(tmp_path):
    runtime = str(tmp_path / "rt")
    w = Workload("--runtime-dir", runtime, "--name", "driven", "--hold", "32", cwd=str(tmp_path))
    try:
        assert w.ready_line == "ready"
        assert w.ask("snap").split() == [str(PAGE), "None", "32"]
        assert w.ask("alloc 33") == "ok"  # one more page and a block of a third
        assert w.ask("snap").split() == [str(3 * PAGE), "None", "65"]
        assert w.ask("alloc 100000") == "miss"  # beyond the virtual capacity: a miss, nothing changes
        assert w.ask("free 64") == "ok"
        assert w.ask("trim") == f"ok {2 * PAGE}"  # the two emptied pages; the third still holds a block
        assert w.ask("grow 40") == "ok 40"  # one block at a time up to 40 held
        assert w.ask("grow 5000") == "miss 1024"  # until alloc refuses: the whole virtual capacity
        snap = json.loads(w.ask("json"))
        assert snap["allocated_blocks"] == 1024 and snap["page_bytes"] == 2 * MiB
        assert w.ask("free 1023") == "ok"  # back to one held block (the page it is on stays mapped)
        assert w.ask("rewind") == "error: unknown command 'rewind'"
        s = control.settings_for(runtime)
        assert wait_for(lambda: [r["mapped_bytes"] for r in control.instances(s, name="driven")] == [PAGE])
        assert w.stop() == 0
        assert control.instances(s) == []  # closed on the way out: its segment is gone
    finally:
        w.kill()


def test_a_workload_that_cannot_start_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="the workload did not start"):
        Workload("--blocks", "0", cwd=str(tmp_path), env=dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path / "rt")))
