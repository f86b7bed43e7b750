"""Every number of a GPU run, without raw token lists and samples: reads the phases' JSON in a folder, prints
one JSON object (to stdout) and a short table (to stderr).

    python summary.py WORK_DIR > summary.json
"""

from __future__ import annotations

import glob
import json
import os
import sys

BULKY = {"tokens", "samples", "stdout_tail", "runs"}
# What the short table shows of a phase: these keys, and every side's ratios to vanilla (offline's
# ratio_<side>, ratio_range_<side>, pooled_ratio_<side>).
BRIEF = {
    "identity",
    "backstop_off",
    "error",
    "handover",
    "sum_of_peaks_over_gpu",
    "max_mapped_2s_after",
    "failed",
    "ttft_p50_ratio",
    "stopped_for_budget",
}
BRIEF_PREFIXES = ("ratio_", "pooled_ratio_")


def strip(value):
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in BULKY}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def brief(phase: dict) -> dict:
    """What the short table shows of a phase (or of one rate of a serving phase)."""
    return {k: v for k, v in phase.items() if k in BRIEF or k.startswith(BRIEF_PREFIXES)}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: summary.py WORK_DIR (a folder with the phases' JSON)", file=sys.stderr)
        return 2
    summary = {}
    for path in sorted(glob.glob(os.path.join(argv[0], "*.json"))):
        with open(path) as f:
            summary[os.path.basename(path)[:-5]] = strip(json.load(f))
    machine = os.path.join(argv[0], "machine.txt")
    if os.path.exists(machine):
        summary["machine"] = open(machine).read().strip().splitlines()
    print(json.dumps(summary, indent=1))
    for name, phase in summary.items():
        if isinstance(phase, dict):
            print(f"{name}: {json.dumps(brief(phase))[:600]}", file=sys.stderr)
            for rate, by_side in phase.get("rates", {}).items():  # serve's and serve-ab's ratios, per rate
                print(f"{name} {rate}: {json.dumps(brief(by_side))[:600]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
