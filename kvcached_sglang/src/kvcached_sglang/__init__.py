"""kvcached-sglang: elastic KV cache pools for SGLang, loaded through SGLang's ``sglang.srt.plugins`` entry point.

``register()`` runs in every SGLang process that calls ``load_plugins()``. It checks the SGLang version and
every symbol it patches, then hands its patches to SGLang's ``HookRegistry``, which applies them. When
anything is wrong it logs one error line and registers nothing, so SGLang runs exactly as without kvcached.
"""

from __future__ import annotations

import logging

from kvcached_core import ConfigError, load_settings
from kvcached_core.patches import EngineSupport, Patch, PluginLoadError, Uses, load_checked

__version__ = "0.1.0"
SUPPORT = EngineSupport(
    engine="SGLang",
    distributions=("sglang",),
    supported=tuple(f"0.5.{n}" for n in range(16, 24)),  # 0.5.16 to 0.5.23, each release read or run
)

logger = logging.getLogger(__name__)
_state = {"registered": False, "active": False}


def patch_source() -> tuple[tuple[Patch, ...], tuple[str | Uses, ...]]:
    """The patches and the other SGLang symbols the plugin uses (importing them imports SGLang)."""
    from .patches import PATCHES, USED_SYMBOLS

    return PATCHES, USED_SYMBOLS


def register() -> None:
    """SGLang plugin entry point: register kvcached's patches with SGLang's HookRegistry (once per process)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        if not load_settings().enable:
            logger.info("kvcached: disabled by KVCACHED_ENABLE=0; SGLang runs with its own KV cache")
            return
        version, patches = load_checked(SUPPORT, patch_source)
    except (PluginLoadError, ConfigError) as exc:
        logger.error("kvcached: %s; SGLang runs with its own KV cache", exc)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for patch in patches:
        HookRegistry.register(patch.target, patch.hook, HookType[patch.kind.upper()])
    _state["active"] = True
    logger.info("kvcached: %d patches registered for SGLang %s", len(patches), version)


def active() -> bool:
    """Whether this process registered kvcached's patches."""
    return _state["active"]
