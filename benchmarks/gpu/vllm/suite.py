"""kvcached-vllm on a GPU, measured against vLLM without kvcached in the same run. Prints and writes JSON.

    python suite.py PHASE [PHASE ...] --out DIR [--model DIR]

Phases (each writes DIR/<phase>.json; ``share`` also a PNG):

- ``offline``: offline throughput of fresh engines, one per side of ``--sides`` (vanilla, kvcached, kvcached
  with 2 MiB pages, kvcached keeping its memory mapped, kvcached with the block-outer layout, the peer) in each of
  ``--rounds`` rounds, the order reversed every other round; each engine the median of three timed batches
  with kvcached's map and unmap calls per batch; the ratio to vanilla pair by pair (median and range) and
  over every batch pooled.
- ``identity``: greedy tokens of fresh engines alternating without/with kvcached, prefix caching off and on,
  every engine core in-process, where both sides batch alike: every token must be identical.
- ``backstop``: greedy tokens of kvcached with the backstop off (``KVCACHED_BACKSTOP=0``) against vanilla.
- ``serve``: one ``vllm serve`` without kvcached, one with it, one with it and 2 MiB pages; an open-loop
  client (Poisson arrivals, streaming) at three request rates up to saturation: TTFT and TPOT p50/p99,
  request throughput, failures, and kvcached's map/unmap calls per rate.
- ``burst``: a burst of 64 prompts of 2048 tokens arriving at an idle server (without kvcached, with it, with
  it and 2 MiB pages): TTFT while the KV cache grows, and kvcached's map calls.
- ``share`` / ``share3``: two (three) engines started at the same moment on one GPU, each sized with
  ``--gpu-memory-utilization`` to a virtual KV capacity close to the whole GPU; bursts to each in turn;
  every engine's mapped KV memory sampled every 50 ms (PNG). Reports each burst's peak against the first
  burst's (which ran with the other engines empty), the hand-over times (release: an engine's memory back
  after its burst; take-over: the next engine holding memory the previous one held), failed requests,
  preemptions, and the cached-prefix blocks idle engines gave back under pressure.
- ``limit``: ``kvctl limit`` on a live engine in the middle of a burst: the cap holds, vLLM preempts and
  recovers, every request completes.
- ``tp``: ``offline`` identity at tensor-parallel size 2 (the mirror path: a worker process per GPU).
- ``model``: only make the model (before streams that share it start).

The model is random, made here, with Llama-3-8B's KV shape (32 layers, 8 KV heads of 128, bfloat16: 128 KiB
of KV per token, 2 MiB per 16-token block) and small hidden and MLP sizes. Requires vLLM's CUDA build with
kvcached-vllm installed; see README.md in this folder for running it on the lent H200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from machine_load import MachineLoad  # this folder, like offline_engine
from offline_engine import kv_activity  # this folder (sys.path[0], or put first by the SGLang harness)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
GiB = 1 << 30


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_model(path: str) -> str:
    sys.path.insert(0, os.path.join(REPO, "examples", "01_two_engines"))
    from tiny_model import make_tiny_llama

    return make_tiny_llama(
        path,
        layers=32,
        hidden=1024,
        heads=8,
        kv_heads=8,
        head_dim=128,
        intermediate=2048,
        dtype="bfloat16",
        max_positions=8192,
    )


def engine_env(kvcached: bool, gpu: str | None = None) -> dict[str, str]:
    env = dict(os.environ, KVCACHED_ENABLE="1" if kvcached else "0", PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def write(out: str, name: str, data: dict) -> None:
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    log(f"wrote {name}.json")


# -- offline ---------------------------------------------------------------------------------------------


def wait_for_empty_gpus(timeout: float = 180) -> float:
    """Wait until the GPUs this run uses hold under 2 GiB: an engine that has just exited may still be
    handing its memory back, and the next one would see it as taken. Returns the seconds waited; raises
    RuntimeError if they still hold more after ``timeout`` (a run measured beside a leftover engine would
    measure that engine's share of the GPU too)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    started = time.monotonic()
    while True:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", visible],
            capture_output=True,
            text=True,
        )
        used = [int(x) for x in out.stdout.split()] if out.returncode == 0 else []
        if used and max(used) < 2048:
            return time.monotonic() - started
        if time.monotonic() - started >= timeout:
            held = f"{max(used)} MiB" if used else f"unknown memory (nvidia-smi: {out.stderr.strip()[:200]})"
            raise RuntimeError(
                f"GPU {visible} still holds {held} after {timeout:.0f} s; stop what holds it "
                "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv) and run again"
            )
        time.sleep(1)


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM (what ``timeout`` sends) raise SystemExit, so that :func:`serving` stops every server it
    started: a server left running keeps its port and its GPU memory, and the next run would measure it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def run_offline_engine(
    args: argparse.Namespace,
    kvcached: bool,
    extra: list[str],
    logfile: str,
    env: dict[str, str] | None = None,
    script: str | None = None,
) -> dict:
    """One offline engine (``script``, default ``args.offline_engine``: a script taking the model and printing
    ``RESULT {json}``) in a process of its own."""
    wait_for_empty_gpus()
    cmd = [sys.executable, script or args.offline_engine, args.model, *extra]
    with open(logfile, "a") as f:
        f.write(f"\n=== kvcached={kvcached} {' '.join(extra)} {env or ''}\n")
        f.flush()
        proc = subprocess.run(
            cmd,
            env={**engine_env(kvcached, args.gpu), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            cwd=tempfile.gettempdir(),
            timeout=900,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "stdout_tail": proc.stdout[-2000:], "log_tail": _tail(logfile)}
    return json.loads(lines[-1][len("RESULT ") :])


def _tail(path: str, lines: int = 15) -> list[str]:
    """The last lines of a log that name an error (what a failed engine said), or its last lines."""
    with open(path, errors="replace") as f:
        text = f.read().splitlines()
    errors = [ln[:300] for ln in text if "Error" in ln or "error" in ln]
    return errors[-lines:] or [ln[:300] for ln in text[-lines:]]


def identity(van: dict, kvc: dict) -> dict:
    differ = [i for i, (a, b) in enumerate(zip(van["tokens"], kvc["tokens"], strict=True)) if a != b]
    prompts = len(van["tokens"])
    return {
        "prompts": prompts,
        "identical": prompts - len(differ),
        "differ": differ,
        "tokens_each": len(van["tokens"][0]),
    }


# vLLM's engine core in the driver's process: LLM.generate hands it every prompt before its first step. With
# a core process of its own, each step batches whatever requests have reached it over its socket, so two runs
# of vLLM alone can batch differently, which moves bf16 rounding (and a near-tie greedy token).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def phase_identity(args: argparse.Namespace) -> dict:
    """Greedy identity on its own: fresh engines alternating without/with kvcached, prefix caching off then
    on, 256 prompts of 128 greedy tokens each, every engine core in-process (:data:`IN_PROCESS`) so that both
    sides batch alike. ``identity.json`` is rewritten after every engine."""
    return alternate_engines(args, "identity", ["--throughput-prompts", "0"], env=IN_PROCESS)


def phase_offline(args: argparse.Namespace, tp: int = 1) -> dict:
    """Offline throughput (TP=1): :func:`offline_rounds`. At TP > 1, greedy identity of fresh engines
    alternating without/with kvcached (``tp2.json``)."""
    if tp == 1:
        return offline_rounds(args)
    return alternate_engines(args, f"tp{tp}", ["--tp", str(tp), "--throughput-prompts", "0"], tp=tp)


def offline_rounds(args: argparse.Namespace) -> dict:
    """Offline throughput of fresh engines, one per side of ``--sides`` in each of ``--rounds`` rounds, the
    order reversed every other round (vanilla, kvcached, kvcached, vanilla, ...) so that drift between engine
    starts does not favour one side. Each engine: 32 greedy prompts, then the median of three timed batches of
    1024 prompts x (512 + 256) tokens, prefix caching off. One pair of engines resolves ~10 % (an engine's
    batches spread that much), so the ratio is given pair by pair, as the median and the range over rounds,
    and over every batch of every engine pooled. ``offline.json`` is rewritten after every engine."""
    logfile = os.path.join(args.out, "offline.log")
    extra = ["--identity-prompts", "32", "--throughput-prompts", "1024"]
    runs: dict[str, list[dict]] = {side: [] for side, _, _ in args.sides}
    result: dict = {}
    longest = 0.0  # the longest engine so far: what the next one is expected to take
    for round_ in range(args.rounds):
        for side, kvcached, env in round_order(args.sides, round_):
            left = seconds_left()
            if left is not None and left < longest:
                log(f"offline: {left:.0f} s of the budget left, an engine took {longest:.0f} s: no more engines")
                result["stopped_for_budget"] = {"round": round_, "side": side, "seconds_left": round(left)}
                write(args.out, "offline", result)
                return result
            log(f"offline {side} (round {round_ + 1} of {args.rounds})")
            begin = time.monotonic()
            run = run_offline_engine(args, kvcached, extra, logfile, env)
            longest = max(longest, time.monotonic() - begin)
            runs[side].append({"round": round_, **run})
            result = summarise_offline(runs)
            write(args.out, "offline", result)
    return result


# Seconds kept back at the end of run.sh's budget for what follows the phases (packing the results).
PACK_MARGIN_S = 20


def seconds_left() -> float | None:
    """Seconds until run.sh stops this run (``KVCACHED_BENCH_DEADLINE``, epoch seconds, less
    :data:`PACK_MARGIN_S`), or None when no deadline was set (the harness run by hand). A phase that knows
    how long its next engine takes starts it only if it can finish: an engine cut by the budget spends
    minutes of device time and measures nothing."""
    deadline = os.environ.get("KVCACHED_BENCH_DEADLINE")
    if not deadline:
        return None
    return float(deadline) - PACK_MARGIN_S - time.time()


def round_order(sides: list[tuple], round_: int) -> list[tuple]:
    """The sides in their order in even rounds and reversed in odd ones (ABBA), against drift over a run."""
    return list(sides) if round_ % 2 == 0 else list(reversed(sides))


def summarise_offline(runs: dict[str, list[dict]]) -> dict:
    """Every engine's throughput, start-up and greedy tokens against vanilla's of the same round; per
    kvcached side the ratio of output tokens/s to vanilla's, pair by pair (median and range), and the ratio
    of the pooled medians of every timed batch, and of every batch after each engine's first (where a kvcached
    engine grows its pool from empty: what is left is the steady state)."""
    result: dict = {"rounds": {}, "errors": {}}
    vanilla = {r["round"]: r for r in runs.get("vanilla", []) if "throughput" in r}
    pooled: dict[str, list[float]] = {}
    later: dict[str, list[float]] = {}
    for side, side_runs in runs.items():
        result["rounds"][side] = []
        for run in side_runs:
            if "error" in run:
                result["errors"].setdefault(side, []).append({k: run.get(k) for k in ("round", "error", "log_tail")})
                continue
            entry = {"round": run["round"], "startup_s": run["startup_s"], **run.get("throughput", {})}
            if run.get("kv_tokens"):
                entry["kv_tokens"] = run["kv_tokens"]  # the pool the engine sized: a smaller one admits fewer
            van = vanilla.get(run["round"])
            if side != "vanilla" and van is not None:
                entry["ratio_output_tokens"] = entry["output_tokens_per_s"] / van["throughput"]["output_tokens_per_s"]
                entry["identity"] = identity(van, run)  # 32 prompts; engine cores in their own processes
            result["rounds"][side].append(entry)
            pooled.setdefault(side, []).extend(entry.get("seconds_each", []))
            later.setdefault(side, []).extend(entry.get("seconds_each", [])[1:])
            if run.get("pools"):
                result.setdefault("kvcached_pools", run["pools"])
    for side in result["rounds"]:
        ratios = [e["ratio_output_tokens"] for e in result["rounds"][side] if "ratio_output_tokens" in e]
        if ratios:
            result[f"ratio_{side}"] = statistics.median(ratios)
            result[f"ratio_range_{side}"] = [min(ratios), max(ratios)]
            if pooled.get("vanilla") and pooled.get(side):
                # the same batch on both sides: tokens/s ratio = vanilla's seconds over this side's
                result[f"pooled_ratio_{side}"] = statistics.median(pooled["vanilla"]) / statistics.median(pooled[side])
            if later.get("vanilla") and later.get(side):
                result[f"later_ratio_{side}"] = statistics.median(later["vanilla"]) / statistics.median(later[side])
    return result


def alternate_engines(
    args: argparse.Namespace, name: str, extra: list[str], tp: int = 1, env: dict[str, str] | None = None
) -> dict:
    """Offline engines with ``extra`` arguments (and ``env``), vanilla then kvcached, prefix caching off then
    on; ``name``.json (what :func:`compare_offline` makes of them) is rewritten after every engine."""
    logfile = os.path.join(args.out, f"{name}.log")
    runs: dict[str, dict] = {}
    plan = [("pc-off", []), ("pc-on", ["--prefix-caching"])]
    result: dict = {}
    for label, flags in plan:
        for side in ("vanilla", "kvcached"):
            log(f"{name} {label} {side}")
            runs[f"{label}/{side}"] = run_offline_engine(args, side == "kvcached", [*flags, *extra], logfile, env)
            result = compare_offline(runs, [label for label, _ in plan], tp)
            write(args.out, name, result)
    return result


def compare_offline(runs: dict[str, dict], labels: list[str], tp: int) -> dict:
    """Greedy identity and start-up of every with/without pair that has run."""
    result: dict = {"tp": tp, "identity": {}, "startup_s": {}}
    for label in labels:
        van, kvc = runs.get(f"{label}/vanilla"), runs.get(f"{label}/kvcached")
        if van is None or kvc is None:
            continue
        if "error" in van or "error" in kvc:
            failed = van if "error" in van else kvc
            result["identity"][label] = {
                "error": failed["error"],
                "log_tail": failed.get("log_tail"),
                "runs": [van, kvc],
            }
            continue
        result["identity"][label] = identity(van, kvc)
        result["startup_s"][label] = {"vanilla": van["startup_s"], "kvcached": kvc["startup_s"]}
        result.setdefault("kvcached_pools", kvc["pools"])
    return result


def phase_backstop(args: argparse.Namespace) -> dict:
    """One kvcached engine with the backstop off (``KVCACHED_BACKSTOP=0``) and one vanilla engine: whether this
    vLLM reads KV blocks it never allocated (the engine faults then), which is what the backstop is for."""
    logfile = os.path.join(args.out, "backstop.log")
    extra = ["--throughput-prompts", "0"]
    log("backstop: vanilla, then kvcached with the backstop off")
    van = run_offline_engine(args, False, extra, logfile)
    bare = run_offline_engine(args, True, extra, logfile, {"KVCACHED_BACKSTOP": "0"})
    for run in (van, bare):
        if "error" in run:
            return {"error": run["error"], "log_tail": run.get("log_tail")}
    return {"backstop_off": identity(van, bare)}


# -- servers and the open-loop client -------------------------------------------------------------------


def port_taken(port: int) -> bool:
    """Whether something on this machine accepts connections on ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Server:
    """One ``vllm serve`` (the OpenAI server module) in its own process group; other engines' servers
    override :meth:`command` and :attr:`ENGINE_PROCESS`."""

    # What the process that schedules and runs the model has in its command line (vLLM retitles it so).
    ENGINE_PROCESS = "EngineCore"

    @staticmethod
    def memory_flags(fraction: str, model: str) -> list[str]:
        """The flags that give the server of ``model`` ``fraction`` of the GPU's memory."""
        return ["--gpu-memory-utilization", fraction]

    def __init__(
        self,
        name: str,
        port: int,
        model: str,
        kvcached: bool,
        out: str,
        extra: list[str],
        gpu: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if port_taken(port):
            raise RuntimeError(
                f"port {port} already has a server (one left by an earlier run?); stop it "
                f"(fuser -k {port}/tcp) and run again"
            )
        self.name, self.port = name, port
        cmd = self.command(model, extra)
        self.logpath = os.path.join(out, f"server-{name}-{int(time.time())}.log")
        self.proc = subprocess.Popen(
            cmd,
            env={**engine_env(kvcached, gpu), **(env or {})},
            stdout=open(self.logpath, "w"),
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        self.started = time.monotonic()

    @staticmethod
    def front_ends() -> int:
        """``KVCACHED_BENCH_API_SERVERS``: the HTTP front-end processes each server starts (default 1)."""
        return int(os.environ.get("KVCACHED_BENCH_API_SERVERS", "1"))

    def command(self, model: str, extra: list[str]) -> list[str]:
        # One Python API server bounds a saturation wave on the H200 (results run 18: ~1 core busy while
        # EngineCore idled); KVCACHED_BENCH_API_SERVERS=N starts N of them the way `vllm serve` does.
        api_servers = self.front_ends()
        if api_servers > 1:
            entry = ["vllm.entrypoints.cli.main", "serve", model, "--api-server-count", str(api_servers)]
        else:
            entry = ["vllm.entrypoints.openai.api_server", "--model", model]
        return [
            sys.executable,
            "-m",
            *entry,
            "--served-model-name",
            self.name,
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--max-model-len",
            "4096",
            *extra,
        ]

    def wait_ready(self, timeout: float = 420) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        with open(self.logpath) as f:
            return f.read()[-3000:]

    def tail_lines(self) -> list[str]:
        with open(self.logpath) as f:
            return f.read().splitlines()

    # What kvcached logged in a server, by what each line starts with after "kvcached: ".
    NOTES = {
        "activation_hold": "torch holds this engine's activation peak",
        "activation_hold_failed": "could not hold",
        "gave_back": "gave back",
        "fair_share_yields": "a neighbour on",
        "fair_share_lifts": "no engine on",
    }

    def kvcached_notes(self) -> dict[str, int]:
        """How often kvcached logged each of :attr:`NOTES` in this server, and the MiB of activations torch
        holds (``activation_hold_mib``): what a run did beyond its numbers, kept in its JSON."""
        notes = dict.fromkeys(self.NOTES, 0)
        for line in self.tail_lines():
            _, sep, text = line.partition("kvcached: ")
            if not sep:
                continue
            for key, start in self.NOTES.items():
                if text.startswith(start):
                    notes[key] += 1
            if text.startswith(self.NOTES["activation_hold"]):
                notes["activation_hold_mib"] = int(text.rsplit("(", 1)[1].split()[0])
        return notes

    def log_size(self) -> int:
        """Bytes in the server's log now: where a later :meth:`step_figures` starts reading."""
        return os.path.getsize(self.logpath)

    def step_figures(self, since: int) -> dict[str, float]:
        """The engine's per-step figures from its log past byte ``since``; none here (vLLM's counters give
        them, :func:`engine_figures`)."""
        return {}

    def metric(self, name: str) -> float | None:
        """A Prometheus counter of the server, or None (not exported by this engine or not enabled)."""
        return self.metrics(name)[name]

    def metrics(self, *names: str) -> dict[str, float | None]:
        """Several counters from one read of ``/metrics`` (each None as in :meth:`metric`)."""
        found: dict[str, float | None] = dict.fromkeys(names)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except urllib.error.URLError:
            return found
        for line in text.splitlines():
            for name in names:
                if found[name] is None and line.startswith(name) and not line.startswith("#"):
                    found[name] = float(line.rsplit(" ", 1)[1])
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextmanager
def serving(servers: list[Server], result: dict, key: str = "error") -> Iterator[None]:
    """The body runs with ``servers`` up; a RuntimeError from it (an engine that exited, a start-up that
    timed out) is recorded as ``result[key]`` instead of ending the phase, and every server is stopped."""
    try:
        yield
    except RuntimeError as exc:
        result[key] = str(exc)
    finally:
        for server in servers:
            server.stop()
            result.setdefault("kvcached_log", {})[server.name] = server.kvcached_notes()


def client_session(total_s: float):
    """The streaming client's HTTP session: no connection limit, and a new connection for every request. A
    kept-alive connection that sat idle past the server's keep-alive timeout can be closed by the server
    just as a request is sent on it, which fails that request with a reset (seen between bursts)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=total_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def one_request(session, port: int, name: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": str(chunk["error"].get("message", chunk["error"]))[:200]}
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    first = first or now
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # a failed request is a result to count, not a crash of the client
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if first is None or tokens < max_tokens:
        return {"ok": False, "error": f"{tokens} of {max_tokens} tokens"}
    return {"ok": True, "ttft": first - sent, "tpot": (last - first) / max(1, tokens - 1), "end": time.perf_counter()}


def pct(values: list[float], q: int) -> float | None:
    """The q-th percentile (None for fewer than two values)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else None


async def open_loop(
    port: int, name: str, prompts: list[list[int]], rate: float, max_tokens: int, total_s: float = 1800
) -> dict:
    """Poisson arrivals at ``rate`` requests/s (inf: all at once), every request streamed; a request not
    finished ``total_s`` after the first was sent fails."""
    rng = random.Random(7)
    async with client_session(total_s) as session:
        tasks = []
        begin = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(session, port, name, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["ok"]]
    elapsed = max((r["end"] for r in ok), default=begin) - begin
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok]
    return {
        "rate": rate if rate != float("inf") else "inf",
        "requests": len(prompts),
        "ok": len(ok),
        "failed": len(prompts) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "request_throughput": len(ok) / elapsed if elapsed > 0 else None,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
    }


WARM_UP_S = 120  # 32 short requests finish in seconds on any engine that runs them


def warm_up(server: Server) -> None:
    """32 short requests at 8/s before a server is measured; RuntimeError (the side's error, and the run goes
    on) when any fails or is still unfinished after :data:`WARM_UP_S`: an engine that accepts requests but
    never schedules them would otherwise hold the call until its budget ends, with nothing recorded."""
    stats = asyncio.run(open_loop(server.port, server.name, token_prompts(32, 512, 1), 8.0, 16, WARM_UP_S))
    if stats["failed"]:
        raise RuntimeError(
            f"{server.name}: {stats['failed']} of {stats['requests']} warm-up requests failed or did not finish "
            f"in {WARM_UP_S} s ({'; '.join(stats['errors'])}): {server.tail()}"
        )


VOCAB = 256  # the model's vocabulary size, read in main()


def token_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (the model is random: the ids are what matters, not the text)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


# The server sides of ``serve`` and ``burst``: without kvcached, with it (its default pages: 32 MiB for this
# model's 4 GiB buffers on an H200), with it and 2 MiB pages (the finest; the default before run 6).
SERVER_SIDES = [
    ("vanilla", False, None),
    ("kvcached", True, None),
    ("kvcached-2M", True, {"KVCACHED_PAGE_BYTES": "2M"}),
    # a reclaim window of 10 minutes: what kvcached costs with its memory kept mapped (no unmap, no re-map)
    ("kvcached-kept", True, {"KVCACHED_RECLAIM_DELAY_MS": "600000"}),
    # every layer's block side by side in one buffer: a page moves 1/layers of what it moves otherwise
    ("kvcached-block-outer", True, {"KVCACHED_KV_LAYOUT": "block-outer"}),
    # ... with each request's blocks on pages of its own (what a yield to a neighbour costs in proportion)
    ("kvcached-request", True, {"KVCACHED_KV_LAYOUT": "block-outer", "KVCACHED_BLOCK_PLACEMENT": "request"}),
    # two pages (2 x 32 MiB in each buffer: 32k tokens here) mapped ahead by a background thread
    ("kvcached-ahead", True, {"KVCACHED_MAP_AHEAD_PAGES": "2"}),
    # no backstop under unmapped pages: every map and unmap one page-table change instead of two
    ("kvcached-nobackstop", True, {"KVCACHED_BACKSTOP": "0"}),
    # the watcher thread (device pressure, idle hold) waking every 100 ms instead of 10: what its wake-ups
    # cost the scheduler's thread through the interpreter lock
    ("kvcached-watch100", True, {"KVCACHED_WATCH_INTERVAL_MS": "100"}),
    # the peer project (ovg-project/kvcached), its vLLM patches on, ours off: see peer_env
    ("peer", False, None),
]
DEFAULT_SIDES = "vanilla,kvcached,kvcached-2M"
PEER_PATH = os.environ.get("KVCACHED_BENCH_PEER_PATH", "/tmp/peer-kv")


def peer_env() -> dict[str, str]:
    """The environment of a ``peer`` engine: the peer built by ``benchmarks/gpu/peer/build_peer.sh`` into
    :data:`PEER_PATH` first on PYTHONPATH, its ``.pth`` hook read (``PEER_PATH/_site``), and its switches on,
    as its README says to run it (``ENABLE_KVCACHED=true``, ``KVCACHED_AUTOPATCH=1``); kvcached's own plugin
    is off."""
    paths = [os.path.join(PEER_PATH, "_site"), PEER_PATH, os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}


def add_sides_argument(parser: argparse.ArgumentParser) -> None:
    """``--sides``: which of :data:`SERVER_SIDES` ``offline``, ``serve`` and ``burst`` run (a device call may
    not fit all); ``--rounds``: how many times ``offline`` and ``serve`` run them, alternating."""
    others = ",".join(side for side, _, _ in SERVER_SIDES[1:])
    parser.add_argument(
        "--sides",
        default=os.environ.get("KVCACHED_BENCH_SIDES", DEFAULT_SIDES),
        help=f"offline/serve/burst: vanilla plus any of {others}, the first round in this order "
        f"(default {DEFAULT_SIDES}, or KVCACHED_BENCH_SIDES)",
    )
    parser.add_argument(
        "--rounds",
        default=os.environ.get("KVCACHED_BENCH_ROUNDS", "1"),
        help="offline/serve: how many times to run the sides, alternating (default 1, or KVCACHED_BENCH_ROUNDS)",
    )


def check_sides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turns ``--sides`` into entries of :data:`SERVER_SIDES` and ``--rounds`` into a count, or exits with a
    one-line message."""
    names = [side for side, _, _ in SERVER_SIDES]
    if not str(args.rounds).isdigit() or int(args.rounds) < 1:
        parser.error(f"--rounds: a whole number of at least 1, not {args.rounds!r}")
    args.rounds = int(args.rounds)
    chosen = args.sides.split(",")
    if "vanilla" not in chosen or not set(chosen) <= set(names):
        parser.error(f"--sides: vanilla and any of {', '.join(names[1:])}, comma-separated")
    # (name, kvcached, env) in the order given: the first round's (a call of one round can put kvcached first,
    # so that pairs made over several calls alternate too)
    by_name = {side[0]: side for side in SERVER_SIDES}
    args.sides = [by_name[name] for name in dict.fromkeys(chosen)]
    if "peer" in chosen:
        if not os.path.isdir(os.path.join(PEER_PATH, "_site")):
            parser.error(
                f"--sides peer: no peer build in {PEER_PATH}; run `bash benchmarks/gpu/peer/build_peer.sh "
                f".peer-src {PEER_PATH}` (or set KVCACHED_BENCH_PEER_PATH)"
            )
    try:
        serve_rates()  # a misspelt KVCACHED_BENCH_RATES (or _PROFILE_RATES) fails here, before any engine starts
        profiled_rates()
    except RuntimeError as exc:
        parser.error(str(exc))
    args.sides = [(name, on, peer_env() if name == "peer" else env) for name, on, env in args.sides]


# vLLM's counters that serve reads around each rate: prefix-cache tokens hit and queried, preemptions, and the
# engine's own view of the work, free of the HTTP front end and the client: steps run and the tokens they
# scheduled (``iteration_tokens_total``, a histogram: _count steps, _sum tokens), and the time between two
# tokens of a request as EngineCore stamped them (``inter_token_latency_seconds``).
SERVE_COUNTERS = (
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:num_preemptions",
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
)


def counter_deltas(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float]:
    """What each of the server's counters in both readings grew by."""
    return {k: after[k] - before[k] for k in before if before[k] is not None and after.get(k) is not None}


def engine_figures(grew: dict[str, float], cpu: dict[str, float], wall_s: float) -> dict[str, float]:
    """One rate's engine-side figures from :data:`SERVE_COUNTERS`' growth and :func:`cpu_seconds`' growth over
    ``wall_s``: steps, tokens per step, EngineCore's mean inter-token latency (ms), and the CPU each
    process role used, as seconds and as a share of one core. Where the client's TPOT moves and these do
    not, the cost is in front of the engine; where EngineCore's CPU is near one core, its thread bounds it."""
    figures: dict[str, float] = {"wall_s": wall_s}
    steps = grew.get("vllm:iteration_tokens_total_count")
    if steps:
        figures["steps"] = steps
        figures["tokens_per_step"] = grew["vllm:iteration_tokens_total_sum"] / steps
    gaps = grew.get("vllm:inter_token_latency_seconds_count")
    if gaps:
        figures["engine_itl_ms"] = 1000 * grew["vllm:inter_token_latency_seconds_sum"] / gaps
    for role, seconds in cpu.items():
        figures[f"{role}_cpu_s"] = seconds
        figures[f"{role}_cores"] = seconds / wall_s if wall_s > 0 else 0.0
    return figures


def cpu_seconds(session: int, engine_process: str = Server.ENGINE_PROCESS) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the live processes of one process session (a server's:
    it is started in a session of its own), by role: ``engine_core`` (the process whose command line holds
    ``engine_process``: vLLM's EngineCore, SGLang's scheduler) and ``front_end`` (every other process: the
    API server and its helpers). Read from /proc; {} where there is none."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # exited while we looked
            continue
        if int(fields[3]) != session:  # field 6 of stat(5): the session id
            continue
        role = "engine_core" if engine_process.encode() in cmdline else "front_end"
        used[role] = used.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return used


# The rates of ``serve``: (rate, requests, prompt seed, waves). "All at once" is sent in waves of 480 one after
# the other (480 runs in one batch, under vLLM's largest CUDA graph of 512): one wave lasts ~6 s on the
# H200, and a server's waves show whether a slow figure is the server's or the moment's.
SERVE_RATES = [(16.0, 240, 2, 1), (64.0, 480, 3, 1), (float("inf"), 480, 4, 3)]


def rate_name(rate: float | str) -> str:
    """A request rate as the results name it: ``16``, ``64`` or ``inf`` (saturation)."""
    return "inf" if rate in ("inf", float("inf")) else str(int(rate))


def serve_rates(variable: str = "KVCACHED_BENCH_RATES", default: str = "") -> list[tuple[float, int, int, int]]:
    """:data:`SERVE_RATES`, or those the environment ``variable`` names (``16,64,inf``; unset: ``default``,
    and an empty default is every rate): a device call may fit more rounds of one rate than of all three."""
    wanted = os.environ.get(variable) or default
    if not wanted:
        return SERVE_RATES
    names = {name.strip() for name in wanted.split(",")}
    rates = [entry for entry in SERVE_RATES if rate_name(entry[0]) in names]
    if len(rates) != len(names):
        raise RuntimeError(f"{variable}={wanted!r}: name rates among 16, 64 and inf, comma-separated")
    return rates


def profiled_rates() -> set[float]:
    """The rates whose second wave (``serve``) or round (``serve-ab``) is profiled
    (``KVCACHED_BENCH_PROFILE_RATES``, default ``inf``)."""
    return {rate for rate, *_ in serve_rates("KVCACHED_BENCH_PROFILE_RATES", "inf")}


def phase_serve(args: argparse.Namespace) -> dict:
    """Serving latency: one server per chosen side of :data:`SERVER_SIDES`, one after the other, ``--rounds``
    times over (vanilla, kvcached, kvcached, vanilla, ...: one server's figures move between starts, so a
    ratio needs pairs, and the order turns so that drift favours neither), each warmed up, then the
    open-loop client at each of :data:`SERVE_RATES` (512-token prompts, 128 generated). Every rate and wave
    sends prompts of its own (a repeated prompt would be a prefix-cache hit, and between rounds vanilla keeps
    every cached prefix while an idle kvcached engine keeps its budget's worth), and each records the
    server's prefix-cache hit rate, so a with/without pair is known to have done the same work, its
    preemptions (requests vLLM stopped and recomputes: work the other side may not have done), and the
    engine's own figures (:func:`engine_figures`). Per rate and side: every round's (and wave's) figures,
    their medians, kvcached's map/unmap calls; per kvcached side the median of each pair's ratio to
    vanilla (same round, same wave), and the range."""
    result: dict = {"input_len": 512, "output_len": 128, "rounds": args.rounds, "rates": {}}
    for round_ in range(args.rounds):
        for side, kvcached, env in round_order(args.sides, round_):
            wait_for_empty_gpus()
            server = args.server(f"serve-{side}", 8100, args.model, kvcached, args.out, [], args.gpu, env)
            with serving([server], result, f"error_{side}"):
                result.setdefault(f"startup_s_{side}", []).append(server.wait_ready())
                log(f"serve {side} up (round {round_ + 1} of {args.rounds})")
                warm_up(server)
                profiled = profiled_rates()
                for rate, n, seed, waves in serve_rates():
                    for wave in range(waves):
                        profile = rate in profiled and wave == 1
                        stats = serve_rate(
                            server, side, kvcached, rate, n, seed + 100 * wave, args.out, round_, wave, profile
                        )
                        keep_rate(result, side, stats, f"serve {side} rate {rate} wave {wave + 1}")
            write_serve(args, "serve", result)
    return result


SERVE_AB_ROUNDS = 4


def phase_serve_ab(args: argparse.Namespace) -> dict:
    """Serving latency with every side's server up at once on one GPU, each given an equal share of it
    (:meth:`Server.memory_flags`), and every rate sent to them in turn: at each of :data:`SERVE_RATES`,
    ``--rounds`` rounds, each sending the same new prompts to every side, one side after the other, the
    order reversed every other round (at least :data:`SERVE_AB_ROUNDS`: a pair per round, and fewer pairs
    show no spread). ``serve`` compares servers started minutes apart, and one server's figures swing by
    1.6x between starts on the lent H200 (``benchmarks/results/h200-vllm/`` runs 16-17); here a pair is
    measured seconds apart on servers that stay up, so what moves the machine moves both. Each server
    compiles its graphs into a cache of its own (none loads another's), so a pair differs in kvcached only.
    Each round is one of ``serve``'s rates (:func:`serve_rate`, the engine's figures included), paired with
    vanilla's of the same round by :func:`summarise_rounds`; the second round of each rate that
    :func:`profiled_rates` names (saturation by default) is profiled where ``KVCACHED_BENCH_PYSPY`` asks for
    it. The idle servers stay up while one is measured, as they would on a shared GPU (a kvcached one may
    unmap what it freed meanwhile: its driver calls are counted)."""
    share, rounds = f"{0.9 / len(args.sides):.2f}", max(args.rounds, SERVE_AB_ROUNDS)
    result: dict = {"input_len": 512, "output_len": 128, "rounds": rounds, "memory_share": float(share)}
    result["rates"] = {}
    wait_for_empty_gpus()
    servers: list[Server] = []
    with serving(servers, result):
        for i, (side, kvcached, env) in enumerate(args.sides):
            flags = args.server.memory_flags(share, args.model)
            # A compile cache of its own, so every side compiles its graphs: the second of two servers
            # sharing one loads the first's, and in run 18 that side's forward took twice the CPU samples.
            env = {**(env or {}), "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix=f"vllm-cache-{side}-")}
            servers.append(args.server(f"serve-{side}", 8100 + i, args.model, kvcached, args.out, flags, args.gpu, env))
            # one at a time: each start-up's memory check sees the servers before it settled
            result.setdefault(f"startup_s_{side}", []).append(servers[-1].wait_ready())
            warm_up(servers[-1])
        log(f"serve-ab: {len(servers)} servers up, {share} of the GPU each")
        profiled = profiled_rates()
        for rate, n, seed, _ in serve_rates():
            for round_ in range(rounds):
                for server, (side, kvcached, _) in round_order(list(zip(servers, args.sides, strict=True)), round_):
                    profile = rate in profiled and round_ == 1
                    stats = serve_rate(
                        server, side, kvcached, rate, n, seed + 100 * round_, args.out, round_, 0, profile
                    )
                    keep_rate(result, side, stats, f"serve-ab {side} rate {rate} round {round_ + 1}")
                write_serve(args, "serve_ab", result)
    return result


def write_serve(args: argparse.Namespace, name: str, result: dict) -> None:
    """Every rate's summary and ratios so far (:func:`summarise_rounds`), then the file: a run that the
    budget cuts keeps the pairs it finished."""
    for by_side in result["rates"].values():
        summarise_rounds(by_side, [side for side, _, _ in args.sides])
    write(args.out, name, result)


def keep_rate(result: dict, side: str, stats: dict, label: str) -> None:
    """One rate's (or wave's) figures into ``result["rates"][rate]["<side>_rounds"]``, and a log line."""
    key = rate_name(stats["rate"])
    result["rates"].setdefault(key, {}).setdefault(f"{side}_rounds", []).append(stats)
    log(
        f"{label}: ttft p50 {stats['ttft_p50']} tpot p50 {stats['tpot_p50']} req/s {stats['request_throughput']} "
        f"engine {stats.get('engine')}"
    )


def serve_rate(
    server: Server,
    side: str,
    kvcached: bool,
    rate: float,
    n: int,
    seed: int,
    out: str,
    round_: int,
    wave: int,
    profile: bool = False,
) -> dict:
    """One rate (or wave) of ``serve`` on a running server: the client's figures with vLLM's counters,
    kvcached's driver calls and the processes' CPU around it (``engine``), the whole machine's busy and
    stolen cores (``host``) and the GPU's clocks (``gpu``): :class:`MachineLoad`; with ``profile``, both
    processes profiled where ``KVCACHED_BENCH_PYSPY`` asks for it."""
    before, counters = driver_calls(server.name), server.metrics(*SERVE_COUNTERS)
    cpu, begin = cpu_seconds(server.proc.pid, server.ENGINE_PROCESS), time.monotonic()
    log_from = server.log_size()
    profiles = profile_server(server, f"{side}-{round_ + 1}", out) if profile else []
    load = MachineLoad()
    stats = asyncio.run(open_loop(server.port, server.name, token_prompts(n, 512, seed), rate, 128))
    wall_s, cpu_after = time.monotonic() - begin, cpu_seconds(server.proc.pid, server.ENGINE_PROCESS)
    stats.update(load.stop())
    for recorder in profiles:
        recorder.wait(60)
    stats["round"], stats["wave"] = round_, wave
    after, grew = driver_calls(server.name), counter_deltas(counters, server.metrics(*SERVE_COUNTERS))
    hits, queries, preemptions = (grew.get(k) for k in SERVE_COUNTERS[:3])
    if preemptions is not None:
        stats["preemptions"] = preemptions  # recomputed work, either side
    if hits is not None and queries:
        stats["prefix_cache_hit_rate"] = hits / queries
    stats["engine"] = engine_figures(grew, {k: v - cpu.get(k, 0.0) for k, v in cpu_after.items()}, wall_s)
    stats["engine"].update(server.step_figures(log_from))
    if kvcached:
        stats["driver_calls"] = {k: after[k] - before[k] for k in after}
    return stats


def profile_server(server: Server, name: str, out: str) -> list[subprocess.Popen]:
    """With ``KVCACHED_BENCH_PYSPY`` naming a py-spy binary, record the server's EngineCore and its API
    server (every thread, idle ones too, without pausing them) for 5 s into ``out/profile-{engine_core,
    front_end}-name.raw``: where the scheduler's, the model runner's and the front end's time goes while a
    wave runs; and the EngineCore's thread holding the interpreter lock (``profile-engine_core_gil-name.raw``).
    Empty when unset."""
    spy = os.environ.get("KVCACHED_BENCH_PYSPY")
    if not spy:
        return []
    found = subprocess.run(
        ["pgrep", "-s", str(server.proc.pid), "-f", server.ENGINE_PROCESS], capture_output=True, text=True
    )
    # The front end is the process the harness started: the HTTP server runs in it.
    targets = {"front_end": str(server.proc.pid)}
    engines = found.stdout.split()
    if engines:
        targets["engine_core"] = engines[0]
    else:
        log(f"profile {name}: no {server.ENGINE_PROCESS} process under {server.name}")
    if engines:  # only the thread holding the interpreter lock: who keeps the scheduler's thread waiting
        targets["engine_core_gil"] = engines[0]
    started = []
    for role, pid in targets.items():
        command = [spy, "record", "-p", pid, "-d", "5", "-r", "250", "--threads", "--nonblocking"]
        command += ["--gil"] if role.endswith("_gil") else ["--idle"]
        command += ["-f", "raw", "-o", os.path.join(out, f"profile-{role}-{name}.raw")]
        with open(os.path.join(out, f"profile-{role}-{name}.log"), "w") as errors:  # the child keeps a copy
            started.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors))
    return started


# What ``serve`` summarises per side and compares with vanilla: the client's figures, then the engine's own.
SERVE_METRICS = (
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "tpot_p99",
    "request_throughput",
    "engine_itl_ms",
    "engine_core_cores",
    "decode_step_ms",
    "decode_gpu_ms",
    "decode_step_ms_per_ktoken",
    "decode_gpu_ms_per_ktoken",
)


def serve_figure(run: dict, metric: str) -> float | None:
    """One of :data:`SERVE_METRICS` of one round (or wave) of ``serve``: the client's, or the engine's."""
    return run[metric] if metric in run else run.get("engine", {}).get(metric)


def summarise_rounds(by_side: dict, sides: list[str]) -> None:
    """One rate of ``serve``: each side's median figures over its rounds (and waves), and each kvcached
    side's ratio to vanilla, pair by pair (round i and wave j against vanilla's), as the median and the
    range."""
    for side in sides:
        rounds = by_side.get(f"{side}_rounds", [])
        if rounds:
            by_side[side] = {
                "ok": sum(r["ok"] for r in rounds),
                "failed": sum(r["failed"] for r in rounds),
                "errors": sorted({e for r in rounds for e in r["errors"]})[:5],
                **{m: median_of([serve_figure(r, m) for r in rounds]) for m in SERVE_METRICS},
            }

    def pair_key(run: dict) -> tuple[int, int]:
        return run["round"], run.get("wave", 0)

    vanilla = {pair_key(r): r for r in by_side.get("vanilla_rounds", [])}
    for side in (s for s in sides if s != "vanilla"):
        pairs = [(vanilla[pair_key(k)], k) for k in by_side.get(f"{side}_rounds", []) if pair_key(k) in vanilla]
        ratios = {
            m: [serve_figure(k, m) / serve_figure(v, m) for v, k in pairs if serve_figure(v, m) and serve_figure(k, m)]
            for m in SERVE_METRICS
        }
        ratios["decode_gpu_ms_equal_load"] = [r for v, k in pairs if (r := equal_load_ratio(v, k)) is not None]
        by_side[f"ratio_{side}"] = {m: median_of(r) for m, r in ratios.items()}
        by_side[f"ratio_range_{side}"] = {m: [min(r), max(r)] if r else None for m, r in ratios.items()}


def equal_load_ratio(vanilla: dict, other: dict) -> float | None:
    """One pair's GPU time per decode step at equal load: the median, over the bands of tokens in flight
    where both servers logged steps (``decode_gpu_ms_by_load`` of the engine's figures), of the ratio of
    their GPU times. Unlike a ratio of medians or per token, a server that ran with more requests in flight
    (after a burst) is not compared at another load. None where either has no band, or none in common."""
    mine, theirs = (run.get("engine", {}).get("decode_gpu_ms_by_load") or {} for run in (other, vanilla))
    return median_of([mine[band] / theirs[band] for band in mine if theirs.get(band)])


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def phase_burst(args: argparse.Namespace) -> dict:
    """A burst of long prompts arriving at an idle engine: the first token waits for the KV cache to grow.
    The servers of ``--sides`` one after the other, each warmed up, then three bursts of 64 prompts of 2048
    tokens sent at once (16 generated), each after 5 s of idle: more than two reclaim windows, so an idle
    kvcached engine has kept only ``KVCACHED_PREFIX_CACHE_BYTES`` of cached prefixes and unmapped the rest,
    and every burst grows the KV again. TTFT p50/p99 per burst, the median burst of each server against
    vanilla's, and kvcached's map and unmap calls in each burst and in the idle time before it."""
    result: dict = {"prompts": 64, "input_len": 2048, "output_len": 16, "idle_s": 5, "servers": {}}
    for label, kvcached, env in args.sides:
        wait_for_empty_gpus()
        server = args.server(f"burst-{label}", 8150, args.model, kvcached, args.out, [], args.gpu, env)
        runs: dict = {}
        with serving([server], runs):
            runs["startup_s"] = server.wait_ready()
            asyncio.run(open_loop(8150, server.name, token_prompts(8, 512, 1), float("inf"), 4))  # warm
            runs["bursts"] = []
            for i in range(3):
                idle_from = driver_calls(server.name)
                time.sleep(result["idle_s"])
                before = driver_calls(server.name)
                stats = asyncio.run(open_loop(8150, server.name, token_prompts(64, 2048, 10 + i), float("inf"), 16))
                after = driver_calls(server.name)
                stats["driver_calls"] = {k: after[k] - before[k] for k in after}
                stats["idle_driver_calls"] = {k: before[k] - idle_from[k] for k in before}  # what idling gave back
                runs["bursts"].append(stats)
                log(f"burst {label} {i}: ttft p50 {stats['ttft_p50']} maps {stats['driver_calls']}")
        result["servers"][label] = runs
        write(args.out, "burst", result)
    medians = {
        label: statistics.median(b["ttft_p50"] for b in runs["bursts"] if b.get("ttft_p50") is not None)
        for label, runs in result["servers"].items()
        if any(b.get("ttft_p50") is not None for b in runs.get("bursts", []))
    }
    if "vanilla" in medians:
        result["ttft_p50_ratio"] = {k: v / medians["vanilla"] for k, v in medians.items() if k != "vanilla"}
    return result


# -- sharing one GPU -------------------------------------------------------------------------------------


class Sampler:
    """Every engine's mapped KV memory (from kvcached's control segments, as kvctl reads them), every 50 ms,
    and fair share's caps on it while a neighbour is short (``NAME:admit_cap``, ``NAME:yield_cap``, bytes:
    only in samples where one is set)."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.samples, self._stop = names, [], threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kvcached_core import control, load_settings

        settings = load_settings()
        while not self._stop.is_set():
            rows = control.instances(settings)
            sample = {"t": time.monotonic() - self.t0}
            for n in self.names:
                mine = [r for r in rows if r["name"] == n]
                sample[n] = sum(r["mapped_bytes"] for r in mine)
                for cap in ("admit_cap", "yield_cap"):
                    caps = [r[f"{cap}_bytes"] for r in mine if r[f"{cap}_bytes"] is not None]
                    if caps:
                        sample[f"{n}:{cap}"] = sum(caps)
            self.samples.append(sample)
            time.sleep(0.05)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> list[dict]:
        self._stop.set()
        self.thread.join()
        return self.samples


def driver_calls(name: str) -> dict[str, int]:
    """Map and unmap calls kvcached made for instance ``name`` so far, keyed as its counters."""
    activity = kv_activity(name=name)
    return {"page_maps_total": activity["page_maps"], "page_unmaps_total": activity["page_unmaps"]}


def pools_of(name: str) -> list[dict]:
    from kvcached_core import control

    return control.instances(name=name)


def phase_share(args: argparse.Namespace, count: int) -> dict:
    """Bursts of 256 requests (2048 prompt + 1024 generated tokens: up to 96 GiB of KV) to each engine in
    turn. Idle engines keep up to 48 GiB of cached prefixes (KVCACHED_PREFIX_CACHE_BYTES, as vLLM without
    kvcached would keep all), so the busy engine runs short unless they give them back (the pressure policy)."""
    util = {2: "0.85", 3: "0.8"}[count]
    extra = ["--gpu-memory-utilization", util, "--max-num-seqs", "256"]
    env = {"KVCACHED_PREFIX_CACHE_BYTES": "48G"}
    engines = [Engine(f"engine-{chr(65 + i)}", Server, extra, env) for i in range(count)]
    result = share_bursts(args, engines, f"{count} vLLM engines on one H200", f"share_x{count}.png")
    result["gpu_memory_utilization"] = float(util)
    return result


@dataclass
class Engine:
    """One server of a sharing run: its name, its server class, its extra flags and environment."""

    name: str
    server: type[Server]
    extra: list[str]
    env: dict[str, str]


def share_bursts(args: argparse.Namespace, engines: list[Engine], title: str, png: str) -> dict:
    """Start ``engines`` at the same moment on one GPU, then send a burst to each in turn (and, with two, to
    the first again); sample every engine's mapped KV, report peaks, hand-overs and failures, plot."""
    names = [e.name for e in engines]
    count = len(engines)
    wait_for_empty_gpus()
    servers = [
        e.server(e.name, 8200 + i, args.model, True, args.out, e.extra, args.gpu, e.env) for i, e in enumerate(engines)
    ]
    result: dict = {"engines": names, "bursts": [], "gpu_bytes": TOTAL}
    with serving(servers, result):
        result["startup_s"] = {s.name: s.wait_ready() for s in servers}  # started at the same moment
        result["virtual_kv_bytes"] = {n: sum(p["virtual_bytes"] for p in pools_of(n)) for n in names}
        log(f"share x{count}: all up {result['startup_s']}")
        sampler = Sampler(names)
        order = names + ([names[0]] if count == 2 else [])
        for i, name in enumerate(order):
            server = servers[names.index(name)]
            start = sampler.now()
            stats = asyncio.run(open_loop(server.port, name, token_prompts(256, 2048, 10 + i), float("inf"), 1024))
            end = sampler.now()
            window = [s for s in sampler.samples if start <= s["t"] <= end]
            result["bursts"].append(
                {
                    "engine": name,
                    "start": start,
                    "end": end,
                    "peak_bytes": max((s[name] for s in window), default=0),
                    "others_at_start": {n: window[0][n] for n in names if n != name} if window else {},
                    "requests": stats["requests"],
                    "failed": stats["failed"],
                    "errors": stats["errors"],
                }
            )
            log(
                f"share x{count}: burst {name} peak {result['bursts'][-1]['peak_bytes'] / GiB:.1f} GiB, "
                f"failed {stats['failed']}"
            )
            if i == 0:  # what kvtop shows with every engine up and one of them holding memory
                top = subprocess.run(
                    [sys.executable, "-m", "kvcached_core.kvtop", "--once"], capture_output=True, text=True
                )
                result["kvtop"] = (top.stdout + top.stderr).splitlines()
            time.sleep(1)
        time.sleep(2)
        samples = sampler.stop()
        result["preemptions"] = {s.name: s.metric("vllm:num_preemptions") for s in servers}
        result["samples"] = samples
        first_peak = result["bursts"][0]["peak_bytes"] or 1
        for burst in result["bursts"]:
            burst["peak_vs_first_burst"] = burst["peak_bytes"] / first_peak
        pairs = zip(result["bursts"], result["bursts"][1:], strict=False)
        result["handover"] = [handover(samples, prev, nxt) for prev, nxt in pairs]
        result["sum_of_peaks_over_gpu"] = sum(b["peak_bytes"] for b in result["bursts"][:count]) / TOTAL
        result["gave_back_log"] = [line for s in servers for line in s.tail_lines() if "gave back" in line]
        plot(samples, names, result["bursts"], os.path.join(args.out, png), title)
    return result


def handover(samples: list[dict], prev: dict, nxt: dict) -> dict:
    """``release_s``: from ``prev``'s burst ending until its mapped memory is back under 1 GiB above where it
    started; ``takeover_s``: from ``nxt``'s burst starting until it holds memory that ``prev`` held at its
    peak (more than the GPU less that peak)."""
    base = samples[0][prev["engine"]] if samples else 0
    released = next((s["t"] for s in samples if s["t"] >= prev["end"] and s[prev["engine"]] <= base + GiB), None)
    took = next(
        (s["t"] for s in samples if s["t"] >= nxt["start"] and s[nxt["engine"]] > TOTAL - prev["peak_bytes"]), None
    )
    return {
        "from": prev["engine"],
        "to": nxt["engine"],
        "release_s": released - prev["end"] if released is not None else None,
        "takeover_s": took - nxt["start"] if took is not None else None,
    }


TOTAL = 0  # bytes of the GPU the engines run on, set in main()


def gpu_bytes(index: str, which: str = "total") -> int:
    """GPU ``index``'s memory in bytes, as nvidia-smi reports it: ``which`` is ``total``, ``used`` or ``free``."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu=memory.{which}", "--format=csv,noheader,nounits", "-i", index],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0]) << 20


def plot(samples: list[dict], names: list[str], bursts: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    t = [s["t"] for s in samples]
    for name in names:
        ax.plot(t, [s[name] / GiB for s in samples], label=name)
    ax.plot(t, [sum(s[n] for n in names) / GiB for s in samples], "k--", lw=0.8, label="sum")
    ax.axhline(TOTAL / GiB, color="grey", lw=0.8, label="GPU memory")
    for b in bursts:
        ax.axvspan(b["start"], b["end"], alpha=0.08)
    ax.set_xlabel("seconds")
    ax.set_ylabel("mapped KV (GiB)")
    ax.set_title(f"{title}, bursts in turn (kvcached)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def phase_limit(args: argparse.Namespace) -> dict:
    name = "limited"
    wait_for_empty_gpus()
    server = Server(name, 8300, args.model, True, args.out, ["--max-num-seqs", "256"], args.gpu)
    result: dict = {}
    with serving([server], result):
        result["startup_s"] = server.wait_ready()
        sampler = Sampler([name])
        cap = 8 * GiB
        task_result: dict = {}

        def load() -> None:
            task_result.update(asyncio.run(open_loop(8300, name, token_prompts(256, 2048, 3), float("inf"), 512)))

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(4)  # the burst is growing
        before = sampler.samples[-1][name]
        rc = subprocess.run(
            [sys.executable, "-m", "kvcached_core.kvctl", "limit", name, str(cap)], capture_output=True, text=True
        )
        set_at = sampler.now()
        thread.join()
        samples = sampler.stop()
        settled = [s[name] for s in samples if s["t"] > set_at + 2.0]
        result.update(
            {
                "limit_bytes": cap,
                "kvctl_rc": rc.returncode,
                "kvctl_out": rc.stdout.strip() + rc.stderr.strip(),
                "mapped_when_set": before,
                "max_mapped_2s_after": max(settled, default=None),
                "requests": task_result.get("requests"),
                "failed": task_result.get("failed"),
                "errors": task_result.get("errors"),
                "preemptions": server.metric("vllm:num_preemptions"),
                "samples": samples[::4],
            }
        )
    return result


PROBE = """
import json, os, torch
from vllm.plugins import load_general_plugins
plain = torch.accelerator.get_memory_info(0)
load_general_plugins()
from vllm.utils.mem_utils import MemorySnapshot
snap = MemorySnapshot(device=torch.device("cuda:0"))
print("RESULT " + json.dumps({"kvcached": os.environ["KVCACHED_ENABLE"], "plain_free_total": plain,
                              "props_total": torch.cuda.get_device_properties(0).total_memory,
                              "snapshot_free": snap.free_memory, "snapshot_total": snap.total_memory}))
"""


def phase_probe(args: argparse.Namespace) -> dict:
    """What vLLM's memory snapshot reads with the plugin on and off, next to torch's own reading."""
    result = {}
    for side in (False, True):
        proc = subprocess.run(
            [sys.executable, "-c", PROBE],
            env=engine_env(side, args.gpu),
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
            timeout=300,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        result["kvcached" if side else "vanilla"] = json.loads(lines[-1][7:]) if lines else proc.stderr[-2000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    phases = [
        "model",
        "probe",
        "offline",
        "identity",
        "backstop",
        "serve",
        "serve-ab",
        "burst",
        "share",
        "share3",
        "limit",
        "tp",
    ]
    parser.add_argument("phases", nargs="+", choices=phases)
    parser.add_argument("--out", required=True, help="folder for JSON, logs and PNGs")
    parser.add_argument("--model", help="model directory (default: made here, Llama-3-8B's KV shape)")
    parser.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES for the engines (default: inherited)")
    add_sides_argument(parser)
    args = parser.parse_args()
    check_sides(parser, args)
    args.offline_engine, args.server = os.path.join(HERE, "offline_engine.py"), Server
    os.makedirs(args.out, exist_ok=True)
    stop_servers_on_sigterm()
    args.model = args.model or make_model(os.path.join(tempfile.gettempdir(), "kvcached-llama3-8b-kv"))
    global TOTAL, VOCAB
    with open(os.path.join(args.model, "config.json")) as f:
        VOCAB = json.load(f)["vocab_size"]
    TOTAL = gpu_bytes((args.gpu or os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
    for phase in args.phases:
        log(f"== {phase}")
        try:
            if phase == "model":
                continue  # made above
            if phase == "probe":
                write(args.out, "probe", phase_probe(args))
            elif phase == "offline":
                phase_offline(args)  # writes offline.json itself, after every engine
            elif phase == "identity":
                phase_identity(args)  # writes identity.json itself, after every engine
            elif phase == "backstop":
                write(args.out, "backstop", phase_backstop(args))
            elif phase == "tp":
                phase_offline(args, tp=2)
            elif phase == "serve":
                write(args.out, "serve", phase_serve(args))
            elif phase == "serve-ab":
                write(args.out, "serve_ab", phase_serve_ab(args))
            elif phase == "burst":
                write(args.out, "burst", phase_burst(args))
            elif phase == "share":
                write(args.out, "share_x2", phase_share(args, 2))
            elif phase == "share3":
                write(args.out, "share_x3", phase_share(args, 3))
            elif phase == "limit":
                write(args.out, "limit", phase_limit(args))
        except Exception as exc:  # one phase failing must not lose the others' results
            log(f"{phase} failed: {type(exc).__name__}: {exc}")
            write(args.out, f"{phase}_error", {"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
