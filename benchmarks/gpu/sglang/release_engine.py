"""One ``sglang.Engine`` with the memory saver: greedy tokens, ``release_memory_occupation()``, then
``resume_memory_occupation()`` and the same prompts again, with the GPU's used memory and kvcached's mapped KV
at each step. What RL frameworks do between rollouts; kvcached is on or off by ``KVCACHED_ENABLE``.

    python release_engine.py MODEL [--memory-saver]    prints RESULT {json}, as ``offline_engine.py`` does

Without ``--memory-saver`` SGLang releases nothing itself (its memory saver is what unmaps weights, KV cache
and CUDA graphs); with kvcached the KV cache is still given back, by the plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm"))
from offline_engine import identity_prompts, pools  # noqa: E402  (the vLLM harness's)


def memory(name: str) -> dict:
    """The GPU's used memory (nvidia-smi, every process) and the KV memory kvcached maps for ``name``."""
    used = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
    ).stdout.split()
    mapped = sum(r["mapped_bytes"] for r in pools("sglang") if r["name"] == name)
    return {"gpu_used_mib": int(used[0]) if used else None, "kvcached_mapped_bytes": mapped}


def main() -> None:
    model, saver = sys.argv[1], "--memory-saver" in sys.argv[2:]
    import sglang

    engine = sglang.Engine(
        model_path=model,
        dtype="bfloat16",
        attention_backend="triton",
        sampling_backend="pytorch",
        mem_fraction_static=0.85,
        context_length=4096,
        random_seed=0,
        enable_memory_saver=saver,
        log_level="warning",
    )
    name = os.path.basename(model.rstrip("/"))
    try:
        with open(os.path.join(model, "config.json")) as f:
            prompts = identity_prompts(64, json.load(f)["vocab_size"])
        greedy = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        result: dict = {"memory_saver": saver, "memory": {}}
        before = engine.generate(input_ids=prompts, sampling_params=greedy)
        result["memory"]["served"] = memory(name)
        started = time.monotonic()
        engine.release_memory_occupation()
        result["release_s"] = time.monotonic() - started
        result["memory"]["released"] = memory(name)
        started = time.monotonic()
        engine.resume_memory_occupation()
        result["resume_s"] = time.monotonic() - started
        result["memory"]["resumed"] = memory(name)
        after = engine.generate(input_ids=prompts, sampling_params=greedy)
        result["memory"]["served_again"] = memory(name)
        result["tokens_before"] = [list(o["output_ids"]) for o in before]
        result["tokens_after"] = [list(o["output_ids"]) for o in after]
        result["same_after_resume"] = result["tokens_before"] == result["tokens_after"]
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
