"""Several models on one GPU: kvcached against static partitioning, the same bursty traffic, the same seeds.

    python run.py both    --models 2|3 --out DIR [--duration 120] [--pattern staggered|aligned]
                                                                      static, then elastic, then compare
    python run.py static  --models 2|3 --out DIR [--duration 120]    vLLM servers, each a fixed slice
    python run.py elastic --models 2|3 --out DIR [--duration 120]    vLLM servers with kvcached
    python run.py compare --models 2|3 --out DIR                      the two runs side by side: JSON and PNG

Each configuration starts N ``vllm serve`` on one GPU (random weights, made here): an 8B-like model
(Llama-3-8B's attention: 32 layers of 8 KV heads of 128, 128 KiB of KV a token), a 3B-like one (Llama-3.2-3B's:
28 layers, 112 KiB a token) and, with three, a 1B-like one (Llama-3.2-1B's: 16 layers of 8 KV heads of 64,
32 KiB a token); hidden and MLP sizes are small so they load in seconds. ``static`` gives each engine
``--gpu-memory-utilization`` 0.9/N (what operators do today) and starts them one after the other;
``elastic`` gives each kvcached and a virtual KV capacity close to the whole GPU (0.85 with two, 0.8 with
three) and starts them at the same moment.

The traffic (``schedule``): per model, Poisson arrivals whose rate switches between idle (``--idle-rate``)
and a burst (``--burst-rate``, ``--burst-s`` long) once every ``--period-s``, the models' bursts evenly
out of phase (``--pattern staggered``) or all at once (``--pattern aligned``: every engine wants memory at
the same moment, the pattern where elastic memory has the least to give); prompt lengths 256 to 3072 tokens
(median ~1500) and output lengths 128 to 1024, drawn from
fixed seeds: a burst of the 8B-like model wants more KV than a static slice holds. Every
request records its arrival, first token and finish; the elastic run also samples each engine's mapped KV
every 50 ms. ``compare`` writes per model TTFT/TPOT p50/p99, SLO attainment (TTFT <= ``--slo-s``) and
throughput for both, the ratios, and a PNG (TTFT p99 per model; the elastic run's memory over time).

Needs vLLM's CUDA build with kvcached-vllm installed (``benchmarks/gpu/vllm/run.sh`` installs it into
``/tmp/kv``); each configuration fits one 10-minute device call (start-ups dominate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples", "01_two_engines"))
import suite as harness  # noqa: E402  (servers, the streaming client, GPU helpers)
from machine_load import gpu_machine  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama with a real model's attention shape (what sizes its KV cache)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int

    def make(self, root: str) -> str:
        """The model's folder under ``root`` (made once)."""
        from tiny_model import make_tiny_llama

        return make_tiny_llama(
            os.path.join(root, f"kvcached-multimodel-{self.name}"),
            layers=self.layers,
            hidden=self.hidden,
            heads=self.hidden // self.head_dim,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=2 * self.hidden,
            dtype="bfloat16",
            max_positions=8192,
        )


SHAPES = [
    ModelShape("llama8b-like", layers=32, kv_heads=8, head_dim=128, hidden=1024),
    ModelShape("llama3b-like", layers=28, kv_heads=8, head_dim=128, hidden=1024),
    ModelShape("llama1b-like", layers=16, kv_heads=8, head_dim=64, hidden=512),
]
STATIC_UTIL = 0.9  # split evenly between the engines
ELASTIC_UTIL = {2: "0.85", 3: "0.8"}  # each engine's virtual KV: close to the whole GPU


@dataclass(frozen=True)
class Arrival:
    """One request of the replayed traffic."""

    at_s: float
    prompt_len: int
    output_len: int


