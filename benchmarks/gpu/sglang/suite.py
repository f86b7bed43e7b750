"""kvcached-sglang on a GPU, measured against SGLang without kvcached in the same run. Prints and writes JSON.

    python suite.py PHASE [PHASE ...] --out DIR [--model DIR]

The vLLM harness's phases (``benchmarks/gpu/vllm/suite.py``) with SGLang in place of vLLM:

- ``offline``: offline throughput of fresh ``sglang.Engine`` processes, one per side of ``--sides`` in each of
  ``--rounds`` rounds (the vLLM harness's phase): the ratio to SGLang without kvcached, pair by pair and
  pooled, with kvcached's map and unmap calls per batch; ``offline.json`` is rewritten after every engine.
- ``identity``: greedy tokens of 256 prompts, fresh engines alternating without/with kvcached (``KVCACHED_ENABLE=0/1``),
  the radix cache off and on: must be identical; ``identity.json`` is rewritten after every engine.
- ``serve``: one ``python -m sglang.launch_server`` without kvcached, with it, with it and 2 MiB pages; the
  open-loop streaming client at 16 and 64 requests/s and at saturation: TTFT and TPOT p50/p99, and
  kvcached's map and unmap calls per rate.
- ``burst``: the vLLM harness's burst of long prompts at an idle server, with SGLang's server.
- ``pools``: SGLang's other KV pools: a random DeepSeek-V2-Lite-shaped model (``mla`` pool) and a random
  Falcon-H1 hybrid (``mamba`` pool, K/V in ``mha``): one server without and one with kvcached each; greedy
  tokens of 32 prompts compared, and ``kvctl list --json`` while it runs (the main model's ``mha`` pool is
  what ``offline`` and ``serve`` measure).
- ``release``: ``release_memory_occupation`` / ``resume_memory_occupation`` (what RL frameworks call) on an
  ``sglang.Engine`` with the memory saver, without and with kvcached: memory before, released and resumed,
  and greedy tokens after resuming (``release_engine.py``).
- ``mixed``: one ``vllm serve`` and one SGLang server started at the same moment on one GPU, each with a
  virtual KV capacity close to the whole GPU; bursts to each in turn (the vLLM harness's ``share``); vLLM
  runs from ``KVCACHED_BENCH_VLLM_PATH`` (where its staged build is importable).
- ``model``: only make the model.

Same model as the vLLM harness (random weights, Llama-3-8B's KV shape). SGLang runs with the triton
attention backend and pytorch sampling (what the staged 0.5.16 build on the lent H200 carries), CUDA graphs on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm"))
import suite as harness  # noqa: E402  (the vLLM harness: model, client, offline and serve phases)
from models import make_tiny_hybrid_mamba, make_tiny_mla  # noqa: E402


class SGLangServer(harness.Server):
    """One ``python -m sglang.launch_server`` in its own process group."""

    ENGINE_PROCESS = "sglang::scheduler"  # SGLang retitles its scheduler process so

    @staticmethod
    def memory_flags(fraction: str, model: str) -> list[str]:
        """``fraction`` of the whole GPU for ``model``'s weights and KV pool, and the same pool whatever
        started first. SGLang's ``--mem-fraction-static`` is a fraction of the memory free when the server
        starts, not of the whole GPU as vLLM's ``--gpu-memory-utilization``: it is derived from what is free
        now, so the second of two servers gets what the first got instead of ``fraction`` of what the first
        left. And ``--max-total-tokens`` caps every pool at 90 % of what that share holds: left to profiling,
        two pools differed by 0.8 % and at saturation, which overfills them, the smaller one queued 9
        requests to the wave's end where the other queued 5 (run 4 of ``benchmarks/results/h200-sglang``)."""
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        free = harness.gpu_bytes(gpu, "free")
        wanted = float(fraction) * harness.TOTAL
        if wanted > 0.95 * free:
            raise RuntimeError(
                f"GPU {gpu} has {free / harness.GiB:.1f} GiB free, less than the {wanted / harness.GiB:.1f} GiB "
                "asked for; start fewer servers (KVCACHED_BENCH_SIDES) or free the GPU"
            )
        weights = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
        tokens = int(0.9 * (wanted - weights) / kv_bytes_per_token(model))
        return ["--mem-fraction-static", f"{wanted / free:.3f}", "--max-total-tokens", str(tokens)]

    def command(self, model: str, extra: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--served-model-name",
            self.name,
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--random-seed",
            "0",
            "--context-length",
            "4096",
            "--attention-backend",
            "triton",
            "--sampling-backend",
            "pytorch",
            *self.front_end_flags(),
            *extra,
        ]

    @classmethod
    def front_end_flags(cls) -> list[str]:
        """:meth:`front_ends` HTTP and tokenizer processes (SGLang's ``--tokenizer-worker-num``), as the vLLM
        harness starts that many API servers. One of them streaming 64 requests/s is busy for most of a core
        on an H100 and stalls now and then (results run 7)."""
        workers = cls.front_ends()
        return ["--tokenizer-worker-num", str(workers)] if workers > 1 else []

    def step_figures(self, since: int) -> dict[str, Any]:
        """:func:`decode_figures` of what the server logged past byte ``since``."""
        with open(self.logpath) as f:
            f.seek(since)
            return decode_figures(f.read().splitlines())


