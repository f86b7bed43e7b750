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
import machine_load  # noqa: E402
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


def test_a_server_that_never_finishes_its_warm_up_is_the_sides_error_not_a_hang(tmp_path, monkeypatch):
    """An engine that accepts requests and never runs them (what the peer project is expected to do on vLLM
    0.26): the warm-up ends after its bound and the side records why, with the server's log. The streaming
    client needs aiohttp, which the CPU venv lacks, so it is replaced by what it returns when its requests
    time out."""

    async def timed_out(port, name, prompts, rate, max_tokens, total_s):
        assert total_s == suite.WARM_UP_S
        return {"requests": len(prompts), "failed": len(prompts), "errors": ["TimeoutError: "]}

    monkeypatch.setattr(suite, "open_loop", timed_out)
    servers, result = [], {}
    with suite.serving(servers, result, "error_peer"):
        servers.append(SleepingServer("serve-peer", free_port(), "model", False, str(tmp_path), []))
        with open(servers[0].logpath, "a") as log:
            log.write("INFO engine up\n")
        suite.warm_up(servers[0])
        result["measured"] = True
    assert "measured" not in result
    assert "serve-peer: 32 of 32 warm-up requests failed or did not finish in 120 s" in result["error_peer"]
    assert "INFO engine up" in result["error_peer"]


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


def test_the_sampler_records_each_engines_mapped_memory_and_fair_shares_caps_while_set(tmp_path, monkeypatch):
    """The multimodel and sharing runs' sampler reads kvcached's control segments as kvctl does: an engine's
    mapped bytes in every sample, and fair share's caps on it only while set (a real manager on the host
    backend; the caps set by hand, the policy that sets them is tests/test_coordination.py's)."""
    import kvcached_core as kc

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    with kc.KVCacheManager(64, 1 << 20, 1, 1, name="sampled", settings=kc.load_settings()) as mgr:
        mgr.alloc(3)
        sampler = suite.Sampler(["sampled"])
        try:
            deadline = time.monotonic() + 5
            while not any(s["sampled"] for s in sampler.samples) and time.monotonic() < deadline:
                time.sleep(0.05)
            mgr.admit_cap = 2 << 20
            while not any("sampled:admit_cap" in s for s in sampler.samples) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            samples = sampler.stop()
    mapped = [s["sampled"] for s in samples if s["sampled"]]
    assert mapped and mapped[-1] >= 3 << 20
    capped = [s for s in samples if "sampled:admit_cap" in s]
    assert capped and all(s["sampled:admit_cap"] == 2 << 20 for s in capped)
    assert "sampled:yield_cap" not in samples[-1] and "sampled:admit_cap" not in samples[0]


