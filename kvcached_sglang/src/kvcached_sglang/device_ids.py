"""Block ids between a kvcached manager and tensors on SGLang's device, without ever waiting for the GPU.

SGLang keeps its free lists on the GPU so that its scheduler never waits for the GPU: it prepares the next
batch while the current one runs. kvcached's free list is on the host, so ids must cross; a plain
``torch.tensor(ids, device=...)`` or ``ids.tolist()`` would wait for the stream each time (and turn every id
into a Python int). Here taken ids are written by kvcached straight into a pinned buffer and copied without
a wait; given ids are copied into a pinned buffer behind an event and handed to kvcached once the copy is
done, at the next take or count (counted as available meanwhile). A take that needs ids still on their way
back (a full pool: SGLang evicts cached prefixes and allocates the room at once) reuses them on the GPU,
copied from their pinned buffer behind the copy that fills it, so the scheduler never waits for the GPU
there either: waiting would stall it behind the running forward pass (SGLang orders its stream after the
forward's reads), losing the overlap of scheduling and compute at every eviction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcached_core import KVCacheManager
from kvcached_core.promise import SchedulerCount


@dataclass
class _Returning:
    """Ids given back from the device: copied into ``host`` (pinned) behind ``done``; the first ``start`` of
    them were reused by a take before the copy was handed to kvcached, so they stay allocated there."""

    done: Any  # torch.cuda.Event
    host: torch.Tensor
    start: int = 0


class DeviceIds:
    """Takes ids from ``manager`` as tensors on ``device`` and gives back ids held in tensors there.

    ``track_held`` keeps the set of ids held (for allocators whose diagnostics list free ids).
    """

    def __init__(self, manager: KVCacheManager, device: str, *, track_held: bool = False) -> None:
        self.manager = manager
        self.device = device
        self.count = SchedulerCount(manager)  # what the scheduler was last told is available
        self.held: set[int] | None = set() if track_held else None
        self._cuda = torch.device(device).type == "cuda"
        self._freeing: deque[_Returning] = deque()
        self.pending = 0  # ids given back whose copy to the host has not been handed to kvcached yet
        self.reused = 0  # ids handed out again while on their way back (counts for tests and logs)
        self.waits = 0  # takes that waited for the GPU to finish copying frees
        # Called with the number of ids while a take the scheduler was promised waits for memory.
        self.make_room: Callable[[int], None] | None = None

    def take(self, n: int) -> torch.Tensor | None:
        """``n`` ids as an int64 tensor on the device, or None when kvcached cannot serve them now (and the
        scheduler was not promised them: :class:`SchedulerCount`)."""
        self.settle()
        host = torch.empty(n, dtype=torch.int64, pin_memory=self._cuda)
        served = self.manager.alloc_into(n, host.numpy())
        if not served and self._freeing:  # what it needs is in frees still on their way
            if self.held is None and n <= self.pending + self.manager.available_size():
                out = self._take_returning(n, host)
                if out is not None:
                    return out
            self.waits += 1
            self.settle(wait=True)
            served = self.manager.alloc_into(n, host.numpy())
        if served:
            self.count.took(n)
        else:
            ids = self.count.honour(n, None, on_short=self._on_short(n))
            if ids is None:
                return None
            host.copy_(torch.tensor(ids, dtype=torch.int64))
        if self.held is not None:
            self.held.update(host.tolist())  # host memory: no wait
        return host.to(self.device, non_blocking=True) if self._cuda else host

    def give(self, ids: torch.Tensor) -> None:
        """Give back the ids in ``ids`` (any shape, int32 or int64, on the device or the host)."""
        if not ids.numel():
            return
        flat = ids.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.to(torch.int64)
        if not flat.is_cuda:
            self._free(flat.contiguous())
            return
        host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._freeing.append(_Returning(done, host))
        self.pending += host.numel()

    def settle(self, wait: bool = False) -> None:
        """Hand kvcached the given ids whose copy to the host is done (``wait``: all of them)."""
        while self._freeing:
            returning = self._freeing[0]
            if not wait and not returning.done.query():
                return
            returning.done.synchronize()
            self._freeing.popleft()
            rest = returning.host[returning.start :]
            self.pending -= rest.numel()
            self._free(rest)

    def _take_returning(self, n: int, host: torch.Tensor) -> torch.Tensor | None:
        """``n`` ids on the device: what kvcached serves now, the rest reused from frees still on their way
        (oldest first), without waiting for the GPU; None when kvcached served less than it counted."""
        fresh = max(0, n - self.pending)
        if fresh and not self.manager.alloc_into(fresh, host.numpy()):
            return None  # another process took the memory since the count: the waiting path decides
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        if fresh:
            out[:fresh].copy_(host[:fresh], non_blocking=True)
        stream, filled = torch.cuda.current_stream(), fresh
        while filled < n:
            returning = self._freeing[0]
            use = min(n - filled, returning.host.numel() - returning.start)
            stream.wait_event(returning.done)  # a give on another stream: its copy into host comes first
            # Same dtype as the pinned buffer (a plain copy, ordered after the one filling it on the GPU),
            # then widened on the device: a dtype change across devices would read the buffer now, on the host.
            part = returning.host[returning.start : returning.start + use].to(self.device, non_blocking=True)
            out[filled : filled + use].copy_(part)
            returning.start += use
            if returning.start == returning.host.numel():
                self._freeing.popleft()  # the allocator keeps the buffer until the copies reading it ran
            self.pending -= use
            filled += use
        self.reused += n - fresh
        self.count.took(n)
        return out

    def available(self) -> int:
        """Ids the scheduler may plan on: what kvcached can serve now plus what is on its way back (recorded
        as the scheduler's count)."""
        self.settle()
        return self.count.report(self.manager.available_size() + self.pending)

    def _on_short(self, n: int) -> Callable[[], None] | None:
        if self.make_room is None:
            return None
        make_room = self.make_room

        def on_short() -> None:
            make_room(n)
            self.settle(wait=True)  # what it freed reaches kvcached before the next try

        return on_short

    def forget(self) -> None:
        """After the manager's ``clear()``: nothing is held, and gives still on their way are void."""
        self._freeing.clear()
        self.pending = 0
        if self.held is not None:
            self.held.clear()

    def _free(self, host: torch.Tensor) -> None:
        self.manager.free_from(host.numpy())
        if self.held is not None:
            self.held.difference_update(host.tolist())
