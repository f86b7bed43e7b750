"""Fair share under pressure: while another engine on the device is short of memory, an engine that holds
more than an equal share of the device's KV memory yields down to that share.

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
stops it), so two engines never trade caps. The caps lift ``LIFT_S`` after the last shortfall.

Opt-in (``KVCACHED_FAIR_SHARE=1``) until measured on a GPU with real engines.
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
        self._capped_until: float | None = None

    def _my_pools(self) -> list:
        pools = (info.manager() for info in registry.live_pools())
        return [m for m in pools if m is not None and not m.closed and host_device_label(m.device) == self.device]

    def share_bytes(self) -> tuple[int, int]:
        """(an equal share of what the kvcached engines on this device hold, what this process holds)."""
        held = held_per_process(self.settings, self.device)
        mine = held.get(os.getpid(), 0)
        return (sum(held.values()) // len(held) if held else 0), mine

    def on_shortfall(self) -> bool:
        """Another engine on the device fell short: cap this process's pools there if it holds more than an
        equal share (renewing the caps' time). Returns whether they are capped."""
        share, mine = self.share_bytes()
        if mine <= share:  # at or under the share: caps set before stay, for as long as the shortfalls go on
            if self._capped_until is not None:
                self._capped_until = time.monotonic() + self.LIFT_S
            return self._capped_until is not None
        mapped = {m: m.snapshot()["mapped_bytes"] for m in self._my_pools()}
        total = sum(mapped.values())
        if total == 0:
            return False
        for m, pool_mapped in mapped.items():
            m.yield_cap = pool_mapped * share // total
        if self._capped_until is None:
            logger.info(
                "kvcached: a neighbour on %s is short of memory; yielding down to an equal share (%d MiB of %d)",
                self.device,
                share >> 20,
                mine >> 20,
            )
        self._capped_until = time.monotonic() + self.LIFT_S
        return True

    def tick(self) -> None:
        """Lift the caps once no shortfall came for ``LIFT_S``."""
        if self._capped_until is not None and time.monotonic() >= self._capped_until:
            for m in self._my_pools():
                m.yield_cap = None
            self._capped_until = None
            logger.info(
                "kvcached: no neighbour on %s short of memory for %g s; growing again", self.device, self.LIFT_S
            )
