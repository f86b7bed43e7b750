"""What the examples share about their device: which one to demo on, and on a GPU, leaving only the demo's
memory budget free (what a GPU shared with other work looks like), so the engines' sum is bounded by it."""

from __future__ import annotations

import math
import sys
from typing import Any

import kvcached_core as kc

MIB = 1 << 20


def resolve_device(choice: str) -> str:
    """'cpu' or 'cuda' for ``--device``; exits with a message when cuda was asked for and is unusable."""
    if choice == "cpu":
        return "cpu"
    reason = kc.cuda_unavailable_reason()
    if not reason:
        import torch  # only here: the CPU path never needs torch in the driver

        if not torch.cuda.is_available():
            reason = f"torch {torch.__version__} sees no CUDA device"
    if not reason:
        return "cuda"
    if choice == "cuda":
        sys.exit(f"--device cuda is not usable: {reason}")
    return "cpu"


def hold_gpu_ballast(budget: int) -> tuple[Any, int]:
    """Allocate GPU memory until only about ``budget`` bytes are free; returns (ballast tensor, free bytes).
    Call it after the workers made their CUDA contexts and before they make their managers."""
    import torch

    free, _total = torch.cuda.mem_get_info()
    grain = 2 * MIB
    size = math.ceil(max(0, free - budget) / grain) * grain
    ballast = None
    while size > 0 and ballast is None:
        try:
            ballast = torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:  # free memory is never quite all allocatable: take a bit less
            size -= 32 * grain
    free_after, _ = torch.cuda.mem_get_info()
    return ballast, free_after
