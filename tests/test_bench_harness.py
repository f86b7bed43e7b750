"""The GPU benchmark harness's guards (benchmarks/gpu/vllm/suite.py), on CPU.

A run measured against a server left by an earlier run is silently wrong: the new server cannot bind the
port, the old one answers the health check, and every request goes to it (one device session measured
three "elastic" runs on leftover static servers this way). These tests hold the guards against that. The
servers here are a Python process sleeping in its own session instead of ``vllm serve`` (an engine is not the
subject; the harness's start and stop are), and ``nvidia-smi`` is a script on PATH (no GPU here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu", "vllm")
sys.path.insert(0, HARNESS)
import suite  # noqa: E402


class SleepingServer(suite.Server):
    """A server process that never listens: what is under test is the harness around it."""

    def command(self, model: str, extra: list[str]) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_server_is_not_started_on_a_port_something_answers_on(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} already has a server.*fuser -k {port}/tcp"):
            SleepingServer("leftover", port, "model", False, str(tmp_path), [])
    assert not list(tmp_path.iterdir()), "a server was started (its log exists)"


def test_a_run_stopped_by_sigterm_stops_its_servers(tmp_path):
    """What ``timeout`` does to a run: SIGTERM to the harness alone (the servers are in sessions of their
    own, so the signal does not reach them); the harness must stop them on the way out."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {HARNESS!r}); sys.path.insert(0, {os.path.dirname(__file__)!r})
        import suite
        from test_bench_harness import SleepingServer
        suite.stop_servers_on_sigterm()
        servers, result = [], {{}}
        with suite.serving(servers, result):
            servers.append(SleepingServer("s", {free_port()}, "model", False, {str(tmp_path)!r}, []))
            print(servers[0].proc.pid, flush=True)
            time.sleep(120)
        """
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(run.stdout.readline())
    os.kill(server_pid, 0)  # running
    run.send_signal(signal.SIGTERM)
    assert run.wait(30) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(server_pid):
        time.sleep(0.05)
    assert not alive(server_pid), "the server outlived the run"


def test_waiting_for_an_empty_gpu_fails_loudly_when_it_stays_held(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 70000\n")
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match="GPU 0 still holds 70000 MiB after 1 s; stop what holds it"):
        suite.wait_for_empty_gpus(timeout=1)
    fake.write_text("#!/bin/sh\necho 900\n")
    assert suite.wait_for_empty_gpus(timeout=1) < 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone: its parent, the stopped run, has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_compare_takes_a_run_recorded_before_patterns_existed_as_staggered_and_refuses_other_traffic(tmp_path):
    """``run.py compare`` on the multimodel benchmark's own JSON: a static run written before ``--pattern``
    existed (no pattern field; it replayed staggered bursts) compares with a staggered elastic run, and a
    run of different traffic is refused with the option that differs."""
    path = os.path.join(os.path.dirname(HARNESS), "multimodel", "run.py")
    spec = importlib.util.spec_from_file_location("multimodel_run", path)  # "run" alone would be ambiguous
    multimodel = sys.modules["multimodel_run"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(multimodel)

    traffic = {"duration": 10.0, "period_s": 40.0, "burst_s": 10.0, "burst_rate": 40.0, "idle_rate": 0.5}
    request = {"model": 0, "ok": True, "ttft": 0.2, "tpot": 0.01, "end_s": 5.0}
    for config, pattern, ttft in (("static", {}, 0.4), ("elastic", {"pattern": "staggered"}, 0.1)):
        run = {"models": ["m"], "traffic": {**traffic, **pattern}, "requests": [{**request, "ttft": ttft}] * 2}
        (tmp_path / f"{config}_x2.json").write_text(json.dumps(run))
    args = argparse.Namespace(models=2, pattern="staggered", out=str(tmp_path), slo_s=1.0)
    summary = multimodel.compare(args)
    assert summary["per_model"]["m"]["elastic_over_static"]["ttft_p50"] == pytest.approx(0.25)
    assert (tmp_path / "multimodel_x2.png").stat().st_size > 0

    elastic = json.loads((tmp_path / "elastic_x2.json").read_text())
    elastic["traffic"]["burst_rate"] = 27.0
    (tmp_path / "elastic_x2.json").write_text(json.dumps(elastic))
    with pytest.raises(SystemExit, match="different traffic \\(burst_rate 40.0 vs 27.0\\)"):
        multimodel.compare(args)