def schedule(index: int, count: int, args: argparse.Namespace) -> list[Arrival]:
    """Model ``index``'s arrivals over ``args.duration`` seconds: Poisson at the idle rate, at the burst rate
    for ``burst_s`` of every ``period_s``; model i's bursts start i/count of a period later than model 0's
    (``--pattern staggered``) or with model 0's (``aligned``).
    Drawn by thinning (candidates at the burst rate, each kept with probability rate(t)/burst rate), so an
    idle gap cannot step over part of a burst."""
    rng = random.Random(1000 + index)
    offset = args.period_s * index / count if args.pattern == "staggered" else 0.0
    top = max(args.burst_rate, args.idle_rate)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= args.duration:
            return arrivals
        rate = args.burst_rate if (t - offset) % args.period_s < args.burst_s else args.idle_rate
        prompt = min(3072, max(256, int(rng.lognormvariate(7.3, 0.5))))  # median ~1500 tokens
        output = rng.randint(128, 1024)  # within --max-model-len 4096
        if rng.random() < rate / top:
            arrivals.append(Arrival(t, prompt, output))


async def replay(server: harness.Server, model: int, plan: list[Arrival], begin: float) -> list[dict]:
    """Send one model's arrivals on time (open loop, ``begin`` on the monotonic clock) and return one record
    per request."""
    async with harness.client_session(3600) as session:

        async def one(arrival: Arrival, seed: int) -> dict:
            await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - begin)))
            rng = random.Random(seed)
            prompt = [rng.randrange(3, harness.VOCAB) for _ in range(arrival.prompt_len)]
            sent = time.monotonic() - begin
            out = await harness.one_request(session, server.port, server.name, prompt, arrival.output_len)
            return {"model": model, "arrival_s": arrival.at_s, "sent_s": sent, **out}

        records = await asyncio.gather(*(one(a, seed=model * 1_000_000 + i) for i, a in enumerate(plan)))
    for r in records:
        if r.get("ok"):  # one_request stamps the end on perf_counter: CLOCK_MONOTONIC on Linux
            r["end_s"] = r.pop("end") - begin
    return list(records)


@dataclass
class Clients:
    """Every model's client process, forked and replaying from ``begin`` (on the monotonic clock)."""

    begin: float
    procs: list[multiprocessing.process.BaseProcess]
    paths: list[str]

    def join(self) -> list[dict]:
        """Wait for every client; their records, or RuntimeError naming a client that failed."""
        for p in self.procs:
            p.join()
        records = []
        for m, (p, path) in enumerate(zip(self.procs, self.paths, strict=True)):
            if p.exitcode != 0:
                raise RuntimeError(f"the client of model {m} exited with {p.exitcode}")
            with open(path) as f:
                records += json.load(f)
        return records


def start_clients(servers: list[harness.Server], plans: list[list[Arrival]], folder: str) -> Clients:
    """Every model's traffic from a client process of its own, all starting at one instant (a single
    process streaming hundreds of requests would itself delay the tokens it times). Call this before this
    process starts any thread (the memory sampler): a child forked while another thread holds a lock, an
    import lock for one, waits on it for ever (run 14's first try: both clients hung, no request sent)."""
    begin = time.monotonic() + 2.0  # time for the children to start
    ctx = multiprocessing.get_context("fork")
    paths = [os.path.join(folder, f"records-{m}.json") for m in range(len(servers))]

    def child(m: int) -> None:
        records = asyncio.run(replay(servers[m], m, plans[m], begin))
        with open(paths[m], "w") as f:
            json.dump(records, f)

    # daemon: a run stopped while they replay does not wait for them to finish.
    procs = [ctx.Process(target=child, args=(m,), daemon=True) for m in range(len(servers))]
    for p in procs:
        p.start()
    return Clients(begin, procs, paths)


def gpu_index(args: argparse.Namespace) -> str:
    """The GPU the engines run on (``--gpu``, else the first of ``CUDA_VISIBLE_DEVICES``), as nvidia-smi
    numbers it."""
    return (args.gpu or os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]


