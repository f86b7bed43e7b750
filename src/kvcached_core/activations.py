"""Room for an engine's activations, held in torch's cache at the end of its start-up.

An engine without kvcached leaves its activation memory free by sizing its KV cache below it: vLLM sizes
it under the peak it profiled, SGLang leaves ``1 - mem_fraction_static`` of the device. Both hand that
memory back to the device after start-up and take it again at their first large batch. With kvcached the
other engines' KV caches may have mapped it by then, and the engine's next large activation fails (seen on
an H200 with three vLLM engines: FlashAttention's 42 MiB workspace, out of memory). So at the end of
start-up each plugin makes torch cache the engine's activation peak: a tensor of the missing bytes, freed at
once, stays in torch's cache for the engine's own allocations and never goes back to the device.

torch is imported only when a reserve is held: the core needs no torch to run.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("kvcached")


def activation_reserve_bytes(stats: dict[str, int], peak_activation: int | None = None) -> int:
    """What torch must still cache so that the engine's activation peak fits without asking the device.

    ``stats`` is ``torch.cuda.memory_stats()``; ``peak_activation`` the engine's own measured peak (vLLM's
    ``Worker.peak_activation_memory``), else torch's peak allocation less what is allocated now (SGLang: its
    start-up runs a full prefill chunk eagerly before capturing CUDA graphs). Less what torch already caches
    unused."""
    allocated = stats.get("allocated_bytes.all.current", 0)
    if peak_activation is None:
        peak_activation = stats.get("allocated_bytes.all.peak", 0) - allocated
    cached_unused = stats.get("reserved_bytes.all.current", 0) - allocated
    return max(0, peak_activation - cached_unused)


def hold_activation_peak(device: Any, peak_activation: int | None = None, stream: Any = None) -> int:
    """Make torch cache the engine's activation peak on ``device`` now; returns the bytes it newly holds.

    ``stream``: the stream the engine runs its forward pass on (torch caches per stream; default: the
    current one). If the device cannot give the memory (other engines hold it), logs a warning naming the fix
    and returns 0: the engine still runs, at the risk the warning names."""
    import torch

    want = activation_reserve_bytes(torch.cuda.memory_stats(device), peak_activation)
    if want > 0:
        try:
            with torch.cuda.stream(stream):  # a no-op for None
                torch.empty(want, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            logger.warning(
                "kvcached: could not hold %d MiB for this engine's activations (other engines hold the GPU); "
                "it may run out of memory under load: start it first, or raise every engine's "
                "KVCACHED_DEVICE_HEADROOM",
                want >> 20,
            )
            return 0
    logger.info("kvcached: torch holds this engine's activation peak (%d MiB newly)", want >> 20)
    return want
