"""Elastic SGLang token allocators: kvcached decides which pages are handed out and whether they are mapped.

SGLang's allocators keep a tensor of free page ids. Over an elastic pool, that list is replaced by the pool's
kvcached manager (one block per SGLang page): ``alloc`` takes page ids from it (preferring pages already
mapped), frees go back to it (whole pages are unmapped after its delayed, fenced reclaim), and
``available_size()`` says what can really be mapped now (physical memory and ``kvctl limit``). SGLang's own
index arithmetic (``alloc_extend``/``alloc_decode`` kernels) still runs, over exactly the pages taken.

Ids cross between kvcached (host) and SGLang's tensors (device) without waiting for the GPU
(:class:`~kvcached_sglang.device_ids.DeviceIds`), as SGLang's own free lists never do.

A shortage is SGLang's normal ``None``; SGLang decides admission and retraction from ``available_size()``
beforehand and treats a None after that check as fatal, so what the last ``available_size()`` reported is
served even if a ``kvctl limit`` or another process took the memory meanwhile
(:class:`kvcached_core.promise.SchedulerCount`). Over a pool
that is not elastic (a layout kvcached does not cover) every method is SGLang's own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from kvcached_core import KVCacheManager

from .device_ids import DeviceIds


class ElasticAllocatorMixin:
    """The kvcached side shared by both allocators: take and give page ids, report capacity."""

    page_size: int
    device: str
    size: int
    _manager: KVCacheManager | None

    def _bind_manager(self, init: Callable[..., None], args: tuple, kwargs: dict[str, Any]) -> None:
        # Read the pool through SGLang's own signature (``init`` is the bound base __init__), so a moved
        # argument cannot be mistaken for it.
        bound = inspect.signature(init).bind(*args, **kwargs)
        self._manager = getattr(bound.arguments["kvcache"], "kvcached_manager", None)
        self._empty = None
        if self._manager is not None:
            self._ids = DeviceIds(self._manager, bound.arguments["device"])

    @property
    def elastic(self) -> bool:
        """Whether this allocator's pages come from kvcached (False: the pool kept SGLang's buffers)."""
        return self._manager is not None

    def _no_pages(self) -> torch.Tensor:
        if self._empty is None:
            self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        return self._empty

    def _take(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` page ids as a tensor on the pool's device, or None when they cannot be mapped now."""
        return self._ids.take(num_pages) if num_pages > 0 else self._no_pages()

    def _give(self, page_ids: torch.Tensor) -> None:
        self._ids.give(page_ids)

    def when_short(self, make_room: Callable[[int], None]) -> None:
        """``make_room(pages)`` runs between tries while an allocation the scheduler was promised waits for
        memory the device no longer has; what it frees is used."""
        self._ids.make_room = make_room

    def id_traffic(self) -> tuple[int, int]:
        """Since start: page ids reused while on their way back, and allocations that waited for the GPU."""
        return self._ids.reused, self._ids.waits

    def _elastic_available(self) -> int:
        return self._ids.available() * self.page_size

    def logical_available_size(self) -> int:
        """Tokens not held by any request or cache entry, whether or not memory is mapped for them.

        SGLang's idle leak check compares this figure (not the physical ``available_size()``) with its pool
        size: another engine holding memory is not a leak.
        """
        self._ids.settle(wait=True)
        return self.size - self._manager.snapshot()["allocated_blocks"] * self.page_size  # null block not counted

    def _clear_elastic(self) -> None:
        """After SGLang's own ``clear()`` (which resets its free-group state in every release): nothing is
        held in kvcached, and SGLang's free list stays empty (kvcached is the free list)."""
        self._ids.forget()  # ids still on their way back are among those clear() frees
        self._manager.clear()
        self.free_pages = self._no_pages()


