"""kvcached-core: an elastic KV cache for LLM serving engines.

Physical memory is mapped page by page only while KV blocks in that page are in use, so several engines
on one device (or on the host) float memory between them. See the README for the public API.
"""

from __future__ import annotations

from ._native import BackendError, ClosedError, SegmentError
from .backends import available_backends, cuda_unavailable_reason
from .config import ConfigError, Settings, load_settings
from .manager import KVCacheManager
from .mirror import PageMirror
from .units import format_bytes, parse_size

__version__ = "0.1.0"


def capabilities() -> dict:
    """What this build offers: backends, and the operation counters (from the native snapshot schema)."""
    from . import _native

    return {
        "version": __version__,
        "backends": available_backends(),
        "operation_counters": list(_native.OPERATION_COUNTERS),
        "counting": bool(_native.counting),
        "control_segments": True,
    }


__all__ = [
    "BackendError",
    "ClosedError",
    "ConfigError",
    "SegmentError",
    "KVCacheManager",
    "PageMirror",
    "Settings",
    "__version__",
    "available_backends",
    "capabilities",
    "cuda_unavailable_reason",
    "format_bytes",
    "load_settings",
    "parse_size",
]
