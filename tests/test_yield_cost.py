"""``benchmarks/yield_cost.py``'s decode step, on the real allocator (host backend): the scheduling rule that
its preemption counts rest on."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import yield_cost  # noqa: E402
from elasticity import BLOCK_TOKENS, Request  # noqa: E402

from kvcached_core import KVCacheManager, load_settings  # noqa: E402

PAGE_BLOCKS = 4


@pytest.fixture
def mgr():
    settings = load_settings({}, reclaim_delay_ms=0, reserved_pages=0, control=False)
    m = KVCacheManager(64, 1 << 19, 1, 1, device="cpu", page_bytes=2 << 20, settings=settings)  # 4 blocks a page
    yield m
    m.close()


def test_a_request_refused_a_block_preempts_the_newest_until_it_gets_one(mgr):
    """Under a cap, the oldest request needing a block preempts from the newest end: the newest request goes
    first, whole, and no more than it takes for the block to come; a request that is itself the newest left
    is preempted instead. Finished requests give their blocks back."""
    pages = [mgr.alloc(PAGE_BLOCKS) for _ in range(3)]  # three full pages, one request on each
    old = Request(BLOCK_TOKENS, 5, pages[0])  # at a block boundary: needs a block now
    middle = Request(BLOCK_TOKENS + 1, 5, pages[1])
    new = Request(BLOCK_TOKENS + 1, 1, pages[2])
    mgr.yield_cap = 3 * (2 << 20)  # no fourth page: the old request's block must come from a freed one
    running, preempted = yield_cost.decode_step(mgr, [old, middle, new])
    assert preempted == 1 and running == [old, middle]  # the newest went, and that was enough
    assert len(old.blocks) == PAGE_BLOCKS + 1 and old.tokens == BLOCK_TOKENS + 1
    assert mgr.snapshot()["allocated_blocks"] == 2 * PAGE_BLOCKS + 1

    lone = Request(BLOCK_TOKENS, 3, mgr.alloc(PAGE_BLOCKS - 1))  # fills the third page
    running, preempted = yield_cost.decode_step(mgr, [lone])
    assert preempted == 1 and running == []  # itself the newest: preempted, its blocks back
    assert mgr.snapshot()["allocated_blocks"] == 2 * PAGE_BLOCKS + 1
