"""Byte sizes as people write them (512M, 1.5GiB) and as tables show them."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)[bB]?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_BYTES = 1 << 62  # far beyond any machine, and within every integer type the native layer uses


def parse_size(text: str) -> int:
    """Parse a byte size such as ``4096``, ``512M``, ``2G``, ``1.5GiB`` (binary units) into bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size; write bytes or a number with K, M, G or T (e.g. 512M, 1.5GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is larger than any supported size (4 EiB)")
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(value: int | None) -> str:
    """``1536 MiB`` -> ``"1.5G"``-style text; ``None`` (no limit) -> ``"-"``."""
    if value is None:
        return "-"
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value}B"