def run_config(args: argparse.Namespace, config: str) -> dict:
    """Start the servers of ``config`` (static or elastic), replay the traffic, stop them; the run's JSON."""
    count = args.models
    shapes = SHAPES[:count]
    elastic = config == "elastic"
    paths = [shape.make(tempfile.gettempdir()) for shape in shapes]
    with open(os.path.join(paths[0], "config.json")) as f:
        harness.VOCAB = json.load(f)["vocab_size"]
    util = ELASTIC_UTIL[count] if elastic else f"{STATIC_UTIL / count:.3f}"
    extra = ["--gpu-memory-utilization", util, "--max-num-seqs", "512"]
    plans = [schedule(i, count, args) for i in range(count)]
    result: dict = {
        "config": config,
        "machine": gpu_machine(gpu_index(args)),
        "models": [s.name for s in shapes],
        "gpu_memory_utilization": float(util),
        "traffic": {
            k: getattr(args, k) for k in ("pattern", "duration", "period_s", "burst_s", "burst_rate", "idle_rate")
        },
        "requests_planned": [len(p) for p in plans],
        # kvcached settings the engines inherit (e.g. KVCACHED_FAIR_SHARE=1 for the elastic run)
        "kvcached_env": {k: v for k, v in os.environ.items() if k.startswith("KVCACHED_")},
    }
    servers: list[harness.Server] = []
    with harness.serving(servers, result):  # the list grows inside: every server started is stopped
        harness.wait_for_empty_gpus()
        for i, (shape, path) in enumerate(zip(shapes, paths, strict=True)):
            servers.append(harness.Server(shape.name, 8500 + i, path, elastic, args.out, extra, args.gpu))
            if not elastic:  # a static slice is checked against free memory at start: one at a time
                servers[-1].wait_ready()
        result["startup_s"] = {s.name: s.wait_ready() for s in servers}
        harness.log(f"{run_name(args, config)}: all up {result['startup_s']}")
        with tempfile.TemporaryDirectory() as folder:
            clients = start_clients(servers, plans, folder)  # forked before the sampler's thread exists
            sampler = harness.Sampler([s.name for s in servers]) if elastic else None
            records = clients.join()
        if sampler is not None:
            result["kv_samples"] = sampler.stop()
            result["traffic_start_s"] = clients.begin - sampler.t0  # the schedule's zero on the samples' clock
        result["requests"] = records
        result["preemptions"] = {s.name: s.metric("vllm:num_preemptions") for s in servers}
        if sampler is not None:  # an engine that never mapped a page did not serve through kvcached
            bare = [n for n in result["models"] if not any(sample[n] for sample in result["kv_samples"])]
            if bare:
                result["error"] = f"{', '.join(bare)} never mapped KV through kvcached (see server-*.log)"
    return result


def model_stats(records: list[dict], model: int, slo_s: float, duration: float) -> dict:
    """TTFT/TPOT p50/p99, SLO attainment and throughput of one model's requests."""
    mine = [r for r in records if r["model"] == model]
    ok = [r for r in mine if r.get("ok")]
    ttft = [r["ttft"] for r in ok]
    return {
        "requests": len(mine),
        "failed": len(mine) - len(ok),
        "ttft_p50": harness.pct(ttft, 50),
        "ttft_p99": harness.pct(ttft, 99),
        "tpot_p50": harness.pct([r["tpot"] for r in ok], 50),
        "tpot_p99": harness.pct([r["tpot"] for r in ok], 99),
        "slo_attainment": sum(t <= slo_s for t in ttft) / len(mine) if mine else None,
        "requests_per_s": len(ok) / max(duration, max((r["end_s"] for r in ok), default=duration)),
    }


