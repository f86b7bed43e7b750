"""The skeleton both engine plugins share: ``register()`` once per process, the switch, the checked load.

An engine calls its plugin's entry point in every process it starts. :class:`EnginePlugin` does the part
that does not depend on the engine: it runs once per process, honours ``KVCACHED_ENABLE=0``, checks the
installed release and every symbol the plugin touches (:func:`kvcached_core.patches.load_checked`), and
hands each checked patch to the engine's own way of applying it. Whether a failed check stops the engine
(vLLM: it shows plugin errors and stops start-up, the earliest and clearest place) or is logged while the
engine runs without kvcached (SGLang, whose plugin loader would hide an exception) is the plugin's choice.
It also sends the core's own log records (the ``kvcached`` logger: pressure, fair share, start-up lock) to
the plugin's logger, so they appear wherever the engine shows its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import ConfigError, load_settings
from .patches import EngineSupport, Patch, PatchSource, PluginLoadError, load_checked


class _ToEngineLogger(logging.Handler):
    """Hands each record of the core's logger to the engine plugin's logger (and so to the engine's handlers:
    vLLM's own logger does not propagate to the root, where the core's records would otherwise go)."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.isEnabledFor(record.levelno):
            self.target.handle(record)


def route_core_logs(target: logging.Logger) -> None:
    """Send the ``kvcached`` logger's records to ``target``, filtered by ``target``'s level when they are
    emitted (an engine may configure its logging after loading its plugins), once per process."""
    core = logging.getLogger("kvcached")
    if any(isinstance(h, _ToEngineLogger) for h in core.handlers):
        return
    core.addHandler(_ToEngineLogger(target))
    core.setLevel(logging.DEBUG)
    core.propagate = False  # else a record reaches the root's handlers too when both the engine and root have them


@dataclass
class EnginePlugin:
    """One engine plugin's registration state and policy."""

    support: EngineSupport
    source: PatchSource  # the patches and the other engine symbols used (importing them imports the engine)
    apply: Callable[[Patch], None]  # installs one checked patch the engine's way
    logger: logging.Logger
    raise_on_error: bool  # True: a failed check raises (stops the engine); False: it is logged, engine as is
    _registered: bool = field(default=False, init=False)
    _active: bool = field(default=False, init=False)

    def register(self) -> None:
        """The engine's plugin entry point: check and apply the patches in this process (once)."""
        if self._registered:
            return
        self._registered = True
        route_core_logs(self.logger)
        engine = self.support.engine
        try:
            if not load_settings().enable:
                self.logger.info("kvcached: disabled by KVCACHED_ENABLE=0; %s runs with its own KV cache", engine)
                return
            version, patches = load_checked(self.support, self.source)
        except (PluginLoadError, ConfigError) as exc:
            if self.raise_on_error:
                raise
            self.logger.error("kvcached: %s; %s runs with its own KV cache", exc, engine)
            return
        for patch in patches:
            self.apply(patch)
        self._active = True
        self.logger.info("kvcached: %d patches applied for %s %s", len(patches), engine, version)

    def active(self) -> bool:
        """Whether this process applied kvcached's patches."""
        return self._active
