"""Idle hold: an engine that no other kvcached engine shares its device with keeps its recent demand mapped.

Empty pages stay mapped for the demand window (``KVCACHED_RECLAIM_DELAY_MS``, 1 s: pages in use within the
last one or two windows) and then go back, so that a neighbour can map them. With no kvcached neighbour on
the device nobody could, and giving them back costs the engine itself: its next burst maps them all again,
on its scheduler's thread (on an H200 serving waves 8 s apart, 36 GiB a wave, 0.34 s of each wave's engine
time). So while no other process holds a kvcached pool on the device, the window is ``KVCACHED_IDLE_HOLD_MS``
(30 s) instead. When another engine appears, the window is the demand window again at once, and what was
held goes back within two such windows; a neighbour that falls short before then gets it at once (the
pressure give-back unmaps every empty page, :class:`kvcached_core.pressure.PressureWatch`).

Neighbours are the processes that publish control segments for the device (what ``kvtop`` lists). Memory
that other programs on the device (not kvcached) would want is not seen: for them the hold is a delay of at
most ``KVCACHED_IDLE_HOLD_MS``; set it to 0 where that matters.
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


class IdleHold:
    """One engine process's side of the policy, for one device; driven by its pressure watch's thread."""

    LOOK_S = 1.0  # a neighbour is seen within this long of its first pool (a directory scan per look)

    def __init__(self, settings: Settings, device: str) -> None:
        self.settings = settings
        self.device = host_device_label(device)
        self.alone: bool | None = None  # unknown until the first look
        self._last_look = 0.0

    def tick(self) -> None:
        """Look for neighbours (at most once per ``LOOK_S``) and set each of this process's pools on the
        device to its window: the longer of its own demand window and the hold while alone, its own after."""
        now = time.monotonic()
        if now - self._last_look < self.LOOK_S:
            return
        self._last_look = now
        me = os.getpid()
        alone = not any(pid != me for pid in held_per_process(self.settings, self.device))
        if alone != self.alone:
            logger.info(
                "kvcached: %s on %s: empty pages stay mapped for %s",
                "no other engine" if alone else "another engine",
                self.device,
                f"{self.settings.idle_hold_ms} ms while it is so" if alone else "the demand window",
            )
        self.alone = alone
        for manager in registry.live_managers():
            if manager.closed or host_device_label(manager.device) != self.device:
                continue
            window = manager.demand_window_ms
            if self.alone:
                window = max(window, self.settings.idle_hold_ms)
            if manager.reclaim_delay_ms != window:
                manager.reclaim_delay_ms = window