def burst_windows(index: int, count: int, traffic: dict) -> list[tuple[float, float]]:
    """Model ``index``'s periods of the replayed traffic, each from the start of one of its bursts to the start
    of its next (the first from 0 when its first burst starts later), as :func:`schedule` placed them."""
    period, duration = traffic["period_s"], traffic["duration"]
    offset = period * index / count if traffic.get("pattern", "staggered") == "staggered" else 0.0
    starts = sorted({0.0} | {offset + k * period for k in range(int(duration // period) + 1)})
    edges = [t for t in starts if t < duration] + [duration]
    return list(zip(edges[:-1], edges[1:], strict=True))


def per_burst(runs: dict, index: int, count: int) -> list[dict]:
    """TTFT and TPOT p50 of model ``index``'s requests arriving in each of its burst periods, static and
    elastic, and elastic over static. Both runs replay the same arrivals, so a machine that is uniformly
    slower moves every period alike, while a hand-over that came late shows in the periods after it."""
    rows = []
    for begin, end in burst_windows(index, count, runs["static"]["traffic"]):
        row: dict = {"from_s": round(begin, 2), "to_s": round(end, 2)}
        for config, run in runs.items():
            mine = (r for r in run.get("requests", []) if r["model"] == index and r.get("ok"))
            ok = [r for r in mine if begin <= r["arrival_s"] < end]
            row[config] = {
                "requests": len(ok),
                "ttft_p50": harness.pct([r["ttft"] for r in ok], 50),
                "tpot_p50": harness.pct([r["tpot"] for r in ok], 50),
            }
        for k in ("ttft_p50", "tpot_p50"):
            base, new = row["static"][k], row["elastic"][k]
            row[f"{k}_ratio"] = new / base if base and new is not None else None
        rows.append(row)
    return rows


def run_name(args: argparse.Namespace, what: str) -> str:
    """``static_x2``, ``multimodel_x3``, ...; ``-aligned`` added for the aligned pattern."""
    return f"{what}_x{args.models}" + ("" if args.pattern == "staggered" else f"-{args.pattern}")


def compare(args: argparse.Namespace) -> dict:
    """Both configurations' per-model figures, elastic over static, and the PNG."""
    runs = {}
    for config in ("static", "elastic"):
        path = os.path.join(args.out, f"{run_name(args, config)}.json")
        if not os.path.exists(path):
            command = f"run.py {config} --models {args.models} --pattern {args.pattern}"
            raise SystemExit(f"run.py compare: no {path}; run `{command}` first")
        with open(path) as f:
            runs[config] = json.load(f)
    # runs recorded before --pattern existed replayed the only traffic there was then: staggered
    static_traffic, elastic_traffic = ({"pattern": "staggered", **runs[c]["traffic"]} for c in ("static", "elastic"))
    if static_traffic != elastic_traffic:
        differ = ", ".join(
            f"{k} {static_traffic.get(k)} vs {elastic_traffic.get(k)}"
            for k in sorted(set(static_traffic) | set(elastic_traffic))
            if static_traffic.get(k) != elastic_traffic.get(k)
        )
        raise SystemExit(
            f"run.py compare: the static and elastic runs in {args.out} replayed different traffic ({differ}); "
            "run both with the same options"
        )
    machines = {c: runs[c].get("machine", {}) for c in runs}  # runs recorded before it was kept have none
    gpus = {c: machines[c].get("gpu") for c in runs}
    if None not in gpus.values() and gpus["static"] != gpus["elastic"]:
        raise SystemExit(
            f"run.py compare: the static run in {args.out} ran on {gpus['static']}, the elastic one on "
            f"{gpus['elastic']}; run both on the same kind of GPU"
        )
    hosts = {c: machines[c].get("host") for c in runs}
    if None not in hosts.values() and hosts["static"] != hosts["elastic"]:
        harness.log(f"compare: static ran on {hosts['static']}, elastic on {hosts['elastic']}: two machines")
    models = runs["static"]["models"]
    summary: dict = {"models": models, "slo_s": args.slo_s, "machines": machines, "per_model": {}}
    for i, name in enumerate(models):
        row = {c: model_stats(runs[c].get("requests", []), i, args.slo_s, runs[c]["traffic"]["duration"]) for c in runs}
        row["elastic_over_static"] = {
            k: (row["elastic"][k] / row["static"][k] if row["static"][k] and row["elastic"][k] is not None else None)
            for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "requests_per_s")
        }
        row["bursts"] = per_burst(runs, i, len(models))
        summary["per_model"][name] = row
    summary["elastic_kv_gib"] = kv_held(runs["elastic"].get("kv_samples", []), models)
    summary["preemptions"] = {c: runs[c].get("preemptions") for c in runs}
    summary["errors"] = {c: runs[c]["error"] for c in runs if "error" in runs[c]}
    plot(runs, summary, os.path.join(args.out, f"{run_name(args, 'multimodel')}.png"))
    return summary


def kv_held(samples: list[dict], models: list[str]) -> dict:
    """Per engine of the elastic run, the KV it mapped (GiB): its peak and its median over the samples. One
    engine holding most of the GPU at the median while a neighbour's requests queue is the starvation that a
    static slice prevents; the plot shows it over time, this puts it in numbers."""
    held = {}
    for m in models:
        values = [s[m] for s in samples if m in s]
        held[m] = (
            {"peak": round(max(values) / harness.GiB, 2), "median": round(statistics.median(values) / harness.GiB, 2)}
            if values
            else None
        )
    return held


def plot(runs: dict, summary: dict, path: str) -> None:
    """TTFT p99 per model, static against elastic; the elastic run's mapped KV per engine over time, with
    fair share's caps on it where the run recorded them (dotted: no new request above; dashed: no block)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = summary["models"]
    fig, (bars, mem) = plt.subplots(1, 2, figsize=(12, 4))
    for k, config in enumerate(("static", "elastic")):
        values = [summary["per_model"][m][config]["ttft_p99"] or 0 for m in models]
        bars.bar([i + 0.4 * k for i in range(len(models))], values, width=0.4, label=config)
    bars.set_xticks([i + 0.2 for i in range(len(models))], models, fontsize=8)
    bars.set_ylabel("TTFT p99 (s)")
    bars.set_yscale("log")
    bars.legend()
    samples = runs["elastic"].get("kv_samples", [])
    for m in models:
        (line,) = mem.plot([s["t"] for s in samples], [s[m] / harness.GiB for s in samples], label=m)
        for cap, style in (("admit_cap", ":"), ("yield_cap", "--")):
            if any(f"{m}:{cap}" in s for s in samples):  # NaN where no cap was set: the line breaks there
                capped = [s.get(f"{m}:{cap}", math.nan) / harness.GiB for s in samples]
                t = [s["t"] for s in samples]
                mem.plot(t, capped, style, color=line.get_color(), linewidth=1, label=f"{m} {cap}")
    mem.set_xlabel("seconds")
    mem.set_ylabel("mapped KV (GiB)")
    mem.set_title("elastic: each engine's KV memory")
    mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["both", "static", "elastic", "compare"])
    parser.add_argument("--models", type=int, choices=[2, 3], default=2, help="engines on the GPU (default 2)")
    parser.add_argument("--out", required=True, help="folder for JSON, logs and the PNG")
    parser.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES for the engines (default: inherited)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic (default 120)")
    parser.add_argument("--period-s", type=float, default=40.0, help="one burst per model every this (default 40)")
    parser.add_argument("--burst-s", type=float, default=10.0, help="length of a burst (default 10)")
    parser.add_argument("--burst-rate", type=float, default=40.0, help="requests/s in a burst (default 40)")
    parser.add_argument("--idle-rate", type=float, default=0.5, help="requests/s between bursts (default 0.5)")
    parser.add_argument("--slo-s", type=float, default=1.0, help="the TTFT objective (default 1 s)")
    parser.add_argument(
        "--pattern",
        choices=["staggered", "aligned"],
        default="staggered",
        help="bursts evenly out of phase (default) or all at once; files of the aligned run end in -aligned",
    )
    args = parser.parse_args()
    for name in ("duration", "period_s", "burst_s", "burst_rate", "idle_rate", "slo_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.burst_s >= args.period_s:
        parser.error("--burst-s must be shorter than --period-s")
    os.makedirs(args.out, exist_ok=True)
    harness.stop_servers_on_sigterm()
    if args.command == "compare":
        harness.write(args.out, run_name(args, "multimodel"), compare(args))
        return 0
    harness.TOTAL = harness.gpu_bytes(gpu_index(args))
    failed = False
    for config in ("static", "elastic") if args.command == "both" else (args.command,):
        result = run_config(args, config)
        harness.write(args.out, run_name(args, config), result)
        records, duration = result.get("requests", []), result["traffic"]["duration"]
        brief = {name: model_stats(records, i, args.slo_s, duration) for i, name in enumerate(result["models"])}
        print(
            json.dumps(
                {
                    "config": config,
                    "error": result.get("error"),
                    "preemptions": result.get("preemptions"),
                    "per_model": brief,
                }
            )
        )
        failed = failed or "error" in result
    if args.command == "both" and not failed:
        harness.write(args.out, run_name(args, "multimodel"), compare(args))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
