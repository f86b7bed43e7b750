"""Fair share under pressure: when another engine on the device falls short of memory, an engine that holds
more than an equal share of the device's KV memory yields down to that share, and keeps to it while the
short engine may still need it.

Without it, a busy engine keeps every page it mapped in its burst, and a neighbour whose burst comes next
waits for that engine's requests to finish (seen on an H200 with three engines: one held 101 GiB while a
neighbour had 0.5 GiB and a queue of 316 requests). Static partitioning never lets that happen; elastic
memory should not either, while still lending an idle neighbour's share to whoever is busy.

The share is the device's KV memory divided by the number of engines: what every kvcached engine on the
device holds (mapped pages and ready handles, read from the control segments) plus what is spare. An
engine above the share caps each of its pools on the device, in proportion to what each holds, at one of
two strengths (below). Under the stronger one (``BlockAllocator.yield_cap``) its scheduler sees no free
blocks, admits nothing new and preempts until it is under the cap; the pages above the cap that empties
are unmapped at once and the short engine maps them. Those under the cap stay mapped, even when the
neighbour's shortfall asks for idle pages (``KVCacheManager.trim_to_cap``): they are the engine's own share,
and given away they came back within seconds, with preemptions on both sides. A capped pool does not
report shortfalls of its own (its cap, not the device, stops it), so two engines never trade caps.

The caps follow what the short engines still need, not their signals alone. A short engine stops
signalling once it has enough, while it still needs it: lifting the caps one second after the last shortfall
(the first version) let the capped engines take the memory straight back, a cycle of mass preemptions (6436
in two minutes on an H200 with three engines); raising them into whatever the device left spare (the second
version) counted the memory the yield itself had just freed as unneeded, so the two large engines passed it
back and forth (4500 and 3911 preemptions). Now an engine that fell short holds a claim for ``CLAIM_S``
after its last shortfall: up to an equal share of the device (what the engines hold plus what is spare,
divided by their number) is kept for it. ``LIFT_S`` after the last shortfall, at most once per ``LIFT_S``,
a capped engine may grow into the spare memory beyond those claims (its part of it, one engine's); when no
claim is left, the caps lift. A claimant's share is thus as safe as under a static partition, and what it
does not use is lent to the others.

Yielding has a price: the capped engine preempts, and vLLM recomputes what it preempted on the GPU both
engines share. When a neighbour's requests finish within seconds anyway, waiting for them can be cheaper
than preempting them (two engines on an H200: yielding at the first shortfall cost the busy model 1.28x
its TTFT p50 against static slices, where not yielding gained). So a cap comes in two strengths. With
``KVCACHED_FAIR_SHARE_ADMIT_FIRST``, at a neighbour's first shortfall, an engine whose plugin gates
admissions (``KVCacheManager.gates_admissions``: vLLM's) caps only what new requests may take
(``KVCacheManager.admit_cap``): its queue waits, its running requests go on and give their memory back as
they finish, nothing is recomputed. Once the neighbour has been short for ``KVCACHED_FAIR_SHARE_WAIT_MS``
without a break of more than ``LIFT_S``, the cap holds for every block (``yield_cap``) and the engine
preempts down to it: a short wait is left to the engines' own requests, a long one (a backlogged neighbour
that would hold the memory for minutes) is not. Other engines do nothing until then. (On an H100 with two
overloaded models in vLLM's own layout, stopping admissions freed nothing within a 5 s wait: each 2 GiB
page row held blocks of requests that ran for tens of seconds.)

What an idle engine lends, it gets back only after the wait and the neighbour's yield; when every engine is
overloaded, the requests it could not run meanwhile stay ahead of all its later ones, so it never catches up
(two models on an H100: the lender's TTFT p50 1.21x and 1.10x static's in its bursts after the first, at
static's decode speed). ``KVCACHED_FAIR_SHARE_FLOOR`` keeps part of every share out of lending: no engine
grows into the last ``floor`` of an equal share that a neighbour does not hold, so a neighbour's burst starts
on that much at once. The bursting engine borrows that much less, which is what elasticity gains where the GPU
can serve every burst: the default, 0, lends everything.

Only an engine below its equal share makes a claim. When every engine is backlogged at once, the larger
ones are short too while they hold more than a share; yielding to them moved memory from one overloaded
engine to another and back (three engines bursting together on an H200: 1765 and 1548 preemptions in the
two large engines against 298 and 283 with static slices, the 8B-like model's TTFT p50 1.2x static's).
An engine that already holds a claim keeps it while it signals, whatever it holds.
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

UNBOUNDED = 1 << 62  # spare memory reported this large means no bound is known


class FairShare:
    """One engine process's side of the policy, for one device; driven by its pressure watch's thread."""

    ADMIT, YIELD = "admit", "yield"  # what the caps hold back: new requests only, or every block
    LIFT_S = 1.0  # a short engine signals every 50 ms: a second without a signal means it has what it needs
    CLAIM_S = 30.0  # how long a short engine's share stays kept for it after its last shortfall
    FLOOR_LOOK_S = 0.1  # how often the neighbours' floors are read (the segments of every engine on the device)

    def __init__(self, settings: Settings, device: str) -> None:
        self.settings = settings
        self.device = host_device_label(device)
        self._caps: str | None = None  # None, ADMIT (admit_cap set) or YIELD (admit_cap and yield_cap set)
        self._last_shortfall = 0.0
        self._last_look = 0.0
        self._claims: dict[int, float] = {}  # pid of an engine that fell short -> when it last did
        self._past_wait: set[int] = set()  # claimants short for the wait: their claims cap every block
        self._wait_s = settings.fair_share_wait_ms / 1000
        self._admit_first = settings.fair_share_admit_first
        self._short: dict[int, tuple[float, float]] = {}  # pid -> (start, last signal) of its current shortfall
        self._claim_total: int | None = None  # what the claims cap this process's pools at, together
        self._floor = settings.fair_share_floor  # the part of an equal share every engine keeps free for itself
        self._floor_total: int | None = None  # what the neighbours' floors cap this process's pools at
        self._floor_look = 0.0

    def _my_pools(self) -> list:
        return [m for m in registry.live_managers() if not m.closed and host_device_label(m.device) == self.device]

    def share_bytes(self) -> tuple[int, int, int]:
        """(an equal share of the device's KV memory, what this process holds, how many engines hold memory
        on the device): the share is what the kvcached engines there hold plus what is spare, divided by
        their number."""
        held, share = self._held_and_share(self._my_pools())
        return share, held.get(os.getpid(), 0), len(held)

    def _held_and_share(self, pools: list) -> tuple[dict[int, int], int]:
        """What each engine process on the device holds (by pid), and an equal share (:meth:`share_bytes`)."""
        held = self._held(pools)
        return held, self._share(held, self._spare(pools))

    def _held(self, pools: list) -> dict[int, int]:
        """:func:`held_per_process`, with this process's own holdings read live from ``pools``: its published
        segments lag its frees, and a share computed from them (its old holdings, the spare memory that
        freeing made) would exceed the device."""
        held = held_per_process(self.settings, self.device)
        if pools:
            snaps = [(m, m.snapshot()) for m in pools]
            held[os.getpid()] = sum(
                s["mapped_bytes"] + max(0, s["pool_ready_handles"]) * m.page_bytes for m, s in snaps
            )
        return held

    @staticmethod
    def _spare(pools: list) -> int:
        """Memory of the device no one holds (the least any of ``pools`` sees); 0 when there are no pools or
        the device has no bound (a host without a budget, a planner before its workers report)."""
        spare = min((m.device_spare_bytes() for m in pools), default=0)
        return 0 if spare >= UNBOUNDED else spare

    @staticmethod
    def _share(held: dict[int, int], spare: int) -> int:
        return (sum(held.values()) + spare) // len(held) if held else 0

    def _set_caps(self, total_cap: int | None, pools: list, every_block: bool) -> None:
        """The claims cap ``pools`` at ``total_cap`` together (None: they do not): their admissions, and with
        ``every_block`` every allocation; :meth:`_write_caps` puts it on the pools."""
        self._claim_total = total_cap
        self._write_caps(pools, every_block)

    def _write_caps(self, pools: list, every_block: bool) -> None:
        """Cap ``pools`` together: admissions at the claims' cap (:attr:`KVCacheManager.admit_cap`, under which
        idle pages also stay mapped: the engine's own share), every allocation
        (:attr:`KVCacheManager.yield_cap`) at the lower of the floors' cap and, with ``every_block``, the
        claims'. A claim's cap is split in proportion to what each pool maps (they shrink alike); the floors'
        room above what the pools map is split evenly (a pool that maps nothing yet may still grow). The floors
        only bound growth: an idle engine's empty pages still go to a short neighbour."""
        mapped = {m: m.snapshot()["mapped_bytes"] for m in pools}
        total = sum(mapped.values())

        def shrunk(cap: int | None, pool_mapped: int) -> int | None:
            if cap is None:
                return None
            return pool_mapped * cap // total if total else cap // len(mapped)

        floor = self._floor_total
        for m, pool_mapped in mapped.items():
            claim = shrunk(self._claim_total, pool_mapped)
            if floor is None:
                floor_cap = None
            elif floor >= total:
                floor_cap = pool_mapped + (floor - total) // len(mapped)
            else:
                floor_cap = shrunk(floor, pool_mapped)
            block = [c for c in (claim if every_block else None, floor_cap) if c is not None]
            m.admit_cap, m.yield_cap = claim, min(block, default=None)

    def _short_for(self, pid: int, now: float) -> float:
        """Record a shortfall signal of engine ``pid`` at ``now``; returns how long it has been short without a
        break of more than ``LIFT_S`` (0 at the first signal after a break)."""
        start, last = self._short.get(pid, (now, now))
        if now - last > self.LIFT_S:
            start = now
        self._short = {p: v for p, v in self._short.items() if now - v[1] <= self.CLAIM_S}  # forget old engines
        self._short[pid] = (start, now)
        return now - start

    def on_shortfall(self, pid: int) -> bool:
        """Engine ``pid`` on the device fell short. If it holds less than an equal share (or already holds a
        claim), it holds a claim on one, and this process's pools there are capped at an equal share if it
        holds more than one: at once for admissions where they are gated (``gates_admissions``), for every
        block once ``pid`` has been short for ``KVCACHED_FAIR_SHARE_WAIT_MS`` (at once after that while its
        claim lasts). A shortfall lowers caps, never raises them. Returns whether the pools are capped."""
        now = time.monotonic()
        past_wait = self._short_for(pid, now) >= self._wait_s or pid in self._past_wait
        pools = self._my_pools()
        if not past_wait and not (self._admit_first and any(m.gates_admissions for m in pools)):
            return self._caps is not None  # left to the neighbours' own requests finishing, for now
        held, share = self._held_and_share(pools)
        if pid not in self._claims and held.get(pid, 0) >= share:
            return self._caps is not None  # overloaded, not starved: yielding only moves the overload here
        self._last_shortfall = now
        self._claims[pid] = now
        if past_wait:
            self._past_wait.add(pid)
        mine = held.get(os.getpid(), 0)
        if mine <= share or not any(m.snapshot()["mapped_bytes"] for m in pools):
            return self._caps is not None  # at or under the share: caps set before stay
        every_block = past_wait or self._caps == self.YIELD
        if self._caps is not None and (self._claim_total or 0) <= share:
            if self._caps == self.YIELD or not every_block:
                return True  # raising them is :meth:`tick`'s, once the claims allow it
            self._write_caps(pools, True)  # the neighbour waited long enough: the caps now hold every block
        else:
            self._set_caps(share, pools, every_block)
        caps = self.YIELD if every_block else self.ADMIT
        if caps != self._caps:
            logger.info(
                "kvcached: a neighbour on %s is short of memory; %s down to an equal share (%d MiB of %d)",
                self.device,
                "yielding" if every_block else "admitting no new request until",
                share >> 20,
                mine >> 20,
            )
        self._caps = caps
        return True

    def tick(self) -> None:
        """``LIFT_S`` after the last shortfall and at most once per ``LIFT_S``: lift the caps once no claim is
        left (only the yield caps once no claim past the wait is), or else let them grow into this engine's
        part of the spare memory that the claims leave."""
        now = time.monotonic()
        if self._floor and now - self._floor_look >= self.FLOOR_LOOK_S:
            self._floor_look = now
            self._keep_floors()
        if self._caps is None or now - max(self._last_shortfall, self._last_look) < self.LIFT_S:
            return
        self._last_look = now  # the segments are read once per LIFT_S, not at every watch interval
        pools = self._my_pools()
        held = self._held(pools)
        # A claim ends CLAIM_S after its engine's last shortfall, or with its engine.
        self._claims = {p: t for p, t in self._claims.items() if now - t < self.CLAIM_S and p in held}
        self._past_wait &= self._claims.keys()
        if not pools or not self._claims:
            self._set_caps(None, pools, False)  # the floors' caps, if any, stay
            self._caps = None
            logger.info("kvcached: no engine on %s is short of memory any more; no longer yielding", self.device)
            return
        if self._caps == self.YIELD and not self._past_wait:
            self._write_caps(pools, False)
            self._caps = self.ADMIT
        spare = self._spare(pools)
        share = self._share(held, spare)
        kept = sum(max(0, share - held[p]) for p in self._claims)
        room = spare - kept
        if room < min(m.page_bytes * m.num_buffers for m in pools):
            return  # nothing beyond what the claims keep: the caps hold
        mine = held.get(os.getpid(), 0)
        if mine + room // len(held) > (self._claim_total or 0):
            self._set_caps(mine + room // len(held), pools, self._caps == self.YIELD)

    def _keep_floors(self) -> None:
        """With ``KVCACHED_FAIR_SHARE_FLOOR``: cap this process's pools so that every other engine on the device
        can still map ``floor`` of an equal share, whatever it holds now (an idle engine's floor stays free for
        its next burst), and never below this engine's own floor. No cap while it is alone on the device or
        the device has no known bound."""
        pools = self._my_pools()
        if not pools:
            return
        held = self._held(pools)
        spare = min(m.device_spare_bytes() for m in pools)
        cap = None
        if len(held) > 1 and spare < UNBOUNDED:
            keep = int(self._floor * self._share(held, spare))
            others = sum(max(h, keep) for pid, h in held.items() if pid != os.getpid())
            cap = max(keep, sum(held.values()) + spare - others)
        if cap != self._floor_total:
            self._floor_total = cap
            self._write_caps(pools, self._caps == self.YIELD)