def load_multimodel():
    """benchmarks/gpu/multimodel/run.py as a module."""
    path = os.path.join(os.path.dirname(HARNESS), "multimodel", "run.py")
    spec = importlib.util.spec_from_file_location("multimodel_run", path)  # "run" alone would be ambiguous
    multimodel = sys.modules["multimodel_run"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(multimodel)
    return multimodel


def test_compare_takes_a_run_recorded_before_patterns_existed_as_staggered_and_refuses_other_traffic(tmp_path):
    """``run.py compare`` on the multimodel benchmark's own JSON: a static run written before ``--pattern``
    existed (no pattern field; it replayed staggered bursts) compares with a staggered elastic run, the
    elastic engines' peak and median mapped KV are reported, and a run of different traffic is refused with
    the option that differs."""
    multimodel = load_multimodel()

    traffic = {"duration": 10.0, "period_s": 40.0, "burst_s": 10.0, "burst_rate": 40.0, "idle_rate": 0.5}
    request = {"model": 0, "ok": True, "ttft": 0.2, "tpot": 0.01, "end_s": 5.0, "arrival_s": 1.0}
    gib = 1 << 30
    kv = [{"t": t, "m": n * gib} for t, n in ((0.0, 1), (0.05, 9), (0.1, 4))]
    kv[1]["m:yield_cap"] = 5 * gib  # fair share capped it at one sample: drawn, and no figure of its own
    for config, pattern, ttft in (("static", {}, 0.4), ("elastic", {"pattern": "staggered"}, 0.1)):
        run = {"models": ["m"], "traffic": {**traffic, **pattern}, "requests": [{**request, "ttft": ttft}] * 2}
        if config == "elastic":
            run["kv_samples"] = kv
        (tmp_path / f"{config}_x2.json").write_text(json.dumps(run))
    args = argparse.Namespace(models=2, pattern="staggered", out=str(tmp_path), slo_s=1.0)
    summary = multimodel.compare(args)
    assert summary["per_model"]["m"]["elastic_over_static"]["ttft_p50"] == pytest.approx(0.25)
    assert summary["elastic_kv_gib"] == {"m": {"peak": 9.0, "median": 4.0}}
    [burst] = summary["per_model"]["m"]["bursts"]  # model 0's one period in 10 s of traffic
    assert (burst["from_s"], burst["to_s"], burst["static"]["requests"]) == (0.0, 10.0, 2)
    assert burst["ttft_p50_ratio"] == pytest.approx(0.25) and burst["tpot_p50_ratio"] == pytest.approx(1.0)
    assert (tmp_path / "multimodel_x2.png").stat().st_size > 0

    elastic = json.loads((tmp_path / "elastic_x2.json").read_text())
    elastic["traffic"]["burst_rate"] = 27.0
    (tmp_path / "elastic_x2.json").write_text(json.dumps(elastic))
    with pytest.raises(SystemExit, match="different traffic \\(burst_rate 40.0 vs 27.0\\)"):
        multimodel.compare(args)

    # Runs that say where they ran: two hosts of one GPU model compare (and say so); two GPU models do not.
    elastic["traffic"]["burst_rate"] = 40.0
    static = json.loads((tmp_path / "static_x2.json").read_text())
    static["machine"] = {"host": "a", "gpu": "NVIDIA H100 80GB HBM3"}
    elastic["machine"] = {"host": "b", "gpu": "NVIDIA H100 80GB HBM3"}
    for config, run in (("static", static), ("elastic", elastic)):
        (tmp_path / f"{config}_x2.json").write_text(json.dumps(run))
    assert multimodel.compare(args)["machines"]["elastic"]["host"] == "b"
    elastic["machine"]["gpu"] = "NVIDIA H200"
    (tmp_path / "elastic_x2.json").write_text(json.dumps(elastic))
    with pytest.raises(SystemExit, match="static run .* ran on NVIDIA H100 80GB HBM3, the elastic one on NVIDIA H200"):
        multimodel.compare(args)


# A server's two processes, as ``serve`` tells them apart: the front end burns ~0.6 s of CPU, its child (named
# like vLLM's EngineCore in its command line, which the front end's own must not hold) ~1.2 s; both then wait
# to be read.
BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
BURNING_SERVER = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {BURN + "print('burnt', flush=True); time.sleep(120)"!r}, "1.2",
                          "Engine" + "Core"], stdout=subprocess.PIPE, text=True)