# One decode log line of SGLang (every ``decode_log_interval`` steps, 40 by default); its ``fwd occupancy``
# (the share of the window's wall time that the GPU spent in forward passes, timed by CUDA events) is there
# when the server runs with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1, which every server of this harness does.
DECODE_LINE = re.compile(
    r"Decode batch, #running-req: (\d+), #token: (\d+), .*gen throughput \(token/s\): ([\d.]+)"
    r"(?:.*fwd occupancy: ([\d.]+|nan)%)?"
)


# Windows of decode steps are grouped by the KV tokens in flight, in bands this wide, for the equal-load
# comparison (``decode_gpu_ms_by_load``).
LOAD_BAND_KTOKENS = 5


def decode_figures(lines: list[str]) -> dict[str, Any]:
    """Per decode step, from SGLang's decode log lines (each a window of steps), medians over the windows:
    the wall time (``decode_step_ms``: running requests over tokens per second) and the time the GPU spent
    in the forward pass (``decode_gpu_ms``: that wall time times the window's forward occupancy); and both
    per thousand tokens of KV the batch reads (``..._per_ktoken``). A step's time grows with the tokens in
    flight, so two servers given the same arrivals are compared per token: where a server ends up with
    more requests in flight (its client stalled and sent a burst), its steps are longer at the same cost
    per token. Per token still favours the busier server (a step's fixed cost is spread over more tokens),
    so ``decode_gpu_ms_by_load`` also keeps the GPU time per step by band of tokens in flight (the band's
    lower end in thousands, as a string key: JSON), for a comparison at equal load
    (:func:`harness.equal_load_ratio`). Empty without a decode line."""
    walls, gpus, walls_k, gpus_k = [], [], [], []
    bands: dict[str, list[float]] = {}
    for line in lines:
        found = DECODE_LINE.search(line)
        if not found or float(found[3]) <= 0 or int(found[2]) == 0:
            continue
        wall, ktokens = 1000 * int(found[1]) / float(found[3]), int(found[2]) / 1000
        walls.append(wall)
        walls_k.append(wall / ktokens)
        if found[4] not in (None, "nan"):
            gpus.append(wall * float(found[4]) / 100)
            gpus_k.append(gpus[-1] / ktokens)
            band = str(int(ktokens // LOAD_BAND_KTOKENS) * LOAD_BAND_KTOKENS)
            bands.setdefault(band, []).append(gpus[-1])
    figures: dict[str, Any] = {}
    for name, values, per_ktoken in (("decode_step_ms", walls, walls_k), ("decode_gpu_ms", gpus, gpus_k)):
        if values:
            figures[name] = harness.median_of(values)
            figures[f"{name}_per_ktoken"] = harness.median_of(per_ktoken)
    if bands:
        by_band = sorted(bands.items(), key=lambda item: int(item[0]))
        figures["decode_gpu_ms_by_load"] = {band: statistics.median(ms) for band, ms in by_band}
    return figures


def kv_bytes_per_token(model: str) -> int:
    """K and V bytes of one token over every layer of ``model`` (a Llama-shaped config, 2-byte dtype)."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim


def generate(port: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from SGLang's native ``/generate`` (token ids in, token ids out)."""
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return [list(out["output_ids"]) for out in json.load(response)]


def kvctl_rows(name: str) -> list[dict]:
    """``kvctl list --json`` rows of instance ``name``: what a user sees of the engine's pools."""
    out = subprocess.run(
        [sys.executable, "-m", "kvcached_core.kvctl", "list", "--json"], capture_output=True, text=True, check=True
    )
    return [
        {k: row.get(k) for k in ("name", "engine", "pool_name", "device", "virtual_bytes", "mapped_bytes")}
        for row in json.loads(out.stdout)
        if row.get("name") == name
    ]


def phase_pools(args: argparse.Namespace) -> dict:
    """Each pool kind under a real server, without and with kvcached: identity and what kvctl lists."""
    tmp = tempfile.gettempdir()
    makers = {
        "mla": lambda: make_tiny_mla(os.path.join(tmp, "kvcached-tiny-mla")),
        "mamba": lambda: make_tiny_hybrid_mamba(os.path.join(tmp, "kvcached-tiny-falcon-h1")),
    }
    models = {kind: makers[kind]() for kind in args.pools}
    # SGLang 0.5.16 cannot capture Falcon-H1's prefill CUDA graph, with or without kvcached (its Mamba mixer
    # reads ``mamba_track_mask.any()`` on the host during capture); decode graphs stay on.
    flags = {"mla": [], "mamba": ["--disable-prefill-cuda-graph"]}
    result: dict = {}
    for kind, path in models.items():
        with open(os.path.join(path, "config.json")) as f:
            harness.VOCAB = json.load(f)["vocab_size"]
        prompts = harness.token_prompts(32, 256, 5)
        runs: dict = {"model": os.path.basename(path)}
        for side in ("vanilla", "kvcached"):
            harness.wait_for_empty_gpus()
            name = f"{kind}-{side}"
            extra = ["--max-running-requests", "64", *flags[kind]]
            server = SGLangServer(name, 8400, path, side == "kvcached", args.out, extra)
            try:
                runs[f"startup_s_{side}"] = server.wait_ready()
                runs[f"tokens_{side}"] = generate(8400, prompts, 64)
                if side == "kvcached":
                    runs["kvctl"] = kvctl_rows(name)
            except Exception as exc:  # one model failing must not stop the others
                runs[f"error_{side}"] = f"{type(exc).__name__}: {exc}"[:3000]
            finally:
                server.stop()
                runs[f"kvcached_log_{side}"] = server.kvcached_notes()
        if "tokens_vanilla" in runs and "tokens_kvcached" in runs:
            van, kvc = runs.pop("tokens_vanilla"), runs.pop("tokens_kvcached")
            runs["identity"] = harness.identity({"tokens": van}, {"tokens": kvc})
        result[kind] = runs
        harness.log(f"pools {kind}: {runs.get('identity')} {[r['pool_name'] for r in runs.get('kvctl', [])]}")
    with open(os.path.join(args.model, "config.json")) as f:
        harness.VOCAB = json.load(f)["vocab_size"]
    return result


def phase_release(args: argparse.Namespace) -> dict:
    """release/resume_memory_occupation without and with kvcached: with SGLang's memory saver where
    ``torch_memory_saver`` is installed, and with kvcached alone (the KV cache given back by the plugin)."""
    script = os.path.join(HERE, "release_engine.py")
    logfile = os.path.join(args.out, "release.log")
    runs = [("kvcached-alone", True, [])]
    if importlib.util.find_spec("torch_memory_saver") is not None:
        runs = [("vanilla-saver", False, ["--memory-saver"]), ("kvcached-saver", True, ["--memory-saver"]), *runs]
    result: dict = {}
    for label, kvcached, extra in runs:
        harness.log(f"release {label}")
        result[label] = harness.run_offline_engine(args, kvcached, extra, logfile, script=script)
    first = result[runs[0][0]].get("tokens_after")  # each run's tokens after resuming, against the first run's
    for run in result.values():
        run.pop("tokens_before", None)
        after = run.pop("tokens_after", None)
        if first is not None and after is not None:
            run["identity_vs_first_after_resume"] = harness.identity({"tokens": first}, {"tokens": after})
    return result


def phase_mixed(args: argparse.Namespace) -> dict:
    """One vLLM and one SGLang server on one GPU (the vLLM harness's bursts in turn)."""
    vllm_path = os.environ.get("KVCACHED_BENCH_VLLM_PATH")
    kv_path = os.environ.get("KVCACHED_BENCH_KV_PATH")
    if not vllm_path or not kv_path:
        raise RuntimeError("mixed needs KVCACHED_BENCH_VLLM_PATH (vLLM's staged site) and KVCACHED_BENCH_KV_PATH")
    share = {"KVCACHED_PREFIX_CACHE_BYTES": "48G"}  # idle engines keep up to 48 GiB unless a neighbour is short
    vllm_env = {**share, "PYTHONPATH": f"{kv_path}:{vllm_path}", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    engines = [
        harness.Engine(
            "vllm-A", harness.Server, ["--gpu-memory-utilization", "0.85", "--max-num-seqs", "256"], vllm_env
        ),
        harness.Engine(
            "sglang-B", SGLangServer, ["--mem-fraction-static", "0.85", "--max-running-requests", "256"], share
        ),
    ]
    return harness.share_bursts(args, engines, "vLLM and SGLang on one H200", "mixed.png")


PHASES = {
    "serve": harness.phase_serve,
    "serve-ab": harness.phase_serve_ab,
    "burst": harness.phase_burst,
    "pools": phase_pools,
    "release": phase_release,
    "mixed": phase_mixed,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "phases",
        nargs="+",
        choices=["model", "offline", "identity", "serve", "serve-ab", "burst", "pools", "release", "mixed"],
    )
    parser.add_argument("--out", required=True, help="folder for JSON and logs")
    parser.add_argument("--model", help="model directory (default: made here, Llama-3-8B's KV shape)")
    parser.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES for the engines (default: inherited)")
    parser.add_argument(
        "--pools",
        default=os.environ.get("KVCACHED_BENCH_POOLS", "mla,mamba"),
        help="pools: which of mla,mamba to run (default both, or KVCACHED_BENCH_POOLS)",
    )
    harness.add_sides_argument(parser)
    args = parser.parse_args()
    harness.check_sides(parser, args)
    args.pools = args.pools.split(",")
    if not args.pools or not set(args.pools) <= {"mla", "mamba"}:
        parser.error("--pools: mla, mamba or both, comma-separated")
    args.offline_engine, args.server = os.path.join(HERE, "offline_engine.py"), SGLangServer
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "1")  # the forward's GPU time: decode_figures
    harness.stop_servers_on_sigterm()
    args.model = args.model or harness.make_model(os.path.join(tempfile.gettempdir(), "kvcached-llama3-8b-kv"))
    with open(os.path.join(args.model, "config.json")) as f:
        harness.VOCAB = json.load(f)["vocab_size"]
    harness.TOTAL = harness.gpu_bytes((args.gpu or os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
    for phase in args.phases:
        harness.log(f"== sglang {phase}")
        try:
            if phase == "model":
                continue  # made above
            if phase == "offline":
                harness.phase_offline(args)  # writes offline.json itself, after every engine
            elif phase == "identity":  # writes identity.json itself, after every engine
                harness.alternate_engines(args, "identity", ["--throughput-prompts", "0"])
            else:
                harness.write(args.out, phase.replace("-", "_"), PHASES[phase](args))
        except Exception as exc:  # one phase failing must not lose the others' results
            harness.log(f"{phase} failed: {type(exc).__name__}: {exc}")
            harness.write(args.out, f"{phase}_error", {"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
