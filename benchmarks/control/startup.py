"""Start-up time of kvctl and kvtop, and whether either imports torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import summarize

from .acknowledgement import cli_command, run_timed
from .workload import TARGET_NAME, LibraryError

TORCH_PROBE = r"""
import contextlib, io, json, sys
from kvcached_core import {module}
with contextlib.redirect_stdout(io.StringIO()):
    status = {module}.main({argv!r})
print(json.dumps({{"status": status, "torch": "torch" in sys.modules}}))
"""


def imports_torch(module: str, argv: list[str], cwd: str) -> dict[str, Any]:
    """Runs ``kvcached_core.<module>.main(argv)`` in a fresh interpreter; did it import torch?"""
    code = TORCH_PROBE.format(module=module, argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=60)
    if done.returncode != 0:
        raise LibraryError(f"{module}.main({argv}) probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_startup(runtime_dir: str, runs: int) -> dict[str, Any]:
    """Subprocess wall time of ``kvctl list`` and ``kvtop --once`` (interleaved), with baselines."""
    commands = {
        "kvctl_list": cli_command("kvctl") + ["--runtime-dir", runtime_dir, "list"],
        "kvtop_once": cli_command("kvtop") + ["--runtime-dir", runtime_dir, "--once"],
        "python_bare": [sys.executable, "-c", "pass"],
        "python_import_kvcached_core": [sys.executable, "-c", "import kvcached_core"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(runs + 1):
        for name, args in commands.items():
            elapsed, done = run_timed(args, runtime_dir)
            if done.returncode != 0:
                raise LibraryError(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
            if name in ("kvctl_list", "kvtop_once") and TARGET_NAME not in done.stdout:
                raise LibraryError(f"{' '.join(args)} does not list the live {TARGET_NAME}: {done.stdout!r}")
            if i >= 1:
                times[name].append(elapsed)
    torch_installed = importlib.util.find_spec("torch") is not None
    kvctl_probe = imports_torch("kvctl", ["--runtime-dir", runtime_dir, "list"], runtime_dir)
    kvtop_probe = imports_torch("kvtop", ["--runtime-dir", runtime_dir, "--once"], runtime_dir)
    return {
        "startup_ms": {name: summarize(values) for name, values in times.items()},
        "imports_torch": {"kvctl_list": kvctl_probe["torch"], "kvtop_once": kvtop_probe["torch"]},
        "torch_installed": torch_installed,
    }