sys.argv[1:] = ["0.6"]
exec({BURN!r})
child.stdout.readline()
print("burnt", flush=True)
time.sleep(120)
"""


def test_burst_periods_follow_each_models_own_bursts():
    """Per-burst figures split a model's requests at the start of each of its bursts, as the schedule placed
    them: staggered, the second of two models' first period is its idle lead-in; aligned, every model's
    periods start together."""
    multimodel = load_multimodel()
    traffic = {"duration": 120.0, "period_s": 40.0, "burst_s": 10.0}
    assert multimodel.burst_windows(0, 2, traffic) == [(0.0, 40.0), (40.0, 80.0), (80.0, 120.0)]
    assert multimodel.burst_windows(1, 2, traffic) == [(0.0, 20.0), (20.0, 60.0), (60.0, 100.0), (100.0, 120.0)]
    assert multimodel.burst_windows(1, 2, {**traffic, "pattern": "aligned"}) == multimodel.burst_windows(0, 2, traffic)
    third = multimodel.burst_windows(2, 3, {**traffic, "duration": 50.0})
    assert third[0][0] == 0.0 and third[1][0] == pytest.approx(80 / 3) and third[-1][1] == 50.0


def test_cpu_seconds_counts_each_role_of_a_server_session_from_proc():
    """``cpu_seconds`` reads /proc for real: two live processes of one session, each charged to its role."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BURNING_SERVER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "burnt"
        used = suite.cpu_seconds(proc.pid)
        assert set(used) == {"engine_core", "front_end"}
        assert 1.1 <= used["engine_core"] < 1.6, used
        assert 0.5 <= used["front_end"] < 1.0, used
        assert suite.cpu_seconds(proc.pid, engine_process="no-such-title").keys() == {"front_end"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_engine_counters_are_read_from_the_exposition_vllm_writes():
    """The names in ``SERVE_COUNTERS`` against prometheus_client's own exposition (what vLLM's ``/metrics``
    serves): histograms as ``_count``/``_sum``, counters as ``_total``, each read once per scrape; then one
    rate's engine figures from two scrapes."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    labels = {"labelnames": ["model_name"], "registry": registry}
    steps = prometheus_client.Histogram("vllm:iteration_tokens_total", "", buckets=[1, 512, 8192], **labels)
    itl = prometheus_client.Histogram("vllm:inter_token_latency_seconds", "", **labels)
    preempted = prometheus_client.Counter("vllm:num_preemptions", "", **labels)
    steps, itl, preempted = (metric.labels("m") for metric in (steps, itl, preempted))  # vLLM labels at start
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        reader = object.__new__(suite.Server)
        reader.port = server.server_port
        before = reader.metrics(*suite.SERVE_COUNTERS)
        for tokens in (480, 480, 8192, 480):
            steps.observe(tokens)
        for gap in (0.03, 0.05):
            itl.observe(gap)
        preempted.inc(2)
        grew = suite.counter_deltas(before, reader.metrics(*suite.SERVE_COUNTERS))
    finally:
        server.shutdown()
        thread.join()
    assert grew["vllm:num_preemptions"] == 2
    assert "vllm:prefix_cache_hits" not in grew  # not exported here: left out, not zero
    figures = suite.engine_figures(grew, {"engine_core": 1.5, "front_end": 0.5}, 2.0)
    assert figures["steps"] == 4 and figures["tokens_per_step"] == (3 * 480 + 8192) / 4
    assert figures["engine_itl_ms"] == pytest.approx(40.0)
    assert figures["engine_core_cores"] == 0.75 and figures["front_end_cpu_s"] == 0.5


def test_serve_pairs_each_wave_with_vanillas_same_round_and_wave():
    """A saturation rate runs in waves: each kvcached wave is compared with vanilla's wave of the same round,
    and the engine's figures are summarised beside the client's."""

    def run(round_: int, wave: int, throughput: float, itl: float) -> dict:
        figures = {"ok": 480, "failed": 0, "errors": [], "request_throughput": throughput, "tpot_p50": 0.04}
        return {"round": round_, "wave": wave, **figures, "engine": {"engine_itl_ms": itl}}

    by_side = {
        "vanilla_rounds": [run(0, 0, 90, 30), run(0, 1, 60, 50), run(1, 0, 80, 40)],
        "kvcached_rounds": [run(0, 1, 60, 50), run(0, 0, 45, 60), run(1, 0, 80, 40), run(1, 1, 70, 45)],
    }
    suite.summarise_rounds(by_side, ["vanilla", "kvcached"])
    # pairs: (0, 0) 45/90, (0, 1) 60/60, (1, 0) 80/80; kvcached's (1, 1) has no vanilla wave to pair with
    assert by_side["ratio_kvcached"]["request_throughput"] == 1.0
    assert by_side["ratio_range_kvcached"]["request_throughput"] == [0.5, 1.0]
    assert by_side["ratio_range_kvcached"]["engine_itl_ms"] == [1.0, 2.0]
    assert by_side["kvcached"]["engine_itl_ms"] == 47.5 and by_side["vanilla"]["engine_itl_ms"] == 40
    assert by_side["ratio_kvcached"]["ttft_p50"] is None  # not recorded: no ratio rather than an error


def test_sides_run_in_the_order_given_and_pair_with_vanilla_wherever_it_stands(monkeypatch):
    """A call of one round can put kvcached first, so that pairs made over several calls alternate: the first
    round runs the sides in the order given, the next reverses it, and the ratios still divide by vanilla."""
    parser = argparse.ArgumentParser(prog="suite")
    suite.add_sides_argument(parser)
    monkeypatch.delenv("KVCACHED_BENCH_RATES", raising=False)
    monkeypatch.delenv("KVCACHED_BENCH_PROFILE_RATES", raising=False)
    args = parser.parse_args(["--sides", "kvcached,vanilla,kvcached"])
    suite.check_sides(parser, args)
    assert [name for name, _, _ in args.sides] == ["kvcached", "vanilla"]
    assert [name for name, _, _ in suite.round_order(args.sides, 1)] == ["vanilla", "kvcached"]

    run = {"ok": 480, "failed": 0, "errors": [], "round": 0, "wave": 0}
    by_side = {
        "kvcached_rounds": [{**run, "request_throughput": 45.0}],
        "vanilla_rounds": [{**run, "request_throughput": 50.0}],
    }
    suite.summarise_rounds(by_side, ["kvcached", "vanilla"])
    assert by_side["ratio_kvcached"]["request_throughput"] == 0.9 and "ratio_vanilla" not in by_side


def test_offline_ratios_are_given_pair_by_pair_pooled_and_after_each_engines_first_batch():
    """Each engine's first timed batch is where a kvcached pool grows from empty: the ratio over the later
    batches shows the steady state apart from that growth (SGLang run 9's third pair, in seconds)."""

    def engine(round_: int, seconds_each: list[float]) -> dict:
        middle = sorted(seconds_each)[1]
        tokens = {"seconds": middle, "seconds_each": seconds_each, "output_tokens_per_s": 1000 / middle}
        return {"round": round_, "startup_s": 30.0, "throughput": tokens, "tokens": [[1, 2]], "kv_tokens": 541270}

    result = suite.summarise_offline(
        {"vanilla": [engine(0, [13.93, 14.05, 13.99])], "kvcached": [engine(0, [14.57, 14.66, 14.27])]}
    )
    assert result["ratio_kvcached"] == pytest.approx(13.99 / 14.57)
    assert result["pooled_ratio_kvcached"] == pytest.approx(13.99 / 14.57)
    assert result["later_ratio_kvcached"] == pytest.approx(((14.05 + 13.99) / 2) / ((14.66 + 14.27) / 2))
    assert result["rounds"]["kvcached"][0]["kv_tokens"] == 541270
    assert result["rounds"]["kvcached"][0]["identity"]["identical"] == 1


def test_offline_starts_no_engine_that_cannot_finish_before_the_budget_ends(tmp_path, monkeypatch):
    """run.sh stops whatever still runs when its budget is spent: an engine started too late spends device
    time and measures nothing. So ``offline`` starts the next engine only if the time left covers the
    longest one so far; without a deadline (the harness run by hand) every engine runs. The engines here are
    a function taking 0.3 s (no GPU)."""
    ran: list[bool] = []

    def engine(args, kvcached, extra, logfile, env=None):
        ran.append(kvcached)
        time.sleep(0.3)
        tokens = {"seconds": 1.0, "seconds_each": [1.0], "output_tokens_per_s": 1.0}
        return {"startup_s": 0.1, "throughput": tokens, "tokens": [[1, 2]]}

    monkeypatch.setattr(suite, "run_offline_engine", engine)
    args = argparse.Namespace(sides=[suite.SERVER_SIDES[0], suite.SERVER_SIDES[1]], rounds=2, out=str(tmp_path))
    monkeypatch.delenv("KVCACHED_BENCH_DEADLINE", raising=False)
    assert suite.offline_rounds(args)["rounds"]["kvcached"] and ran == [False, True, True, False]

    ran.clear()
    monkeypatch.setenv("KVCACHED_BENCH_DEADLINE", str(time.time() + suite.PACK_MARGIN_S + 0.5))
    result = suite.offline_rounds(args)
    assert ran == [False]  # 0.2 s left after the first engine's 0.3 s: the second is not started
    assert result["stopped_for_budget"]["side"] == "kvcached" and result["stopped_for_budget"]["round"] == 0
    assert json.loads((tmp_path / "offline.json").read_text())["stopped_for_budget"]["side"] == "kvcached"


def test_decode_gpu_time_is_compared_at_equal_load_over_the_bands_both_servers_reached():
    """A server that ran with more tokens in flight logs longer steps at the same cost per band: the
    equal-load ratio compares band by band, only where both have steps, and is absent where none is shared."""

    def run(round_: int, by_load: dict[str, float]) -> dict:
        figures = {"ok": 480, "failed": 0, "errors": [], "request_throughput": 60.0}
        return {"round": round_, "wave": 0, **figures, "engine": {"decode_gpu_ms_by_load": by_load}}

    by_side = {
        "vanilla_rounds": [run(0, {"20": 5.0, "25": 5.5, "30": 6.0}), run(1, {"20": 5.0}), run(2, {"30": 6.0})],
        "kvcached_rounds": [run(0, {"25": 6.05, "30": 6.0, "40": 9.0}), run(1, {"20": 4.5}), run(2, {"40": 9.0})],
    }
    suite.summarise_rounds(by_side, ["vanilla", "kvcached"])
    # round 0: bands 25 (1.1) and 30 (1.0) in common, median 1.05; round 1: 0.9; round 2: no band in common
    assert by_side["ratio_range_kvcached"]["decode_gpu_ms_equal_load"] == [pytest.approx(0.9), pytest.approx(1.05)]
    assert by_side["ratio_kvcached"]["decode_gpu_ms_equal_load"] == pytest.approx((0.9 + 1.05) / 2)


def test_a_serve_file_written_mid_run_holds_the_pairs_finished_so_far(tmp_path):
    """``serve`` and ``serve-ab`` rewrite their file after every rate or round; a run the budget cuts keeps
    the ratios of the pairs it finished (run 18 lost them: they were computed only at the phase's end)."""
    run = {"ok": 480, "failed": 0, "errors": [], "round": 0, "wave": 0}
    result = {
        "rates": {
            "inf": {
                "vanilla_rounds": [{**run, "request_throughput": 50.0}],
                "kvcached_rounds": [{**run, "request_throughput": 55.0}, {**run, "round": 1, "request_throughput": 9}],
            }
        }
    }
    args = argparse.Namespace(out=str(tmp_path), sides=[("vanilla", False, None), ("kvcached", True, None)])
    suite.write_serve(args, "serve_ab", result)
    written = json.loads((tmp_path / "serve_ab.json").read_text())["rates"]["inf"]
    assert written["ratio_kvcached"]["request_throughput"] == 1.1  # round 1 has no vanilla wave yet
    assert written["kvcached"]["ok"] == 960


def test_host_cpu_seconds_sees_this_process_burn():
    """The whole machine's busy CPU from /proc/stat grows by at least what this process burns."""
    before = machine_load.host_cpu_seconds()
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    after = machine_load.host_cpu_seconds()
    assert after["busy"] - before["busy"] >= 0.45
    assert after["steal"] >= before["steal"] >= 0


def test_gpu_clocks_summarises_what_nvidia_smi_printed(tmp_path, monkeypatch):
    """``nvidia-smi`` is a script here (no GPU): it prints what the real one prints with ``-lms``, a row
    per sample, ``[N/A]`` where a figure is missing, until it is stopped; without it there is nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine_load.GpuClocks().stop() == {}
    fake = tmp_path / "nvidia-smi"
    rows = ["1980, 350.5, 41, 0x0000000000000000", "1755, 690.0, 48, 0x0000000000000004", "[N/A], [N/A], 47, 0x0"]
    body = "".join(f"echo '{row}'\n" for row in rows)
    fake.write_text(f"#!/bin/sh\n{body}echo '1980, 700.0, 49, 0x0000000000000004'\necho '19'\nexec sleep 60\n")
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    clocks = machine_load.GpuClocks()
    time.sleep(0.5)
    seen = clocks.stop()
    assert seen["samples"] == 3 and seen["sm_mhz_p50"] == 1980 and seen["sm_mhz_min"] == 1755
    assert seen["power_w_p50"] == 690.0 and seen["temperature_c_max"] == 49
    assert seen["clock_events"] == ["0x0000000000000000", "0x0000000000000004"]


def test_each_timed_batch_records_the_machine_load_beside_it(tmp_path, monkeypatch):
    """An offline engine's batches carry the GPU's clocks and the host's busy cores of their own span, so a
    pair run minutes apart on a noisy machine shows which batch the machine slowed. The engine is a function
    burning this process's CPU (no GPU here) and ``nvidia-smi`` a script printing one sample per start."""
    import offline_engine

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '1410, 600.0, 50, 0x0000000000000004'\nexec sleep 60\n")
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path / "runtime"))  # no kvcached pool: zero activity

    def generate(prompts: list[list[int]]) -> int:
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        time.sleep(0.2)  # nvidia-smi's sample arrives while the batch runs
        return 16 * len(prompts)

    result = offline_engine.timed_batches(generate, [[1, 2, 3]] * 4, 3, repeats=2)
    assert len(result["load_each"]) == len(result["seconds_each"]) == 2
    for load in result["load_each"]:
        assert load["gpu"]["sm_mhz_p50"] == 1410 and load["gpu"]["clock_events"] == ["0x0000000000000004"]
        assert load["host"]["busy_cores"] >= 0.5 and load["host"]["steal_cores"] >= 0
    assert result["kvcached_each"][0]["page_maps"] == 0


