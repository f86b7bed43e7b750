"""One vLLM engine, offline, in a process of its own: greedy tokens for a fixed prompt set, then timed batches.

    python offline_engine.py MODEL [--prefix-caching] [--tp N] [--identity-prompts 256] [--identity-tokens 128]
                             [--throughput-prompts 1024] [--input-len 512] [--output-len 256] [--repeats 3]

Whether kvcached is on is decided by the environment (``KVCACHED_ENABLE``), exactly as users do. Prints one
line ``RESULT {json}``: the identity tokens, the timed batch's tokens per second, start-up time, the engine's
kvcached pools (as ``kvctl list`` shows them). vLLM's defaults are kept (CUDA graphs, torch.compile, its
attention backend); prompts are token ids (the model is random), generation ignores EOS so every run
produces the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

from machine_load import MachineLoad  # this folder (sys.path[0], or put first by the SGLang engine)


def identity_prompts(n: int, vocab: int) -> list[list[int]]:
    """Half the prompts share a 256-token prefix (prefix-cache hits), lengths 64 to 512 tokens."""
    rng = random.Random(1234)
    shared = [rng.randrange(3, vocab) for _ in range(256)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 257))]
        prompts.append(shared + body if i % 2 else body)
    return prompts


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def pools(engine: str = "vllm") -> list[dict]:
    """This engine's kvcached pools, as ``kvctl list`` shows them."""
    from kvcached_core import control

    return control.instances(engine=engine)


def kv_activity(*, engine: str | None = None, name: str | None = None) -> dict[str, int]:
    """kvcached's driver activity so far, summed over the live pools of ``engine`` (or of instance ``name``):
    map and unmap calls, mapped bytes (all zero without kvcached)."""
    from kvcached_core import control

    segments = [
        s
        for s in control.scan_segments(control.settings_for()).live
        if engine in (None, s.info["engine"]) and name in (None, s.info["name"])
    ]
    return {
        "page_maps": sum(s.info["counters"]["page_maps_total"] for s in segments),
        "page_unmaps": sum(s.info["counters"]["page_unmaps_total"] for s in segments),
        "mapped_bytes": sum(s.info["mapped_bytes"] for s in segments),
    }


def timed_batches(
    generate: Callable[[list[list[int]]], int],
    batch: list[list[int]],
    input_len: int,
    repeats: int,
    engine: str = "vllm",
) -> dict:
    """The median of ``repeats`` timed ``generate(batch)`` calls (each returns the tokens it generated), after a
    warm-up on 64 prompts: one batch's luck does not decide an engine's figure. Each batch's kvcached map and
    unmap calls are recorded with it (where the time went when a batch is slower), and so is the machine's
    load meanwhile (``load_each``: the GPU's clocks, the host's busy and stolen cores), which tells a slow
    machine from a slow engine when two engines of a pair ran minutes apart."""
    generate(batch[:64])
    seconds, activity, load, generated = [], [], [], 0
    for _ in range(repeats):
        before = kv_activity(engine=engine)
        watch = MachineLoad()
        begin = time.monotonic()
        generated = generate(batch)
        seconds.append(time.monotonic() - begin)
        load.append(watch.stop())
        after = kv_activity(engine=engine)
        activity.append(
            {k: after[k] - before[k] for k in ("page_maps", "page_unmaps")}
            | {"mapped_bytes_after": after["mapped_bytes"]}
        )
    elapsed = statistics.median(seconds)
    return {
        "seconds": elapsed,
        "seconds_each": seconds,
        "kvcached_each": activity,
        "load_each": load,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + len(batch) * input_len) / elapsed,
        "requests_per_s": len(batch) / elapsed,
    }


def workload_arguments(description: str) -> argparse.ArgumentParser:
    """The command line every engine's offline_engine.py shares (the harness's phases pass these)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--identity-prompts", type=int, default=256)
    parser.add_argument("--identity-tokens", type=int, default=128)
    parser.add_argument("--throughput-prompts", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches; the median one is reported")
    return parser


def main() -> None:
    parser = workload_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="off by default: CUDA graphs, as users run")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=args.model,
        served_model_name="offline",
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        enable_prefix_caching=args.prefix_caching,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=0,
    )
    result: dict = {"startup_s": time.monotonic() - started, "pools": pools()}
    vocab = llm.get_tokenizer().vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=args.identity_tokens, ignore_eos=True)
    prompts = identity_prompts(args.identity_prompts, vocab)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]

    if args.throughput_prompts:
        batch = random_prompts(args.throughput_prompts, args.input_len, vocab, seed=99)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

        def generate(prompts: list[list[int]]) -> int:
            done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)

        result["throughput"] = timed_batches(generate, batch, args.input_len, args.repeats)
    result["pools_after"] = pools()
    result["kvcached_enabled"] = os.environ.get("KVCACHED_ENABLE", "1") != "0"
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
