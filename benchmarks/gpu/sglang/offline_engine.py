"""One SGLang engine, offline, in a process of its own: greedy tokens for a fixed prompt set, then timed batches.

    python offline_engine.py MODEL [--prefix-caching] [--tp N] [--identity-prompts 256] [--identity-tokens 128]
                             [--throughput-prompts 1024] [--input-len 512] [--output-len 256] [--repeats 3]

The same command line and ``RESULT {json}`` line as the vLLM harness's ``offline_engine.py`` (whose prompt
sets it uses), so that harness's phases drive it. Whether kvcached is on is decided by the environment
(``KVCACHED_ENABLE``). ``--prefix-caching`` keeps SGLang's radix cache (otherwise disabled). SGLang runs with
the triton attention backend and pytorch sampling, the ones the lent H200's staged build carries, CUDA graphs
on; prompts are token ids, generation ignores EOS.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm"))
from offline_engine import (  # noqa: E402  (the vLLM harness's)
    identity_prompts,
    pools,
    random_prompts,
    timed_batches,
    workload_arguments,
)


def pool_tokens(engine: object) -> int | None:
    """The token pool SGLang sized from free memory (a pair's throughput compares equal pools only if they
    are equal), or None where this release's server info lacks it: a figure to note, not a reason to lose
    the run."""
    try:
        return engine.get_server_info().get("max_total_num_tokens")
    except Exception as exc:  # noqa: BLE001  (introspection only; the measurement goes on)
        print(f"no pool size from get_server_info(): {exc}", file=sys.stderr)
        return None


def main() -> None:
    parser = workload_arguments(__doc__.split("\n\n")[0])  # --prefix-caching keeps SGLang's radix cache
    parser.add_argument("--mem-fraction-static", type=float, default=0.85)
    parser.add_argument("--attention-backend", default="triton")
    args = parser.parse_args()

    import sglang

    started = time.monotonic()
    engine = sglang.Engine(
        model_path=args.model,
        dtype="bfloat16",
        tp_size=args.tp,
        attention_backend=args.attention_backend,
        sampling_backend="pytorch",
        mem_fraction_static=args.mem_fraction_static,
        context_length=4096,
        disable_radix_cache=not args.prefix_caching,
        random_seed=0,
        log_level="warning",
    )
    try:
        result: dict = {"startup_s": time.monotonic() - started, "pools": pools("sglang")}
        result["kv_tokens"] = pool_tokens(engine)
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        greedy = {"temperature": 0, "max_new_tokens": args.identity_tokens, "ignore_eos": True}
        outputs = engine.generate(input_ids=identity_prompts(args.identity_prompts, vocab), sampling_params=greedy)
        result["tokens"] = [list(o["output_ids"]) for o in outputs]
        if args.throughput_prompts:
            batch = random_prompts(args.throughput_prompts, args.input_len, vocab, seed=99)
            params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}

            def generate(prompts: list[list[int]]) -> int:
                done = engine.generate(input_ids=prompts, sampling_params=params)
                return sum(len(o["output_ids"]) for o in done)

            result["throughput"] = timed_batches(generate, batch, args.input_len, args.repeats, "sglang")
        result["pools_after"] = pools("sglang")
        result["kvcached_enabled"] = os.environ.get("KVCACHED_ENABLE", "1") != "0"
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