def test_a_run_records_the_gpu_nvidia_smi_names_and_the_host(tmp_path, monkeypatch):
    """``gpu_machine`` asks ``nvidia-smi`` (a script here) for the GPU the run uses; without it, the host and
    the time alone."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert set(machine_load.gpu_machine("0")) == {"host", "started_utc"}
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n[ \"$4\" = 1 ] && echo 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04'\n")
    fake.chmod(0o700)
    assert "gpu" not in machine_load.gpu_machine("0")  # the GPU asked for, not another: nvidia-smi printed nothing
    machine = machine_load.gpu_machine("1")
    assert machine["gpu"] == "NVIDIA H100 80GB HBM3" and machine["gpu_memory"] == "81559 MiB"
    assert machine["driver"] == "580.159.04" and machine["host"]


def load_sglang_suite(monkeypatch):
    """``benchmarks/gpu/sglang/suite.py`` as a module (it imports no SGLang at the top)."""
    folder = os.path.join(os.path.dirname(HARNESS), "sglang")
    monkeypatch.syspath_prepend(folder)  # where the script finds its own modules when run
    spec = importlib.util.spec_from_file_location("sglang_suite", os.path.join(folder, "suite.py"))
    sglang_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sglang_suite)
    return sglang_suite


def test_sglang_decode_lines_give_the_step_and_the_gpu_time_per_step(monkeypatch):
    """Lines as SGLang 0.5.16 logs them (the first two with its device timer on): 64 requests at 8000
    tokens/s are 8 ms a step, 75 % of it on the GPU; a window without a forward timing or without tokens
    adds no GPU time (or nothing)."""
    sglang_suite = load_sglang_suite(monkeypatch)
    head = "[2026-12-06 00:05:58] Decode batch, #running-req: "
    lines = [
        head + "64, #token: 40000, token usage: 0.14, cuda graph: True, gen throughput (token/s): 8000.00, "
        "#queue-req: 0, fwd occupancy: 75.00%",
        head + "32, #token: 20000, token usage: 0.07, cuda graph: True, gen throughput (token/s): 8000.00, "
        "#queue-req: 0, fwd occupancy: 50.00%",
        head + "16, #token: 9000, token usage: 0.03, cuda graph: True, gen throughput (token/s): 4000.00, "
        "#queue-req: 0, fwd occupancy: nan%",
        head + "2, #token: 1037, token usage: 0.00, cuda graph: True, gen throughput (token/s): 0.00, #queue-req: 0",
        "[2026-12-06 00:05:58] Prefill batch, #new-seq: 1, #new-token: 25, #running-req: 0",
    ]
    figures = sglang_suite.decode_figures(lines)
    assert figures == {
        "decode_step_ms": 4.0,
        "decode_step_ms_per_ktoken": pytest.approx(0.2),  # windows of 8/40, 4/20 and 4/9 ms per ktoken
        "decode_gpu_ms": pytest.approx((6.0 + 2.0) / 2),
        "decode_gpu_ms_per_ktoken": pytest.approx((6.0 / 40 + 2.0 / 20) / 2),
        "decode_gpu_ms_by_load": {"20": pytest.approx(2.0), "40": pytest.approx(6.0)},  # bands of 5k tokens
    }
    assert sglang_suite.decode_figures(lines[3:]) == {}


def test_sglang_servers_get_an_equal_share_of_the_whole_gpu_whatever_started_first(tmp_path, monkeypatch):
    """SGLang reads ``--mem-fraction-static`` as a fraction of the memory free when it starts; ``serve-ab``
    means a share of the whole GPU, so the flag grows with what earlier servers hold, and every pool gets the
    same token cap. ``nvidia-smi`` is a script here (no GPU) printing the free MiB; the model is its config
    and a weights file of 1 GiB."""
    sglang_suite = load_sglang_suite(monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    config = {"num_hidden_layers": 32, "num_key_value_heads": 8, "hidden_size": 1024, "num_attention_heads": 8}
    (model / "config.json").write_text(json.dumps(config))
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(1 << 30)
    assert sglang_suite.kv_bytes_per_token(str(model)) == 128 << 10  # Llama-3-8B's: 32 layers x 8 x 128 x K,V x 2 B
    fake = tmp_path / "nvidia-smi"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(suite, "TOTAL", 80000 << 20)
    tokens = str(int(0.9 * (0.45 * (80000 << 20) - (1 << 30)) / (128 << 10)))
    fake.write_text("#!/bin/sh\necho 80000\n")
    fake.chmod(0o700)
    first = sglang_suite.SGLangServer.memory_flags("0.45", str(model))
    assert first == ["--mem-fraction-static", "0.450", "--max-total-tokens", tokens]
    fake.write_text("#!/bin/sh\necho 40000\n")  # the first server holds half the GPU
    second = sglang_suite.SGLangServer.memory_flags("0.45", str(model))
    assert second == ["--mem-fraction-static", "0.900", "--max-total-tokens", tokens]
    fake.write_text("#!/bin/sh\necho 30000\n")
    with pytest.raises(RuntimeError, match=r"GPU 0 has 29.3 GiB free, less than the 35.2 GiB asked for"):
        sglang_suite.SGLangServer.memory_flags("0.45", str(model))


def test_serve_runs_the_rates_asked_for_and_refuses_unknown_ones(monkeypatch):
    monkeypatch.delenv("KVCACHED_BENCH_RATES", raising=False)
    assert suite.serve_rates() == suite.SERVE_RATES
    monkeypatch.setenv("KVCACHED_BENCH_RATES", "inf,16")
    assert [rate for rate, *_ in suite.serve_rates()] == [16.0, float("inf")]
    monkeypatch.setenv("KVCACHED_BENCH_RATES", "32")
    with pytest.raises(RuntimeError, match="name rates among 16, 64 and inf"):
        suite.serve_rates()


def test_serve_ab_profiles_saturation_unless_told_which_rates(monkeypatch):
    monkeypatch.delenv("KVCACHED_BENCH_PROFILE_RATES", raising=False)
    assert suite.profiled_rates() == {float("inf")}
    monkeypatch.setenv("KVCACHED_BENCH_PROFILE_RATES", "64,inf")
    assert suite.profiled_rates() == {64.0, float("inf")}
    monkeypatch.setenv("KVCACHED_BENCH_PROFILE_RATES", "sat")
    with pytest.raises(RuntimeError, match="KVCACHED_BENCH_PROFILE_RATES='sat': name rates among"):
        suite.profiled_rates()


def test_sides_are_checked_before_any_engine_starts_and_the_peer_gets_its_environment(tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="suite")
    suite.add_sides_argument(parser)
    (tmp_path / "_site").mkdir()
    monkeypatch.setattr(suite, "PEER_PATH", str(tmp_path))
    monkeypatch.delenv("KVCACHED_BENCH_RATES", raising=False)
    args = parser.parse_args(["--sides", "vanilla,kvcached-watch100,peer", "--rounds", "2"])
    suite.check_sides(parser, args)
    assert [name for name, _, _ in args.sides] == ["vanilla", "kvcached-watch100", "peer"]
    assert args.sides[1][2] == {"KVCACHED_WATCH_INTERVAL_MS": "100"}
    peer = args.sides[2][2]
    assert peer["ENABLE_KVCACHED"] == "true" and peer["PYTHONPATH"].startswith(f"{tmp_path}/_site{os.pathsep}")
    monkeypatch.setenv("KVCACHED_BENCH_PROFILE_RATES", "16,fast")
    with pytest.raises(SystemExit):
        suite.check_sides(parser, parser.parse_args(["--sides", "vanilla,kvcached"]))
    assert "KVCACHED_BENCH_PROFILE_RATES='16,fast'" in capsys.readouterr().err


def test_same_machine_runs_each_configuration_with_its_preset_beside_a_copy_of_the_static_run(tmp_path):
    """benchmarks/gpu/multimodel/same_machine.sh with ``python3`` on PATH replaced by a recorder (run.py needs
    vLLM and a GPU): what runs, in which folder, with which KVCACHED_* settings; a setting of the caller's
    wins over the preset."""
    script = os.path.join(os.path.dirname(HARNESS), "multimodel", "same_machine.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "python3"
    recorder.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import json, os, sys
            args = sys.argv[2:]
            out = args[args.index("--out") + 1]
            env = {{k: v for k, v in os.environ.items() if k.startswith("KVCACHED_")}}
            call = {{"command": args[0], "out": os.path.basename(out), "args": args, "env": env}}
            with open({str(tmp_path / "calls.jsonl")!r}, "a") as f:
                f.write(json.dumps(call) + "\\n")
            if args[0] == "static":
                open(os.path.join(out, "static_x2.json"), "w").write("{{}}")
            """
        )
    )
    recorder.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", script, str(out), "static", "fair", "floor", "--", "--models", "2"], env=env, capture_output=True
    )
    assert run.returncode == 0, run.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [(c["command"], c["out"]) for c in calls] == [
        ("static", "static"),
        ("elastic", "fair"),
        ("compare", "fair"),
        ("elastic", "floor"),
        ("compare", "floor"),
    ]
    assert all(c["args"][-2:] == ["--models", "2"] for c in calls)
    fair, floor = calls[1]["env"], calls[3]["env"]
    assert fair["KVCACHED_FAIR_SHARE_WAIT_MS"] == "5000" and fair["KVCACHED_KV_LAYOUT"] == "block-outer"
    assert "KVCACHED_FAIR_SHARE_FLOOR" not in fair and "KVCACHED_FAIR_SHARE" not in calls[0]["env"]
    assert floor["KVCACHED_FAIR_SHARE_FLOOR"] == "0.5" and floor["KVCACHED_BLOCK_PLACEMENT"] == "request"
    assert (out / "fair" / "static_x2.json").exists() and (out / "floor" / "static_x2.json").exists()

    run = subprocess.run(["bash", script, str(out), "floor"], env={**env, "KVCACHED_FAIR_SHARE_FLOOR": "0.25"})
    assert run.returncode == 0
    last = json.loads((tmp_path / "calls.jsonl").read_text().splitlines()[-2])
    assert last["command"] == "elastic" and last["env"]["KVCACHED_FAIR_SHARE_FLOOR"] == "0.25"

    # no static run to compare with: nothing runs for that configuration, and it says why
    run = subprocess.run(["bash", script, str(tmp_path / "empty"), "fair"], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "run 'static' first" in run.stderr
    assert not (tmp_path / "empty" / "fair").exists()
