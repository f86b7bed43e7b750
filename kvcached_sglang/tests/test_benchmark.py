"""The scheduler-side benchmark (benchmarks/sglang/allocator.py) runs against the installed SGLang release.

It times the class the plugin puts in place of SGLang's token allocator, so an SGLang release that moves
that class, or a plugin change that breaks its construction, shows here rather than when someone next
measures. The figures are not judged (timings belong to the benchmark's JSON, not to a test); that every
timing is there and positive is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sglang", "allocator.py")
TIMINGS = [f"alloc_free_n{n}_us" for n in (1, 64, 1024, 4096)] + ["available_size_us", "decode_step_us"]


def test_the_allocator_benchmark_times_the_elastic_allocator(tmp_path):
    out = tmp_path / "allocator.json"
    done = subprocess.run(
        [sys.executable, os.path.abspath(SCRIPT), "--rounds", "1", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for name in TIMINGS:
        assert report[name]["median"] > 0 and report[name]["samples"] == 1, name
    assert report["parameters"]["page_size"] == 1 and report["sglang"]


def test_the_allocator_benchmark_refuses_a_bad_round_count(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.abspath(SCRIPT), "--rounds", "0"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr
    assert "Traceback" not in done.stderr
