"""Block allocator semantics on the host backend: real reservations, real mappings, real memory."""

from __future__ import annotations

import array
import time

import pytest
from conftest import wait_for

import kvcached_core as kc

BLOCKS_PER_PAGE = 32  # 64 KiB blocks in 2 MiB pages
LOGICAL_PAGE = 2 * 1024 * 1024 * 4  # 2 layers x K/V: one logical page maps 4 physical pages


def test_alloc_returns_distinct_ids_and_maps_only_what_is_used(make_manager):
    mgr = make_manager()
    assert mgr.snapshot()["mapped_bytes"] == 0  # nothing mapped before the first alloc
    ids = mgr.alloc(40)
    assert len(ids) == 40 and len(set(ids)) == 40
    assert all(0 <= b < 1024 for b in ids)
    snap = mgr.snapshot()
    assert snap["allocated_blocks"] == 40
    assert snap["used_pages"] == 2
    assert snap["mapped_bytes"] == 2 * LOGICAL_PAGE
    assert snap["used_bytes"] == 40 * 64 * 1024 * 4


def test_partially_used_pages_are_filled_before_empty_ones(make_manager):
    mgr = make_manager(reserved_pages=8)
    first = mgr.alloc(BLOCKS_PER_PAGE * 3)  # three full pages
    pages = {b // BLOCKS_PER_PAGE for b in first}
    assert len(pages) == 3
    # Free half of page 1 and all of page 2: page 1 is partial, page 2 empty (but still mapped).
    page1 = [b for b in first if b // BLOCKS_PER_PAGE == sorted(pages)[1]]
    page2 = [b for b in first if b // BLOCKS_PER_PAGE == sorted(pages)[2]]
    mgr.free(page1[:16] + page2)
    again = mgr.alloc(16)
    assert {b // BLOCKS_PER_PAGE for b in again} == {sorted(pages)[1]}
    assert mgr.snapshot()["used_pages"] == 2


def test_a_request_grows_on_the_page_of_its_last_block(make_manager):
    mgr = make_manager(reserved_pages=8)
    a = mgr.alloc(4)  # request A: page 0
    b = mgr.alloc(BLOCKS_PER_PAGE)  # request B: the rest of page 0, then page 1
    mgr.free(b[-2:])  # room on B's last page
    mgr.free(a[2:])  # and on page 0, which a plain alloc fills first
    plain = mgr.alloc(2)
    assert {x // BLOCKS_PER_PAGE for x in plain} == {a[0] // BLOCKS_PER_PAGE}
    mgr.free(plain)
    grown = mgr.alloc_near(2, b[-3])  # B's next blocks go beside its last one
    assert {x // BLOCKS_PER_PAGE for x in grown} == {b[-3] // BLOCKS_PER_PAGE} != {a[0] // BLOCKS_PER_PAGE}
    assert mgr.alloc_near(1, 10_000) is not None  # a hint that is no block is ignored
    mgr.free(a[:2])
    assert mgr.alloc_near(1, a[0]) is not None  # ... and so is a free one
    with pytest.raises(ValueError):
        mgr.alloc_near(0, b[0])


def test_request_placement_takes_pages_of_its_own_before_others_partly_used_ones(make_manager, settings):
    from dataclasses import replace

    mgr = make_manager(reserved_pages=8, settings=replace(settings, block_placement="request"))
    assert mgr.places_by_request
    first = mgr.alloc(4)  # page 0, partly used
    second = mgr.alloc(4)  # a new page, not the rest of page 0
    assert {x // BLOCKS_PER_PAGE for x in first}.isdisjoint({x // BLOCKS_PER_PAGE for x in second})
    mgr.free(second)  # that page is empty again, and reused before page 0's free blocks
    third = mgr.alloc(4)
    assert {x // BLOCKS_PER_PAGE for x in third} == {second[0] // BLOCKS_PER_PAGE}
    # Under a memory limit of what is mapped, others' partly used pages are the fallback.
    mgr.set_memory_limit(mgr.snapshot()["mapped_bytes"])
    used = mgr.snapshot()["used_pages"]
    fallback = mgr.alloc(8)
    assert fallback is not None and mgr.snapshot()["used_pages"] == used
    assert not make_manager(reserved_pages=8).places_by_request  # compact is the default


def test_virtual_capacity_exhaustion_returns_none_and_changes_nothing(make_manager):
    mgr = make_manager(num_blocks=64)
    held = mgr.alloc(60)
    before = mgr.snapshot()
    assert mgr.alloc(5) is None
    assert mgr.snapshot()["allocated_blocks"] == before["allocated_blocks"]
    assert len(mgr.alloc(4)) == 4
    assert mgr.alloc(1) is None
    mgr.free(held)


def test_available_size_matches_what_alloc_serves(make_manager):
    mgr = make_manager(num_blocks=256)
    assert mgr.available_size() == 256
    mgr.alloc(10)
    assert mgr.available_size() == 246
    assert mgr.alloc(mgr.available_size()) is not None
    assert mgr.available_size() == 0
    assert mgr.alloc(1) is None


def test_blocks_that_straddle_pages_are_never_handed_out(make_manager):
    # 48 KiB blocks in 2 MiB pages: 42.67 blocks per page, so one block in every 3 pages straddles.
    block = 48 * 1024
    page = 2 * 1024 * 1024
    mgr = make_manager(num_blocks=512, block_bytes=block, num_layers=1, num_kv_buffers=1)
    ids = mgr.alloc(mgr.available_size())
    assert ids is not None
    for b in ids:
        assert (b * block) // page == ((b + 1) * block - 1) // page, f"block {b} straddles a page"
    straddling = [b for b in range(512) if (b * block) // page != ((b + 1) * block - 1) // page]
    assert straddling and not set(straddling) & set(ids)
    assert mgr.snapshot()["total_blocks"] == 512 - len(straddling)
    # page_of and block_pages say the same: the page a block lies on, -1 where it straddles two.
    pages = [-1 if b in straddling else (b * block) // page for b in range(512)]
    assert [mgr.page_of(b) for b in range(512)] == pages == mgr.block_pages()
    with pytest.raises(ValueError, match=r"block 512 is not in \[0, 512\)"):
        mgr.page_of(512)


def test_double_free_and_foreign_ids_raise_and_change_nothing(make_manager):
    mgr = make_manager()
    ids = mgr.alloc(4)
    mgr.free(ids[:1])
    for bad in ([ids[0]], [ids[1], ids[1]], [ids[2], 5000], [-1], [ids[3], 1023]):
        before = mgr.snapshot()["allocated_blocks"]
        with pytest.raises(ValueError):
            mgr.free(bad)
        assert mgr.snapshot()["allocated_blocks"] == before
    mgr.free(ids[1:])  # the rest are still allocated and free cleanly
    assert mgr.snapshot()["allocated_blocks"] == 0


def test_bad_alloc_counts_and_id_types(make_manager):
    mgr = make_manager()
    for count in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            mgr.alloc(count)
    with pytest.raises(TypeError):
        mgr.alloc(1.5)
    with pytest.raises(TypeError):
        mgr.free(["3"])
    with pytest.raises(TypeError):
        mgr.free(7)
    assert len(mgr.alloc(3)) == 3  # still usable


@pytest.mark.parametrize("typecode", ["q", "i"])
def test_alloc_into_and_free_from_buffers(make_manager, typecode):
    """The list-free pair engines use with tensors (a pinned tensor's ``.numpy()``): same ids, same checks."""
    mgr = make_manager()
    out = array.array(typecode, [-7] * 40)
    assert mgr.alloc_into(32, out) is True
    ids = list(out[:32])
    assert len(set(ids)) == 32 and out[32:].tolist() == [-7] * 8  # only `count` elements written
    assert mgr.snapshot()["allocated_blocks"] == 32
    with pytest.raises(ValueError):  # a duplicate id: nothing freed
        mgr.free_from(array.array(typecode, [ids[0], ids[0]]))
    assert mgr.snapshot()["allocated_blocks"] == 32
    mgr.free_from(array.array(typecode, ids[:16]))
    assert mgr.snapshot()["allocated_blocks"] == 16
    mgr.free(ids[16:])  # interchangeable with the list calls
    assert mgr.snapshot()["allocated_blocks"] == 0


def test_alloc_into_refusals_and_bad_buffers(make_manager):
    mgr = make_manager()
    out = array.array("q", [0] * 4)
    with pytest.raises(ValueError, match="exceeds"):
        mgr.alloc_into(5, out)
    big = array.array("q", [-1] * 2048)
    assert mgr.alloc_into(2048, big) is False and big[0] == -1  # beyond virtual capacity: untouched
    for bad in (array.array("d", [1.0]), array.array("h", [1]), b"12345678", [1, 2]):
        with pytest.raises(TypeError):
            mgr.free_from(bad)
    with pytest.raises(BufferError):
        mgr.alloc_into(1, bytes(8))  # read-only
    assert mgr.snapshot()["allocated_blocks"] == 0


def test_null_block_is_reserved(make_manager):
    mgr = make_manager(reserve_null_block=True, num_blocks=64)
    assert mgr.snapshot()["mapped_bytes"] == LOGICAL_PAGE  # its page is mapped from the start
    ids = mgr.alloc(63)
    assert 0 not in ids and len(ids) == 63
    assert mgr.alloc(1) is None
    with pytest.raises(ValueError, match="null block"):
        mgr.free([0])
    mgr.clear()
    assert mgr.snapshot()["allocated_blocks"] == 0
    assert 0 not in mgr.alloc(63)


def test_freed_pages_beyond_the_reserve_are_unmapped(make_manager):
    mgr = make_manager(reserved_pages=1)
    ids = mgr.alloc(BLOCKS_PER_PAGE * 6)
    assert mgr.snapshot()["mapped_bytes"] == 6 * LOGICAL_PAGE
    mgr.free(ids)
    assert wait_for(lambda: mgr.snapshot()["mapped_bytes"] == LOGICAL_PAGE)
    assert mgr.trim() == LOGICAL_PAGE
    assert mgr.snapshot()["mapped_bytes"] == 0


def test_pages_of_recent_demand_stay_mapped_then_go_after_a_quiet_window(make_manager):
    """A load that falls and rises again within the reclaim window maps nothing anew (a serving engine's
    steady churn); once demand stays lower for a whole window the pages go, and not before."""
    mgr = make_manager(reserved_pages=0, reclaim_delay_ms=200)
    ids = mgr.alloc(BLOCKS_PER_PAGE * 6)
    maps = mgr.operation_snapshot()["page_maps_total"]
    for _ in range(12):  # requests finishing and new ones arriving, for three windows
        mgr.free(ids)
        time.sleep(0.05)
        ids = mgr.alloc(BLOCKS_PER_PAGE * 6)
    assert mgr.operation_snapshot()["page_maps_total"] == maps
    mgr.free(ids)
    quiet = time.monotonic()
    assert wait_for(lambda: mgr.snapshot()["mapped_bytes"] == 0, timeout=5.0)
    assert time.monotonic() - quiet >= 0.18  # kept for at least one window


def test_a_shorter_window_set_while_running_gives_back_what_the_longer_one_kept(make_manager):
    """The demand window can change while the allocator runs (a policy lengthens it while the engine is alone
    on its device): pages a one-minute window keeps go within two windows of a 50 ms one set later, and the
    setter refuses a negative window without changing it."""
    mgr = make_manager(reserved_pages=0, reclaim_delay_ms=60_000)
    assert mgr.reclaim_delay_ms == 60_000
    mgr.free(mgr.alloc(BLOCKS_PER_PAGE * 4))
    time.sleep(0.3)
    assert mgr.snapshot()["mapped_bytes"] == 4 * LOGICAL_PAGE  # the minute's window keeps them
    with pytest.raises(ValueError, match="reclaim_delay_ms must not be negative"):
        mgr.reclaim_delay_ms = -1
    assert mgr.reclaim_delay_ms == 60_000
    mgr.reclaim_delay_ms = 50
    shortened = time.monotonic()
    assert wait_for(lambda: mgr.snapshot()["mapped_bytes"] == 0, timeout=2.0)
    assert time.monotonic() - shortened < 1.0
    # And back: a longer window keeps what is freed next.
    mgr.reclaim_delay_ms = 60_000
    mgr.free(mgr.alloc(BLOCKS_PER_PAGE * 2))
    time.sleep(0.3)
    assert mgr.snapshot()["mapped_bytes"] == 2 * LOGICAL_PAGE


def test_trim_keeps_pages_with_allocated_blocks(make_manager):
    mgr = make_manager(reserved_pages=10, reclaim_delay_ms=10_000)
    ids = mgr.alloc(BLOCKS_PER_PAGE * 3)
    mgr.free(ids[BLOCKS_PER_PAGE:])  # page 0 stays full, pages 1-2 are empty
    assert mgr.trim() == 2 * LOGICAL_PAGE
    snap = mgr.snapshot()
    assert snap["mapped_bytes"] == LOGICAL_PAGE and snap["allocated_blocks"] == BLOCKS_PER_PAGE


def test_trim_can_keep_the_lowest_empty_pages_and_keeps_those_under_a_fair_share_cap(make_manager):
    """``trim(keep_empty_pages)`` unmaps the empty pages above the lowest ``keep_empty_pages``;
    ``trim_to_cap`` keeps as many as fit under fair share's ``admit_cap`` beside the pages in use, and
    without a cap is ``trim``. An engine trimmed to its cap maps exactly its share, and still admits: only
    one above it waits."""
    mgr = make_manager(reserved_pages=10, reclaim_delay_ms=10_000)
    ids = mgr.alloc(BLOCKS_PER_PAGE * 6)
    mgr.free(ids[BLOCKS_PER_PAGE:])  # page 0 in use, pages 1-5 empty
    assert mgr.trim(2) == 3 * LOGICAL_PAGE and mgr.snapshot()["mapped_bytes"] == 3 * LOGICAL_PAGE
    again = mgr.alloc(2 * BLOCKS_PER_PAGE)  # the two kept are the lowest: nothing new is mapped for these
    assert again is not None and mgr.snapshot()["mapped_bytes"] == 3 * LOGICAL_PAGE
    mgr.free(again)
    mgr.admit_cap = 2 * LOGICAL_PAGE  # room for one empty page beside the one in use
    assert mgr.has_idle_pages() and mgr.pages_over_cap() == 0
    assert mgr.trim_to_cap() == LOGICAL_PAGE and mgr.snapshot()["mapped_bytes"] == 2 * LOGICAL_PAGE
    assert not mgr.has_idle_pages()  # the empty page left is under the cap: nothing trim_to_cap gives back
    assert mgr.admits_new_requests()
    more = mgr.alloc(2 * BLOCKS_PER_PAGE)  # three pages in use, one above the cap
    assert more is not None and mgr.pages_over_cap() == 1
    mgr.free(more)
    mgr.admit_cap -= 1
    assert not mgr.admits_new_requests()
    mgr.admit_cap = None
    assert mgr.pages_over_cap() is None and mgr.has_idle_pages()
    assert mgr.trim_to_cap() == 2 * LOGICAL_PAGE and mgr.snapshot()["mapped_bytes"] == LOGICAL_PAGE


def test_memory_limit_bounds_mapping_and_available_size(make_manager):
    mgr = make_manager(reserved_pages=0)
    result = mgr.set_memory_limit(2 * LOGICAL_PAGE)
    assert result["status"] == "applied"
    assert mgr.available_size() == 2 * BLOCKS_PER_PAGE
    ids = mgr.alloc(2 * BLOCKS_PER_PAGE)
    assert ids is not None
    assert mgr.alloc(1) is None
    assert mgr.snapshot()["mapped_bytes"] == 2 * LOGICAL_PAGE
    mgr.set_memory_limit(None)
    assert mgr.alloc(1) is not None


def test_limit_below_use_is_deferred_and_completes_as_blocks_free(make_manager):
    mgr = make_manager(reserved_pages=0)
    ids = mgr.alloc(BLOCKS_PER_PAGE * 4)
    result = mgr.set_memory_limit(2 * LOGICAL_PAGE)
    assert result["status"] == "deferred"
    assert mgr.snapshot()["allocated_blocks"] == BLOCKS_PER_PAGE * 4  # nothing taken back
    assert mgr.alloc(1) is None and mgr.available_size() == 0  # allocation stops
    mgr.free(ids[: BLOCKS_PER_PAGE * 2])
    assert wait_for(lambda: mgr.snapshot()["mapped_bytes"] <= 2 * LOGICAL_PAGE)
    mgr.free(ids[BLOCKS_PER_PAGE * 2 : BLOCKS_PER_PAGE * 3])
    assert mgr.alloc(1) is not None  # under the cap again


def test_limit_revisions(make_manager):
    mgr = make_manager()
    assert mgr.set_memory_limit(LOGICAL_PAGE * 4, revision=5)["status"] == "applied"
    assert mgr.set_memory_limit(LOGICAL_PAGE * 8, revision=4)["status"] == "stale"
    assert mgr.set_memory_limit(LOGICAL_PAGE * 8, revision=5)["status"] == "conflict"
    assert mgr.set_memory_limit(LOGICAL_PAGE * 4, revision=5)["status"] == "applied"  # same value: idempotent
    assert mgr.snapshot()["limit_bytes"] == LOGICAL_PAGE * 4
    assert mgr.set_memory_limit(None)["revision"] == 6
    for bad in (-1, 1.5, "2G", True):
        with pytest.raises(ValueError):
            mgr.set_memory_limit(bad)


def test_clear_frees_everything(make_manager):
    mgr = make_manager()
    mgr.alloc(100)
    mgr.clear()
    assert mgr.snapshot()["allocated_blocks"] == 0
    assert mgr.available_size() == 1024


def test_close_is_idempotent_and_releases_everything(make_manager):
    mgr = make_manager()
    mgr.alloc(100)
    mgr.close()
    mgr.close()
    assert mgr.closed
    assert mgr.snapshot()["mapped_bytes"] == 0
    assert mgr.available_size() == 0
    with pytest.raises(RuntimeError, match="closed"):
        mgr.alloc(1)
    with pytest.raises(RuntimeError, match="closed"):
        mgr.free([1])
    with mgr:  # usable as a context manager; closing again is harmless
        pass


def test_short_last_page_does_not_shrink_reported_availability(make_manager):
    """The pool ends inside its last page (1 block there, 32 on the others): availability stays exact.

    The short page is mapped last, so fresh pages count with the full per-page capacity until it is the
    only one left.
    """
    mgr = make_manager(num_blocks=32 * 4 + 1, block_bytes=64 * 1024, num_layers=1, num_kv_buffers=1, reserved_pages=0)
    assert mgr.available_size() == 129
    mgr.set_memory_limit(2 * mgr.page_bytes)
    assert mgr.available_size() == 64
    ids = mgr.alloc(64)
    assert ids is not None and mgr.alloc(1) is None
    mgr.set_memory_limit(None)
    assert mgr.available_size() == 65
    rest = mgr.alloc(65)
    assert rest is not None and max(rest) == 128  # the tail block, last
    mgr.free(ids)
    mgr.free(rest)
    mgr.trim()
    assert mgr.available_size() == 129


def test_pages_are_mapped_ahead_of_a_growing_load_off_its_path(make_manager):
    """``map_ahead_pages``: an allocation that leaves fewer empty pages mapped than that makes a background
    thread map more, so the load's next allocations take pages already mapped instead of mapping on their own
    path. Nothing is mapped ahead of an engine that has not allocated."""
    mgr = make_manager(reserved_pages=0, map_ahead_pages=2, reclaim_delay_ms=10_000)
    time.sleep(0.2)
    assert mgr.snapshot()["mapped_pages"] == 0
    held = mgr.alloc(BLOCKS_PER_PAGE)  # page 0, mapped on the caller's path
    assert wait_for(lambda: mgr.snapshot()["mapped_pages"] == 3)  # two more behind it
    assert mgr.assured_size() == 2 * BLOCKS_PER_PAGE
    mgr.set_memory_limit(3 * LOGICAL_PAGE)  # nothing more may be mapped, by anyone
    maps = mgr.operation_snapshot()["page_maps_total"]
    more = mgr.alloc(2 * BLOCKS_PER_PAGE)
    assert more is not None and mgr.operation_snapshot()["page_maps_total"] == maps  # served from them
    mgr.free(held + more)


def test_mapping_ahead_stays_within_the_limit_and_goes_back_when_the_load_stops(make_manager):
    """Pages mapped ahead never pass the memory limit, and count as the demand window's: once the engine stops
    allocating they are unmapped like any other empty page (an idle engine keeps nothing ahead)."""
    mgr = make_manager(reserved_pages=0, map_ahead_pages=4, reclaim_delay_ms=200)
    mgr.set_memory_limit(2 * LOGICAL_PAGE)
    held = mgr.alloc(1)
    assert wait_for(lambda: mgr.snapshot()["mapped_pages"] == 2)
    time.sleep(0.3)
    assert mgr.snapshot()["mapped_pages"] == 2  # the limit, not the four asked for
    mgr.free(held)
    assert wait_for(lambda: mgr.snapshot()["mapped_pages"] == 0, timeout=5.0)
    time.sleep(0.5)
    assert mgr.snapshot()["mapped_pages"] == 0  # nothing mapped again while idle


def test_mapping_ahead_stops_quietly_when_the_device_is_full(tmp_path):
    """On a 64 MiB host budget another manager filled, the background thread maps what fits and stops: no
    error recorded, the engine's own allocations refuse as a value, and availability never counts a page
    that cannot be mapped."""
    MiB = 1 << 20
    s = kc.load_settings({}, runtime_dir=str(tmp_path / "rt"), host_device_bytes=64 * MiB)
    kw = dict(device="cpu", settings=s, reserved_pages=0, pool_target=0, pool_max=0)
    other = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="other", **kw)
    mine = kc.KVCacheManager(1024, 64 * 1024, 2, 2, name="mine", map_ahead_pages=8, **kw)
    try:
        assert other.alloc(5 * BLOCKS_PER_PAGE) is not None  # 40 of the 64 MiB: three page rows are left
        held = mine.alloc(1)
        assert wait_for(lambda: mine.snapshot()["mapped_pages"] == 3)
        time.sleep(0.3)
        snap = mine.snapshot()
        assert snap["mapped_pages"] == 3 and mine.operation_snapshot()["last_error_code"] == 0
        assert mine.available_size() == mine.assured_size() == 3 * BLOCKS_PER_PAGE - 1
        assert mine.alloc(3 * BLOCKS_PER_PAGE) is None  # one block more than fits: a refusal, not an error
        assert mine.alloc(3 * BLOCKS_PER_PAGE - 1) is not None
        mine.free(held)
    finally:
        mine.close()
        other.close()


def test_without_a_demand_window_mapping_ahead_stops_at_the_reserve(make_manager):
    """With ``reclaim_delay_ms`` 0 only the reserve stays mapped, so pages are mapped ahead up to the reserve
    and no further: more would be unmapped at once, and mapped again at the next allocation."""
    mgr = make_manager(reserved_pages=1, map_ahead_pages=4, reclaim_delay_ms=0)
    held = mgr.alloc(1)
    assert wait_for(lambda: mgr.snapshot()["mapped_pages"] == 2)
    maps = mgr.operation_snapshot()["page_maps_total"]
    for _ in range(5):
        mgr.free(mgr.alloc(1))
        time.sleep(0.05)
    assert mgr.snapshot()["mapped_pages"] == 2 and mgr.operation_snapshot()["page_maps_total"] == maps
    mgr.free(held)
