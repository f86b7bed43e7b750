"""Fair share under pressure: when another engine on the device falls short of memory, an engine that holds
more than an equal share of the device's KV memory yields down to that share, and grows back only into
memory the device leaves spare.

Without it, a busy engine keeps every page it mapped in its burst, and a neighbour whose burst comes next
waits for that engine's requests to finish (seen on an H200 with three engines: one held 101 GiB while a
neighbour had 0.5 GiB and a queue of 316 requests). Static partitioning never lets that happen; elastic
memory should not either, while still lending an idle neighbour's share to whoever is busy.

The share is what every kvcached engine on the device holds (mapped pages and ready handles, read from the
control segments), divided by the number of engines. A shortfall means the device is full, so that sum is
close to everything the engines can have. An engine above the share caps each of its pools on the device
(``BlockAllocator.yield_cap``, in proportion to what each holds): its scheduler sees no free blocks, admits
nothing new and preempts until it is under the cap; the pages that empties are unmapped at once and the
short engine maps them. A capped pool does not report shortfalls of its own (its cap, not the device,
stops it), so two engines never trade caps.

The caps follow what the device leaves unused, not the neighbour's signals alone. A short engine stops
signalling once it has its share, while it still needs it: lifting the caps then (the first version, one
second after the last shortfall) let the capped engines take the memory straight back and the neighbour
fall short again, a cycle of mass preemptions (6436 in two minutes on the H200 with three engines). Now,
``LIFT_S`` after the last shortfall, each capped engine raises its caps by its part (one engine's) of the
device's spare memory, once per ``LIFT_S``, and lifts them when a whole share lies spare or the caps no
longer bind. While every engine uses its share the caps stay, as a static partition would; memory an engine
leaves unused flows back to the others a step at a time, and a new shortfall takes the caps back to the share.
"""

from __future__ import annotations

import logging
import os
import time

from . import registry
from .backends import host_device_label
from .config import Settings
from .segment import held_per_process

logger = logging.getLogger("kvcached")


class FairShare:
    """One engine process's side of the policy, for one device; driven by its pressure watch's thread."""

    LIFT_S = 1.0  # a short engine signals every 50 ms: a second without a signal means it has what it needs

    def __init__(self, settings: Settings, device: str) -> None:
        self.settings = settings
        self.device = host_device_label(device)
        self._capped = False
        self._last_shortfall = 0.0
        self._last_raise = 0.0

    def _my_pools(self) -> list:
        return [m for m in registry.live_managers() if not m.closed and host_device_label(m.device) == self.device]

    def share_bytes(self) -> tuple[int, int, int]:
        """(an equal share of what the kvcached engines on this device hold, what this process holds, how
        many engines hold memory there)."""
        held = held_per_process(self.settings, self.device)
        mine = held.get(os.getpid(), 0)
        return (sum(held.values()) // len(held) if held else 0), mine, len(held)

    def _set_caps(self, total_cap: int, pools: list) -> None:
        """Cap ``pools`` at ``total_cap`` together, each in proportion to what it maps."""
        mapped = {m: m.snapshot()["mapped_bytes"] for m in pools}
        total = sum(mapped.values())
        for m, pool_mapped in mapped.items():
            m.yield_cap = pool_mapped * total_cap // total if total else total_cap // len(mapped)

    def on_shortfall(self) -> bool:
        """Another engine on the device fell short: cap this process's pools there at an equal share if it
        holds more than one. Returns whether they are capped."""
        self._last_shortfall = time.monotonic()
        share, mine, _engines = self.share_bytes()
        if mine <= share:  # at or under the share: caps set before stay
            return self._capped
        pools = self._my_pools()
        if not any(m.snapshot()["mapped_bytes"] for m in pools):
            return self._capped
        self._set_caps(share, pools)
        if not self._capped:
            logger.info(
                "kvcached: a neighbour on %s is short of memory; yielding down to an equal share (%d MiB of %d)",
                self.device,
                share >> 20,
                mine >> 20,
            )
        self._capped = True
        return True

    def tick(self) -> None:
        """``LIFT_S`` after the last shortfall and at most once per ``LIFT_S``: raise the caps by this engine's
        part of the device's spare memory, or lift them when a whole share is spare or they no longer bind."""
        now = time.monotonic()
        if not self._capped or now - max(self._last_shortfall, self._last_raise) < self.LIFT_S:
            return
        pools = self._my_pools()
        if not pools:
            self._capped = False
            return
        spare = min(m.device_spare_bytes() for m in pools)
        if spare < min(m.page_bytes * m.num_buffers for m in pools):
            return  # not one more page of any pool: every engine uses its share, and the caps hold
        self._last_raise = now
        share, mine, engines = self.share_bytes()
        caps = sum(m.yield_cap or 0 for m in pools)
        if spare >= share or caps >= mine + spare:
            for m in pools:
                m.yield_cap = None
            self._capped = False
            logger.info("kvcached: memory on %s is spare again; no longer yielding", self.device)
            return
        self._set_caps(caps + spare // max(1, engines), pools)
