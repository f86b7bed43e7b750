"""kvcached-sglang: elastic KV cache pools for SGLang, loaded through SGLang's ``sglang.srt.plugins`` entry point.

``register()`` runs in every SGLang process that calls ``load_plugins()``. It checks the SGLang version and
every symbol it patches, then hands its patches to SGLang's ``HookRegistry``, which applies them. When
anything is wrong it logs one error line and registers nothing, so SGLang runs exactly as without kvcached.
"""

from __future__ import annotations

import logging

from kvcached_core.patches import EngineSupport, Patch, Uses
from kvcached_core.plugin import EnginePlugin

__version__ = "0.1.0"
SUPPORT = EngineSupport(
    engine="SGLang",
    distributions=("sglang",),
    supported=tuple(f"0.5.{n}" for n in range(16, 24)),  # 0.5.16 to 0.5.23, each release read or run
)


def patch_source() -> tuple[tuple[Patch, ...], tuple[str | Uses, ...]]:
    """The patches and the other SGLang symbols the plugin uses (importing them imports SGLang)."""
    from .patches import PATCHES, USED_SYMBOLS

    return PATCHES, USED_SYMBOLS


def register_hook(patch: Patch) -> None:
    """Hands one checked patch to SGLang's HookRegistry, which applies it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(patch.target, patch.hook, HookType[patch.kind.upper()])


PLUGIN = EnginePlugin(SUPPORT, patch_source, register_hook, logging.getLogger(__name__), raise_on_error=False)
register = PLUGIN.register
active = PLUGIN.active
