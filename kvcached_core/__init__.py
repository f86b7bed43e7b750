"""kvcached-core: an elastic KV cache for LLM serving engines.

Physical memory is mapped page by page only while KV blocks in that page are in use, so several engines
on one device (or on the host) float memory between them. See the README for the public API.
"""

from __future__ import annotations

from ._native import BackendError, ClosedError
from .backends import available_backends, cuda_unavailable_reason
from .config import ConfigError, Settings, load_settings, parse_size
from .manager import KVCacheManager

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ClosedError",
    "ConfigError",
    "KVCacheManager",
    "Settings",
    "__version__",
    "available_backends",
    "cuda_unavailable_reason",
    "load_settings",
    "parse_size",
]
