"""What both engine plugins share: the engine version check and named patch units that verify their targets.

The core never imports an engine. A plugin describes each engine symbol it touches as a :class:`Patch`, and
:func:`verify` resolves them all at plugin load, so a missing symbol is one clear error then, not a failure at
the first request.
"""

from __future__ import annotations

import importlib.metadata
import pkgutil
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class PluginLoadError(RuntimeError):
    """The plugin cannot patch this engine (unsupported version, missing symbol); the message names the fix."""


@dataclass(frozen=True)
class EngineSupport:
    """Which versions of an engine a plugin supports, as release prefixes: ``("0.32", "0.33")``."""

    engine: str
    distributions: tuple[str, ...]  # distributions that install the engine's package, in lookup order
    supported: tuple[str, ...]

    def installed_version(self) -> str | None:
        """The installed engine version from package metadata (imports nothing), or None when absent."""
        for dist in self.distributions:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def is_supported(self, version: str) -> bool:
        """Whether ``version``'s release (``0.5.23``, ``0.33.0rc1`` -> ``0.33.0``) starts with a supported prefix."""
        match = re.match(r"\d+(\.\d+)*", version)
        if match is None:
            return False
        release = match.group(0).split(".")
        return any(release[: len(p.split("."))] == p.split(".") for p in self.supported)

    def check(self, version: str | None = None) -> str:
        """Return the installed (or given) version; raise PluginLoadError when it is missing or unsupported."""
        version = version if version is not None else self.installed_version()
        wanted = ", ".join(self.supported)
        if version is None:
            raise PluginLoadError(f"{self.engine} is not installed; kvcached supports {self.engine} {wanted}")
        if not self.is_supported(version):
            raise PluginLoadError(
                f"{self.engine} {version} is not supported by this kvcached plugin (supported: {wanted}); "
                f"install a supported {self.engine}, or set KVCACHED_ENABLE=0 to run without kvcached"
            )
        return version


@dataclass(frozen=True)
class Patch:
    """One named change to one engine symbol.

    ``target`` is the dotted path of the symbol replaced or wrapped; ``kind`` says how (engine-specific, e.g.
    ``"replace"`` or ``"around"``); ``hook`` is what goes in; ``why`` is one line for the docs and the check.
    """

    name: str
    target: str
    kind: str
    hook: Callable[..., Any] | type | None
    why: str

    def resolve(self) -> Any:
        """The current target object; AttributeError/ImportError when the engine no longer has it."""
        return pkgutil.resolve_name(self.target)


def verify(patches: Iterable[Patch], engine: str, version: str, extra_symbols: Sequence[str] = ()) -> None:
    """Resolve every patch target (and every other engine symbol the plugin uses); raise one PluginLoadError
    naming all that are missing."""
    targets = [p.target for p in patches] + list(extra_symbols)
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    if missing:
        raise PluginLoadError(
            f"{engine} {version} lacks {', '.join(missing)}, which kvcached patches; "
            f"use a supported {engine} version or set KVCACHED_ENABLE=0"
        )


def check_report(patches: Iterable[Patch], extra_symbols: Sequence[str] = ()) -> list[dict[str, str]]:
    """One row per symbol the plugin touches: target, patch name, kind, and ``ok`` or the error."""
    rows = [{"target": p.target, "patch": p.name, "kind": p.kind, "why": p.why} for p in patches]
    rows += [{"target": s, "patch": "-", "kind": "uses", "why": "read by the plugin"} for s in extra_symbols]
    for row in rows:
        try:
            pkgutil.resolve_name(row["target"])
            row["status"] = "ok"
        except (ImportError, AttributeError, ValueError) as exc:
            row["status"] = f"missing ({type(exc).__name__})"
    return rows
