"""Random alloc/free/limit/trim sequences against a plain Python model of the allocator (hypothesis)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings as hyp_settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcached_core as kc

BLOCK = 48 * 1024  # does not divide the 2 MiB page: some blocks straddle and must never appear
PAGE = 2 * 1024 * 1024
NUM_BLOCKS = 300
USABLE = {b for b in range(NUM_BLOCKS) if (b * BLOCK) // PAGE == ((b + 1) * BLOCK - 1) // PAGE}
LOGICAL_PAGE = PAGE * 2  # one layer, K and V


class AllocatorModel(RuleBasedStateMachine):
    AHEAD = 0  # map_ahead_pages

    def __init__(self) -> None:
        super().__init__()
        s = kc.load_settings({}, reclaim_delay_ms=0)
        self.mgr = kc.KVCacheManager(
            NUM_BLOCKS, BLOCK, 1, 2, device="cpu", settings=s, reserved_pages=1, map_ahead_pages=self.AHEAD
        )
        self.held: set[int] = set()
        self.limit: int | None = None

    def used_pages(self) -> int:
        return len({(b * BLOCK) // PAGE for b in self.held})

    @rule(count=st.integers(min_value=1, max_value=80))
    def alloc(self, count: int) -> None:
        before = self.mgr.snapshot()["allocated_blocks"]
        ids = self.mgr.alloc(count)
        if ids is None:
            assert self.mgr.snapshot()["allocated_blocks"] == before  # a miss changes nothing
            fits_virtually = count <= len(USABLE) - len(self.held)
            assert not fits_virtually or self.limit is not None, "miss without a limit or full capacity"
            return
        assert len(ids) == count == len(set(ids))
        assert not set(ids) & self.held, "handed out a block that is still allocated"
        assert set(ids) <= USABLE, "handed out a block that straddles a page"
        self.held |= set(ids)
        if self.limit is not None:  # a successful alloc never takes pages in use past the cap
            assert self.used_pages() * LOGICAL_PAGE <= self.limit

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=60, unique=True))
        self.mgr.free(victims)
        self.held -= set(victims)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def bad_free_changes_nothing(self, data: st.DataObject) -> None:
        good = data.draw(st.sampled_from(sorted(self.held)))
        bad = data.draw(st.sampled_from(sorted(set(range(-2, NUM_BLOCKS + 2)) - self.held)))
        try:
            self.mgr.free([good, bad])
        except ValueError:
            pass
        else:
            raise AssertionError(f"free of unallocated id {bad} did not raise")
        assert self.mgr.snapshot()["allocated_blocks"] == len(self.held)

    @rule(pages=st.one_of(st.none(), st.integers(min_value=0, max_value=12)))
    def set_limit(self, pages: int | None) -> None:
        self.limit = None if pages is None else pages * LOGICAL_PAGE
        status = self.mgr.set_memory_limit(self.limit)["status"]
        expect_deferred = self.limit is not None and self.used_pages() * LOGICAL_PAGE > self.limit
        assert status == ("deferred" if expect_deferred else "applied")

    @rule()
    def trim(self) -> None:
        self.mgr.trim()
        assert self.mgr.snapshot()["mapped_pages"] == self.used_pages()

    @invariant()
    def bookkeeping_matches_the_model(self) -> None:
        snap = self.mgr.snapshot()
        assert snap["allocated_blocks"] == len(self.held)
        assert snap["used_pages"] == self.used_pages()
        assert snap["mapped_pages"] >= snap["used_pages"]
        assert 0 <= self.mgr.available_size() <= len(USABLE) - len(self.held)
        if self.limit is not None and snap["used_pages"] * LOGICAL_PAGE > self.limit:
            assert self.mgr.available_size() == 0  # deferred shrink: allocation stops

    def teardown(self) -> None:
        self.mgr.close()


AllocatorModel.TestCase.settings = hyp_settings(max_examples=60, stateful_step_count=40, deadline=None)
TestAllocatorModel = AllocatorModel.TestCase


class AllocatorModelMappingAhead(AllocatorModel):
    """The same sequences with a background thread mapping two pages ahead of every allocation: its pages
    in flight never make an allocation miss, hand out a block twice or pass the limit."""

    AHEAD = 2

    @rule()
    def trim(self) -> None:
        self.mgr.trim()  # pages may be mapped ahead again right after it, never more than AHEAD
        assert self.used_pages() <= self.mgr.snapshot()["mapped_pages"] <= self.used_pages() + self.AHEAD


AllocatorModelMappingAhead.TestCase.settings = AllocatorModel.TestCase.settings
TestAllocatorModelMappingAhead = AllocatorModelMappingAhead.TestCase
