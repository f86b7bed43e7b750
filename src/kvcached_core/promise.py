"""What an engine's scheduler was last told it can allocate, and the promise that goes with it.

Schedulers count free blocks, then allocate them, and cannot take a refusal in between: vLLM's raises,
SGLang's treats the None as out of memory, and the engine dies. What changes between the two happens off the
scheduler's thread (a ``kvctl limit``, another process taking the device's memory), so a refusal within the
last count is served anyway (:meth:`KVCacheManager.alloc_promised`); beyond it, it stays a refusal, as in the
engine's own pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import KVCacheManager


class SchedulerCount:
    """The last availability a scheduler was told, less the blocks it has taken since."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.counted = 0

    def report(self, available: int) -> int:
        """Record what the scheduler is told is available now (in blocks) and return it."""
        self.counted = available
        return available

    def honour(self, count: int, ids: list[int] | None, on_short: Callable[[], None] | None = None) -> list[int] | None:
        """``ids``, what ``alloc(count)`` gave; when it refused blocks within the count, the blocks served
        anyway (``on_short`` as in :meth:`KVCacheManager.alloc_promised`); None beyond the count. The count
        goes down by what was taken."""
        if ids is None and count <= self.counted:
            ids = self.manager.alloc_promised(count, on_short=on_short)
        if ids is not None:
            self.took(count)
        return ids

    def took(self, count: int) -> None:
        """``count`` blocks were served (by whatever call): the count goes down by them."""
        self.counted = max(0, self.counted - count)
