"""Memory backends of this process: parsing device strings and sharing one backend per device."""

from __future__ import annotations

import os
import sys
import threading
from typing import Union

from . import _native
from .config import ConfigError, Settings
from .runtime_dir import ensure_runtime_dir

_lock = threading.Lock()
_backends: dict[tuple, _native.MemoryBackend] = {}

DeviceLike = Union[str, "object"]  # a string or a torch.device


def parse_device(device: DeviceLike) -> tuple[str, int]:
    """``"cpu"`` -> ("host", 0); ``"cuda"``/``"cuda:N"`` (or a torch.device) -> ("cuda", N)."""
    text = str(device).strip().lower()
    if text == "cpu":
        return "host", 0
    if text == "cuda":
        torch = sys.modules.get("torch")  # follow torch's current device when torch is in use
        index = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
        return "cuda", int(index)
    if text.startswith("cuda:"):
        index_text = text[len("cuda:") :]
        if index_text.isdigit():
            return "cuda", int(index_text)
    raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")


def device_name(device: DeviceLike) -> str:
    """The canonical name of a device: ``cpu`` or ``cuda:N`` (``cuda`` alone: torch's current device)."""
    kind, index = parse_device(device)
    return "cpu" if kind == "host" else f"cuda:{index}"


def cuda_device(index: int) -> str:
    """The name of CUDA device ``index`` of this process: ``cuda:N``."""
    return f"cuda:{int(index)}"


def cuda_index(device: DeviceLike) -> int | None:
    """The CUDA index of ``device`` (``cuda`` alone: torch's current device), or None for the host."""
    kind, index = parse_device(device)
    return index if kind == "cuda" else None


def host_device_label(device: str) -> str:
    """The label a device (``cpu``, ``cuda:N``) has for every process of the host: what control segments
    and pressure records name. ``cuda:N`` is an index into this process's ``CUDA_VISIBLE_DEVICES``, so two
    engines started with different ones (the usual way to put engines on different GPUs) would both say
    ``cuda:0``; this names the GPU as the host does (``cuda:3``, or ``cuda:GPU-<uuid>`` when the variable
    lists UUIDs), so engines on different GPUs never count each other's memory."""
    if not device.startswith("cuda:"):
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return device
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    index = int(device[len("cuda:") :])
    if index >= len(entries):
        return device
    return f"cuda:{entries[index]}"[:31]


def cuda_unavailable_reason() -> str:
    """Why the CUDA backend cannot be used in this process, or '' when it can."""
    return _native.cuda_unavailable_reason()


def available_backends() -> list[str]:
    """Backends this build can use on this machine: ``["host"]`` or ``["host", "cuda"]``."""
    return ["host"] + (["cuda"] if cuda_unavailable_reason() == "" else [])


def planner_backend(device: DeviceLike, settings: Settings) -> _native.PlannerBackend:
    """A bookkeeping-only backend for a manager whose workers map ``device``'s memory themselves.

    Its pages follow the device's granularity: read from the device where this process can use it,
    else 2 MiB for CUDA (every VMM-capable GPU's) and the OS page for the host.
    """
    kind, index = parse_device(device)
    if kind == "host":
        granularity = get_backend("cpu", settings).granularity
    elif cuda_unavailable_reason() == "":
        granularity = get_backend(f"cuda:{index}", settings).granularity
    else:
        granularity = 2 << 20
    return _native.PlannerBackend("cuda" if kind == "cuda" else "cpu", index, granularity)


# What a CUDA device keeps free by default (KVCACHED_DEVICE_HEADROOM): room for what engines allocate while
# they serve beyond the activation peak they hold (kernel workspaces, sampler buffers of a new batch shape,
# cuBLAS and NCCL buffers); 0.7 % of an H200. On the host, engines' own memory is not in the budget.
CUDA_HEADROOM_BYTES = 1 << 30


def device_headroom(kind: str, settings: Settings) -> int:
    """The headroom of a device of ``kind`` ("host" or "cuda"): the setting, or the kind's default."""
    if settings.device_headroom_bytes is not None:
        return settings.device_headroom_bytes
    return CUDA_HEADROOM_BYTES if kind == "cuda" else 0


def get_backend(device: DeviceLike, settings: Settings) -> _native.MemoryBackend:
    """The process-wide backend for ``device`` (created on first use)."""
    kind, index = parse_device(device)
    headroom = device_headroom(kind, settings)
    if kind == "host":
        budget = settings.host_device_bytes
        path = ""
        if budget:
            path = os.path.join(ensure_runtime_dir(settings.resolved_runtime_dir()), "host-device.ledger")
        key: tuple = ("host", path, budget, headroom)
    else:
        reason = cuda_unavailable_reason()
        if reason:
            raise RuntimeError(f"device {device!r} is not usable: {reason}; use device='cpu' for the host backend")
        key = ("cuda", index, settings.backstop, headroom)
    with _lock:
        backend = _backends.get(key)
        if backend is None and kind == "host" and path:
            # One ledger slot per process: a second budget for the same ledger would claim the process's
            # slot again and undo the first one's accounting.
            other = next((k[2:] for k in _backends if k[:2] == ("host", path)), None)
            if other is not None:
                raise ConfigError(
                    f"KVCACHED_HOST_DEVICE_BYTES={budget} and KVCACHED_DEVICE_HEADROOM={headroom} for a manager "
                    f"of this process, which already uses {other[0]} and {other[1]} with the same ledger ({path}); "
                    "give every manager of a process the same host budget and headroom"
                )
        if backend is None:
            if kind == "host":
                backend = _native.HostBackend(path, budget, headroom)
            else:
                backend = _native.CudaBackend(index, settings.backstop, headroom)
            _backends[key] = backend
        return backend