class ElasticTokenToKVPoolAllocator(ElasticAllocatorMixin, TokenToKVPoolAllocator):
    """``TokenToKVPoolAllocator`` (page_size 1) over an elastic pool: one kvcached block per token slot.

    Replaces ``sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator`` (the patch unit states the
    releases; :class:`ElasticTokenToKVPoolAllocatorFlagGroups` serves the earlier ones).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._bind_manager(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)

    def in_free_group(self) -> bool:
        """Whether frees are being collected (between SGLang's ``free_group_begin`` and ``_end``)."""
        return self.free_group is not None

    def clear(self) -> None:
        """SGLang resets the allocator: every elastic slot goes back to kvcached."""
        super().clear()  # SGLang's group state
        if self.elastic:
            self._clear_elastic()

    def available_size(self) -> int:
        """Token slots the scheduler may plan on: what kvcached can serve now (later allocations are held to
        this count)."""
        return self._elastic_available() if self.elastic else super().available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token slots from kvcached, or None when they cannot be served."""
        return self._take(need_size) if self.elastic else super().alloc(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        """Gives slots back to kvcached, or collects them while a free group is open."""
        if not self.elastic:
            return super().free(free_index)
        if free_index.numel() == 0:
            return
        if self.in_free_group():
            self.free_group.append(free_index.clone())  # the caller may reuse its tensor before the group ends
        else:
            self._give(free_index)

    def merge_and_sort_free(self) -> None:
        """Nothing to merge when elastic: kvcached keeps the free list."""
        if not self.elastic:
            super().merge_and_sort_free()


class ElasticTokenToKVPoolAllocatorFlagGroups(ElasticTokenToKVPoolAllocator):
    """:class:`ElasticTokenToKVPoolAllocator` for SGLang 0.5.16 to 0.5.18, where a free group is marked by
    ``is_not_in_free_group`` (``free_group`` is always a list there)."""

    def in_free_group(self) -> bool:
        """Whether frees are being collected (``is_not_in_free_group`` is false)."""
        return not self.is_not_in_free_group


class ElasticPagedTokenToKVPoolAllocator(ElasticAllocatorMixin, PagedTokenToKVPoolAllocator):
    """``PagedTokenToKVPoolAllocator`` over an elastic pool: one kvcached block per SGLang page.

    Replaces ``sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator`` (the patch unit states the
    releases; :class:`ElasticPagedTokenToKVPoolAllocatorInlineFree` serves the earlier ones). The exact
    number of new pages is computed first (from the CPU lengths SGLang passes), exactly that many are taken,
    and SGLang's own ``alloc``/``alloc_extend``/``alloc_decode`` lay the token indices out over them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._bind_manager(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)

    def clear(self) -> None:
        """SGLang resets the allocator: every elastic page goes back to kvcached."""
        super().clear()  # SGLang's group and staging state
        if self.elastic:
            self._clear_elastic()

    def available_size(self) -> int:
        """Tokens the scheduler may plan on, in whole pages (what kvcached can serve now)."""
        return self._elastic_available() if self.elastic else super().available_size()

    def _over_pages(self, num_pages: int, run: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """Run SGLang's own allocation over exactly ``num_pages`` pages taken from kvcached."""
        pages = self._take(num_pages)
        if pages is None:
            return None
        self.free_pages = pages
        try:
            out = run()
        except BaseException:
            self.free_pages = self._no_pages()
            self._give(pages)
            raise
        unused, self.free_pages = self.free_pages, self._no_pages()
        # SGLang consumes exactly the pages it counted; anything else goes back.
        self._give(pages if out is None else unused)
        return out

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` tokens over exactly the pages they need, taken from kvcached; None when short."""
        if not self.elastic:
            return super().alloc(need_size)
        parent = super()
        return self._over_pages(need_size // self.page_size, lambda: parent.alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        """Prefill: the pages SGLang counted (from the CPU lengths) taken from kvcached, laid out by SGLang."""
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if not self.elastic:
            return super().alloc_extend(*args, num_new_pages=num_new_pages, **kwargs)
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        parent = super()
        return self._over_pages(
            num_new_pages, lambda: parent.alloc_extend(*args, num_new_pages=num_new_pages, **kwargs)
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | None:
        """Decode: the pages the step needs taken from kvcached, laid out by SGLang."""
        if not self.elastic:
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc, **kwargs)
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        parent = super()
        return self._over_pages(num_new_pages, lambda: parent.alloc_decode(seq_lens, seq_lens_cpu, last_loc, **kwargs))

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # Every paged free ends here (free, free_segment, free_page_ids, free_group_end, the radix cache).
        if not self.elastic:
            return super()._release_page_ids(*page_ids)
        for ids in page_ids:
            self._give(ids)

    def merge_and_sort_free(self) -> None:
        """Nothing to merge when elastic: kvcached keeps the free list."""
        if not self.elastic:
            super().merge_and_sort_free()


class ElasticPagedTokenToKVPoolAllocatorInlineFree(ElasticPagedTokenToKVPoolAllocator):
    """:class:`ElasticPagedTokenToKVPoolAllocator` for SGLang 0.5.16, whose ``free`` puts the pages back itself
    (no ``_release_page_ids`` yet); every paged free, group ends included, goes through it."""

    def free(self, free_index: torch.Tensor) -> None:
        """Gives the pages of these tokens back to kvcached, or collects them while a free group is open."""
        if not self.elastic:
            return super().free(free_index)
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            self._give(torch.unique(free_index // self.page_size))
        else:
            self.free_group.append(free_index.clone())


class ElasticMambaSlotAllocator(MambaSlotAllocator):
    """SGLang's Mamba slot allocator over an elastic Mamba pool: slots come from the pool's kvcached manager.

    Installed in place of ``HybridReqToTokenPool.mamba_allocator`` right after SGLang builds it (SGLang
    constructs it without the pool). Slots are per request and few, so the held set is kept too: it gives
    SGLang's diagnostics their ``free_slots`` and the idle check its logical free count.
    """

    def __init__(self, manager: KVCacheManager, size: int, device: str) -> None:
        self._manager = manager
        self._ids = DeviceIds(manager, device, track_held=True)
        super().__init__(size=size, device=device)

    elastic = True

    def available_size(self) -> int:
        """Slots the scheduler may plan on (what kvcached can serve now)."""
        return self._ids.available()

    def logical_available_size(self) -> int:
        """Slots no request or cache entry holds, mapped or not."""
        self._ids.settle(wait=True)
        return self.size - len(self._ids.held)

    @property
    def free_slots(self) -> torch.Tensor:
        """The slots no request holds, as SGLang's diagnostics read them."""
        self._ids.settle(wait=True)
        free = sorted(set(range(1, self.size + 1)) - self._ids.held)
        return torch.tensor(free, dtype=torch.int64, device=self.device)

    @free_slots.setter
    def free_slots(self, _value: torch.Tensor) -> None:
        pass  # SGLang's clear() assigns the full range: the manager is the free list here

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        return self._ids.take(need_size)

    def when_short(self, make_room: Callable[[int], None]) -> None:
        """As :meth:`ElasticAllocatorMixin.when_short`, for slots."""
        self._ids.make_room = make_room

    def free(self, free_index: torch.Tensor) -> None:
        """Gives these slots back to kvcached."""
        self._ids.give(free_index)

    def clear(self) -> None:
        """SGLang resets the allocator: every held slot goes back to kvcached."""
        super().clear()
        self._ids.forget()
        self._manager.clear()


def use_elastic_mamba_allocator(_result: Any, req_pool: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``HybridReqToTokenPool._init_mamba_pool``: over an elastic Mamba pool, slots come from kvcached."""
    pool = req_pool.mamba_pool
    manager = getattr(pool, "kvcached_manager", None)
    if manager is not None:
        req_pool.mamba_allocator = ElasticMambaSlotAllocator(manager, size=pool.size, device=pool.device)
