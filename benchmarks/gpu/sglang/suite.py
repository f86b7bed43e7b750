"""kvcached-sglang on a GPU, measured against SGLang without kvcached in the same run. Prints and writes JSON.

    python suite.py PHASE [PHASE ...] --out DIR [--model DIR]

The vLLM harness's phases (``benchmarks/gpu/vllm/suite.py``) with SGLang in place of vLLM:

- ``offline``: fresh ``sglang.Engine`` processes alternating without/with kvcached (``KVCACHED_ENABLE=0/1``):
  greedy tokens of 256 prompts with the radix cache off and on (must be identical), and each engine's median
  of three timed batches (offline throughput ratio); ``offline.json`` is rewritten after every engine.
- ``serve``: one ``python -m sglang.launch_server`` without, then one with kvcached; the open-loop streaming
  client at 16 and 64 requests/s and at saturation: TTFT and TPOT p50/p99, and kvcached's map and unmap calls
  per rate.
- ``model``: only make the model.

Same model as the vLLM harness (random weights, Llama-3-8B's KV shape). SGLang runs with the triton
attention backend and pytorch sampling (what the staged 0.5.16 build on the lent H200 carries), CUDA graphs on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm"))
import suite as harness  # noqa: E402  (the vLLM harness: model, client, offline and serve phases)


class SGLangServer(harness.Server):
    """One ``python -m sglang.launch_server`` in its own process group."""

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
            *extra,
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phases", nargs="+", choices=["model", "offline", "serve"])
    parser.add_argument("--out", required=True, help="folder for JSON and logs")
    parser.add_argument("--model", help="model directory (default: made here, Llama-3-8B's KV shape)")
    parser.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES for the engines (default: inherited)")
    args = parser.parse_args()
    args.offline_engine, args.server = os.path.join(HERE, "offline_engine.py"), SGLangServer
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run still stops its servers (finally)
    args.model = args.model or harness.make_model(os.path.join(tempfile.gettempdir(), "kvcached-llama3-8b-kv"))
    with open(os.path.join(args.model, "config.json")) as f:
        harness.VOCAB = json.load(f)["vocab_size"]
    for phase in args.phases:
        harness.log(f"== sglang {phase}")
        try:
            if phase == "offline":
                harness.phase_offline(args)  # writes offline.json itself, after every engine
            elif phase == "serve":
                harness.write(args.out, "serve", harness.phase_serve(args))
        except Exception as exc:  # one phase failing must not lose the others' results
            harness.log(f"{phase} failed: {type(exc).__name__}: {exc}")
            harness.write(args.out, f"{phase}_error", {"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
