"""Every ``KVCACHED_*`` setting, parsed and validated in one place.

The native core never reads the environment: :func:`load_settings` reads it once and the values are
handed to the core explicitly. A bad value raises :class:`ConfigError` naming the variable and the fix.
The README's configuration table lists the same settings, defaults and meanings.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from .units import parse_size


class ConfigError(ValueError):
    """A KVCACHED_* variable holds a value that cannot be used."""


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


MAX_COUNT = (1 << 31) - 1  # counts and milliseconds: the native layer keeps them in 32 bits


def _non_negative_int(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"{value} is negative")
    if value > MAX_COUNT:
        raise ValueError(f"{value} is larger than {MAX_COUNT}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise ValueError("0 is not positive")
    return value


def _size(text: str) -> int:
    return parse_size(text)


def _fraction(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # also false for nan
        raise ValueError(f"{text.strip()!r} is not a number from 0 to 1")
    return value


KV_LAYOUTS = ("engine", "block-outer")
BLOCK_PLACEMENTS = ("compact", "request")


def _one_of(what: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser for one of ``choices`` (any case), whose error names ``what`` and the choices."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not a {what}; use {' or '.join(choices)}")
        return value

    return parse


def _default_runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "kvcached")
    return os.path.join("/tmp", f"kvcached-{os.getuid()}")


@dataclass(frozen=True)
class Setting:
    env: str
    parse: Callable[[str], object]
    meaning: str


@dataclass(frozen=True)
class Settings:
    """Validated configuration. Field names match the variables without the ``KVCACHED_`` prefix."""

    enable: bool = True
    page_bytes: int = 0
    reserved_pages: int = 2
    map_ahead_pages: int = 0
    reclaim_delay_ms: int = 1000
    idle_hold_ms: int = 30000
    pool_target: int = 4
    pool_max: int = 16
    zero_on_map: bool = False
    backstop: bool = True
    host_device_bytes: int = 0
    device_headroom_bytes: int | None = None
    control: bool = True
    watch_interval_ms: int = 10
    prefix_cache_bytes: int = 512 << 20
    prefix_cache_floor_bytes: int = 0
    fair_share: bool = False
    fair_share_wait_ms: int = 0
    fair_share_admit_first: bool = False
    fair_share_floor: float = 0.0
    kv_layout: str = "engine"
    block_placement: str = "compact"
    runtime_dir: str | None = None

    def resolved_runtime_dir(self) -> str:
        return self.runtime_dir or _default_runtime_dir()


SETTINGS: dict[str, Setting] = {
    "enable": Setting("KVCACHED_ENABLE", _bool, "0 turns the engine plugins off"),
    "page_bytes": Setting(
        "KVCACHED_PAGE_BYTES",
        _size,
        "physical page size; 0 = per pool: on CUDA the largest of 32/16/8/4/2 MiB that cuts each buffer into "
        "64 pages or more, else 2 MiB (never below a block); larger pages grow faster, in coarser units",
    ),
    "reserved_pages": Setting(
        "KVCACHED_RESERVED_PAGES", _non_negative_int, "mapped empty pages kept for reuse (per manager)"
    ),
    "map_ahead_pages": Setting(
        "KVCACHED_MAP_AHEAD_PAGES",
        _non_negative_int,
        "empty pages a background thread keeps mapped ahead of an engine that is allocating, so a growing load "
        "rarely maps on its own path; they go back with the demand window when the load stops (0 = none)",
    ),
    "reclaim_delay_ms": Setting(
        "KVCACHED_RECLAIM_DELAY_MS",
        _non_negative_int,
        "demand window: empty pages that were in use within the last one or two windows stay mapped "
        "(0 = keep only the reserve)",
    ),
    "idle_hold_ms": Setting(
        "KVCACHED_IDLE_HOLD_MS",
        _non_negative_int,
        "an engine that no other kvcached engine on its device could yield to keeps its recent demand mapped "
        "this long instead of the demand window, so a load that pauses does not map it all again; a neighbour "
        "appearing shortens it back at once (0 = the demand window always)",
    ),
    "pool_target": Setting(
        "KVCACHED_POOL_TARGET",
        _non_negative_int,
        "physical handles kept ready by the pool thread (0 = none created ahead)",
    ),
    "pool_max": Setting("KVCACHED_POOL_MAX", _non_negative_int, "bound on pooled physical handles"),
    "zero_on_map": Setting("KVCACHED_ZERO_ON_MAP", _bool, "zero pages when they are mapped"),
    "backstop": Setting(
        "KVCACHED_BACKSTOP",
        _bool,
        "CUDA: unmapped pages map one shared zeroed page of their size, so a kernel reading an unallocated block "
        "reads zeros instead of faulting (one more driver call per map and unmap; 0 = leave them unmapped)",
    ),
    "host_device_bytes": Setting(
        "KVCACHED_HOST_DEVICE_BYTES",
        _size,
        "size of the host memory budget shared by all host-backend processes of this user (0 = no budget)",
    ),
    "device_headroom_bytes": Setting(
        "KVCACHED_DEVICE_HEADROOM",
        _size,
        "device memory the KV caches of every process leave free, for the engines' own allocations (activations, "
        "library workspaces); default 1 GiB on CUDA, 0 on the host backend",
    ),
    "control": Setting(
        "KVCACHED_CONTROL", _bool, "publish a control segment per manager, for kvctl and kvtop (0 = none)"
    ),
    "watch_interval_ms": Setting(
        "KVCACHED_WATCH_INTERVAL_MS",
        _positive_int,
        "longest time before a manager sees a kvctl limit and republishes its state",
    ),
    "prefix_cache_bytes": Setting(
        "KVCACHED_PREFIX_CACHE_BYTES",
        _size,
        "memory an idle engine keeps mapped for cached prefixes (vLLM's prefix cache, SGLang's radix cache; 512 MiB)",
    ),
    "prefix_cache_floor_bytes": Setting(
        "KVCACHED_PREFIX_CACHE_FLOOR_BYTES",
        _size,
        "cached-prefix memory an idle engine keeps when another engine on its device is short of memory",
    ),
    "fair_share": Setting(
        "KVCACHED_FAIR_SHARE",
        _bool,
        "when another engine on the device is short of memory, an engine holding more than an equal share of "
        "the device's KV memory gives back down to it (preempting requests); the short engine's share stays "
        "kept for it until 30 s after its last shortfall, the rest is lent; 0 = only cached prefixes and idle "
        "pages are given back",
    ),
    "fair_share_wait_ms": Setting(
        "KVCACHED_FAIR_SHARE_WAIT_MS",
        _non_negative_int,
        "with KVCACHED_FAIR_SHARE, how long a neighbour must have been short (signals at most a second apart) "
        "before engines above an equal share yield to it, preempting down to the share; a shorter wait is left "
        "to the neighbours' own requests finishing (0 = yield at its first shortfall)",
    ),
    "fair_share_admit_first": Setting(
        "KVCACHED_FAIR_SHARE_ADMIT_FIRST",
        _bool,
        "with KVCACHED_FAIR_SHARE, a vLLM engine above an equal share stops admitting new requests at a "
        "neighbour's first shortfall, before the wait ends: its running requests finish and hand their memory "
        "over, nothing is preempted (SGLang engines wait as without it)",
    ),
    "fair_share_floor": Setting(
        "KVCACHED_FAIR_SHARE_FLOOR",
        _fraction,
        "with KVCACHED_FAIR_SHARE, the part of an equal share of the device (0 to 1) that every engine keeps "
        "free for itself however little it holds: no neighbour grows into it, so an idle engine's next burst "
        "starts at once on that much instead of waiting for a neighbour to yield (0 = all of an idle engine's "
        "share is lent; 1 = static slices)",
    ),
    "kv_layout": Setting(
        "KVCACHED_KV_LAYOUT",
        _one_of("KV layout", KV_LAYOUTS),
        "engine: the engine's own KV layout (vLLM: one buffer per layer); block-outer: every layer's K and V of a "
        "block side by side (vLLM with an attention backend that reads KV by block stride, e.g. FlashAttention), "
        "so a page gives back whole blocks of all layers: a unit 1/layers of the engine layout's",
    ),
    "block_placement": Setting(
        "KVCACHED_BLOCK_PLACEMENT",
        _one_of("block placement", BLOCK_PLACEMENTS),
        "compact: new blocks fill pages already in use first, so few pages are mapped; request: a vLLM request "
        "grows on its own last page, then on empty or new pages before other requests' partly used ones, so a "
        "finished or preempted request empties pages and a yield to a neighbour preempts in proportion to what "
        "it gives back (more pages partly used while busy)",
    ),
    "runtime_dir": Setting(
        "KVCACHED_RUNTIME_DIR",
        str,
        "per-user directory (0700) for ledgers and segments; default $XDG_RUNTIME_DIR/kvcached or /tmp/kvcached-$UID",
    ),
}


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Read every KVCACHED_* variable from ``environ`` (default ``os.environ``); ``overrides`` win."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for name, setting in SETTINGS.items():
        raw = env.get(setting.env)
        if raw is None or raw == "":
            continue
        try:
            values[name] = setting.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{setting.env}={raw!r}: {exc}") from None
    known = {f.name for f in fields(Settings)}
    for key, value in overrides.items():
        if key not in known:
            raise TypeError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
        values[key] = value
    return Settings(**values)  # type: ignore[arg-type]
