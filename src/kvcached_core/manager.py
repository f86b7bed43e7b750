"""KVCacheManager: the public face of the native block allocator, plus KV tensor views over its memory."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from . import _native, registry, segment
from .backends import DeviceLike, device_name, get_backend, host_device_label, parse_device, planner_backend
from .config import MAX_COUNT, Settings, load_settings
from .tensors import KVTensorViews
from .units import MAX_BYTES


def _int_in(name: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an int in ``[low, high]``; else ValueError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}")
    return value


def _positive_int(name: str, value: object, high: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be a positive integer of at most {high}, got {value!r}")
    return value


def _label(what: str, value: object, max_bytes: int) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"{what} must be a non-empty printable string, got {value!r}")
    if len(value.encode()) > max_bytes:
        raise ValueError(f"{what} {value!r} is longer than {max_bytes} bytes; pick a shorter one")
    return value


def _engine_label() -> str:
    # Looking at sys.modules imports nothing: the core never imports an engine.
    for engine in ("vllm", "sglang"):
        if engine in sys.modules:
            return engine
    return "python"


# Page sizes the default picks from on CUDA, largest first, and the fewest pages a buffer may be cut into.
CUDA_PAGE_CHOICES = (32 << 20, 16 << 20, 8 << 20, 4 << 20, 2 << 20)
MIN_PAGES_PER_BUFFER = 64


def page_bytes_for(settings: Settings | None = None, *, device: DeviceLike = "cpu", buffer_bytes: int = 0) -> int:
    """The physical page size of a pool whose buffers hold ``buffer_bytes`` each on ``device``.

    ``KVCACHED_PAGE_BYTES`` when set. Otherwise, on CUDA, the largest of 32, 16, 8, 4 and 2 MiB that still
    cuts every buffer into at least 64 pages; elsewhere 2 MiB. Why: the driver charges every map and unmap
    per page whatever its size, so a burst grows ~15x faster with 32 MiB pages than with 2 MiB ones on an
    H200, and serving with 2 MiB pages spends its scheduler's time mapping; but a page is also the unit an
    engine gives back and the least it keeps while idle, and 64 pages a buffer keep that unit within 1/64
    of the pool. An engine that aligns its block count to whole pages asks here and passes the answer on.
    """
    s = settings if settings is not None else load_settings()
    if s.page_bytes:
        return s.page_bytes
    if parse_device(device)[0] == "cuda":
        for page in CUDA_PAGE_CHOICES:
            if buffer_bytes >= MIN_PAGES_PER_BUFFER * page:
                return page
    return _native.DEFAULT_PAGE_BYTES


def instance_name_for(model: str | None, tp_rank: int | None = None) -> str | None:
    """The name kvctl and kvtop show for an engine serving ``model`` (a model name or path): its last path
    component (``org/Model-8B/`` -> ``Model-8B``), with ``-tpN`` for tensor-parallel rank N when an engine
    keeps a pool per rank. None without a model (the manager then names itself ``<engine>-<pid>``)."""
    if not model:
        return None
    name = str(model).rstrip("/").rsplit("/", 1)[-1]
    if tp_rank is not None:
        name += f"-tp{tp_rank}"
    return name[: _native.SEGMENT_TEXT_BYTES["name"]] or None


MAX_BUFFERS = 1 << 16  # layers x K/V buffers: far beyond any model, and a bound on per-buffer bookkeeping


class KVCacheManager(_native.BlockAllocator, KVTensorViews):
    """An elastic KV cache: block ids over virtual memory that is mapped page by page while blocks are used.

    ``alloc(count)``, ``free(ids)`` and ``available_size()`` are native CPython methods (no Python frame
    and no binding dispatcher on the hot path). Memory of a freshly mapped page is not zeroed unless
    ``zero_on_map`` is set.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        num_layers: int,
        num_kv_buffers: int = 2,
        device: DeviceLike = "cpu",
        pool_name: str = "mha",
        name: str | None = None,
        *,
        engine: str | None = None,
        reserve_null_block: bool = False,
        page_bytes: int | None = None,
        reserved_pages: int | None = None,
        map_ahead_pages: int | None = None,
        reclaim_delay_ms: int | None = None,
        pool_target: int | None = None,
        pool_max: int | None = None,
        zero_on_map: bool | None = None,
        mapped_by_workers: bool = False,
        settings: Settings | None = None,
    ) -> None:
        """Reserve address space for ``num_blocks`` blocks of ``block_bytes`` in each of
        ``num_layers * num_kv_buffers`` buffers on ``device``; no physical memory is mapped yet.

        Keyword arguments left as None take their value from ``settings`` (default: the KVCACHED_*
        environment, see the README). Raises ValueError for bad geometry and RuntimeError when the
        device cannot be used.

        With ``mapped_by_workers`` this manager only plans (docs/architecture.md, "Planner and workers"): it
        maps nothing, and publishes the pages it wants mapped in a page table (``page_table_path``) that
        worker processes follow with :class:`kvcached_core.PageMirror`, each on its own device.
        """
        s = settings if settings is not None else load_settings()
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_bytes = _positive_int("block_bytes", block_bytes, MAX_BYTES)
        self.num_layers = _positive_int("num_layers", num_layers, MAX_BUFFERS)
        self.num_kv_buffers = _positive_int("num_kv_buffers", num_kv_buffers, MAX_BUFFERS // self.num_layers)
        text_bytes = _native.SEGMENT_TEXT_BYTES  # what the control segment can hold
        self.pool_name = _label("pool_name", pool_name, text_bytes["pool_name"])
        self.engine = _label("engine", engine if engine else _engine_label(), text_bytes["engine"])
        self.name = _label("name", name if name else f"{self.engine}-{os.getpid()}", text_bytes["name"])
        self.device = device_name(device)
        self._control = None
        self._labels = {"pool_name": self.pool_name, "name": self.name, "device": self.device}
        self.num_buffers = self.num_layers * self.num_kv_buffers
        self.reserve_null_block = bool(reserve_null_block)

        def pick(value: Any, default: Any, name: str, high: int = MAX_COUNT) -> Any:
            return default if value is None else _int_in(name, value, 0, high)

        backend = planner_backend(self.device, s) if mapped_by_workers else get_backend(self.device, s)
        # The configured window; a policy may lengthen the native one while the engine is alone on its device
        # (kvcached_core.idle_hold) and sets it back to this.
        self.demand_window_ms = pick(reclaim_delay_ms, s.reclaim_delay_ms, "reclaim_delay_ms")
        if mapped_by_workers:
            pool_target, pool_max = 0, 0  # a planner's handles are free tokens: nothing to create ahead
        super().__init__(
            backend,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            num_buffers=self.num_buffers,
            page_bytes=pick(page_bytes, self._default_page_bytes(s), "page_bytes", MAX_BYTES),
            reserve_null_block=self.reserve_null_block,
            reserved_pages=pick(reserved_pages, s.reserved_pages, "reserved_pages"),
            reclaim_delay_ms=self.demand_window_ms,
            pool_target=pick(pool_target, s.pool_target, "pool_target"),
            pool_max=pick(pool_max, s.pool_max, "pool_max"),
            zero_on_map=s.zero_on_map if zero_on_map is None else bool(zero_on_map),
            map_ahead_pages=pick(map_ahead_pages, s.map_ahead_pages, "map_ahead_pages"),
            place_by_request=s.block_placement == "request",
        )
        self._backend = backend
        # KVCACHED_BLOCK_PLACEMENT=request: the plugin passes each request's last block to ``alloc_near``.
        self.places_by_request = s.block_placement == "request"
        # Whether this pool's plugin checks fair share's admission cap (the native ``admit_cap``, set by
        # kvcached_core.fair_share) before admitting a request.
        self.gates_admissions = False
        # The hot calls as plain CPython methods (see csrc/bindings/fast_path.h): no pybind11 dispatch.
        self._snapshot_labels = dict(
            self._labels, block_bytes=self.block_bytes, page_bytes=self.page_bytes, num_buffers=self.num_buffers
        )
        fast = self._fast_path()
        self.alloc = fast.alloc
        self.alloc_near = fast.alloc_near
        self.free = fast.free
        self.available_size = fast.available_size
        self.alloc_into = fast.alloc_into
        self.free_from = fast.free_from
        self._page_table = None
        try:
            if mapped_by_workers:
                self._page_table = self._open_page_table(s)
            if s.control:
                self._control = self._open_control_segment(s, backend.mem_info()[1], s.watch_interval_ms)
        except BaseException:
            self.close()  # nothing half-built stays behind: memory, page table, segment
            raise
        registry.register(self)

    def _default_page_bytes(self, settings: Settings) -> int:
        """:func:`page_bytes_for` this pool; 0 (the native default: the smallest granule above a block) when
        the chosen size is smaller than a block and no size was set."""
        page = page_bytes_for(settings, device=self.device, buffer_bytes=self.num_blocks * self.block_bytes)
        return page if settings.page_bytes or page >= self.block_bytes else 0

    def _open_page_table(self, settings: Settings) -> _native.PageTable:
        directory = segment.page_table_dir(settings)
        path = os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:12]}{segment.PAGE_TABLE_SUFFIX}")
        return self._publish_page_table(path, self.num_layers, self.num_kv_buffers)

    @property
    def page_table_path(self) -> str | None:
        """Where workers find this planner's page table (None unless ``mapped_by_workers``)."""
        return None if self._page_table is None else self._page_table.path

    def _open_control_segment(self, settings: Settings, device_total: int, poll_ms: int) -> _native.ControlSegment:
        directory = segment.segment_dir(settings)
        segment.collect(directory, self.name, self.pool_name)  # take over from a dead namesake
        return _native.ControlSegment(
            segment.new_segment_path(directory),
            self,
            engine=self.engine,
            device=host_device_label(self.device),
            name=self.name,
            pool_name=self.pool_name,
            device_total_bytes=device_total,
            poll_ms=poll_ms,
        )

    # -- hot path: __init__ shadows these with the native methods; they document the API and serve
    # -- unbound calls such as KVCacheManager.alloc(mgr, 4).

    def alloc(self, count: int) -> list[int] | None:
        """``count`` distinct block ids, or None when virtual capacity, physical memory or the memory limit
        cannot serve them now. ValueError for ``count <= 0``."""
        return self._fast_path().alloc(count)

    def alloc_near(self, count: int, near: int) -> list[int] | None:
        """:meth:`alloc` for a request whose last block is ``near``: the free blocks on that block's page come
        first, so a request grows on its own page (an id not allocated is ignored). Where the rest go is
        ``KVCACHED_BLOCK_PLACEMENT``'s."""
        return self._fast_path().alloc_near(count, near)

    def free(self, ids: Sequence[int]) -> None:
        """Free block ids. ValueError (and nothing freed) on an unknown, reserved or duplicate id."""
        self._fast_path().free(ids)

    def alloc_into(self, count: int, out: Any) -> bool:
        """:meth:`alloc` with the ids written into the first ``count`` elements of ``out`` (a writable
        one-dimensional int32/int64 buffer, e.g. a pinned tensor's ``.numpy()``) instead of a new list: no
        Python int per block. False, ``out`` untouched, when :meth:`alloc` would return None."""
        return self._fast_path().alloc_into(count, out)

    def free_from(self, ids: Any) -> None:
        """:meth:`free` of the ids in a one-dimensional int32/int64 buffer (a CPU tensor's ``.numpy()``)."""
        self._fast_path().free_from(ids)

    def available_size(self) -> int:
        """Blocks ``alloc`` could hand out now (a lower bound; lock-free, never calls the driver)."""
        return self._fast_path().available_size()

    def alloc_promised(self, count: int, wait_s: float = 5.0, on_short: Callable[[], None] | None = None) -> list[int]:
        """``count`` blocks that an engine already promised its scheduler (it counted them as available and
        cannot take a refusal now), for when :meth:`alloc` refused them: what changed since the count
        happened off the scheduler's thread. A lower memory limit is passed for this call (the next
        availability count reports what the limit leaves, so the engine backs off under it); physical memory
        another process took meanwhile is waited for, ``on_short()`` being called between tries (e.g. to
        ask other engines to give memory back). Raises RuntimeError naming the fix after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while (ids := self.alloc_past_limit(count)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvcached: {count} blocks that {self.name} counted as available could not be mapped within "
                    f"{wait_s:g} s: other processes hold the device's memory; cap them (kvctl limit) or give "
                    "this engine a smaller KV cache"
                )
            if on_short is not None:
                on_short()
            time.sleep(0.005)
        return ids

    def _cap_pages(self) -> int | None:
        """Fair share's cap (:attr:`admit_cap`) in pages, None while no cap is set."""
        cap = self.admit_cap
        return None if cap is None else cap // (self.page_bytes * self.num_buffers)

    def has_idle_pages(self) -> bool:
        """Whether pages that hold no allocated block are mapped (kept for the recent demand, for up to two
        demand windows: ``KVCACHED_RECLAIM_DELAY_MS``, or ``KVCACHED_IDLE_HOLD_MS`` while no other engine shares
        the device) beyond those :meth:`trim_to_cap` keeps: memory it would give back now."""
        snap = self._snapshot()
        return snap["mapped_pages"] > max(snap["used_pages"], self._cap_pages() or 0)

    def trim_to_cap(self) -> int:
        """:meth:`trim`, except that while fair share caps this pool (:attr:`admit_cap`) the empty pages under
        the cap stay mapped: they are this engine's own share, which it refills as it admits again. Given
        back, a neighbour took them and then had to yield them back within seconds, preempting (an H100 with
        two engines). Returns the bytes unmapped."""
        cap_pages = self._cap_pages()
        if cap_pages is None:
            return self.trim()
        return self.trim(max(0, cap_pages - self._snapshot()["used_pages"]))

    def pages_over_cap(self) -> int | None:
        """Pages in use above fair share's cap (None while no cap is set). While capped, :meth:`trim_to_cap`
        keeps the empty pages under the cap mapped, so freeing cached blocks (a plugin's prefix cache) gives a
        neighbour memory from at most this many pages; freeing more only loses the cache."""
        cap_pages = self._cap_pages()
        return None if cap_pages is None else max(0, self._snapshot()["used_pages"] - cap_pages)

    def admits_new_requests(self) -> bool:
        """Whether a new request may take blocks now: fair share has set no admission cap
        (:attr:`admit_cap`), or this pool maps no more than it (a pool trimmed to its cap holds exactly its
        share, and admits into it). For plugins that set :attr:`gates_admissions`."""
        cap = self.admit_cap
        return cap is None or self._snapshot()["mapped_bytes"] <= cap

    def device_spare_bytes(self) -> int:
        """Memory of this manager's device that no one holds, above the headroom KV caches leave free (for a
        planner: the least its workers report; for a host without a budget: unbounded): what an engine on the
        device could map now."""
        return self._backend.allocatable_bytes()

    def physically_short(self) -> bool:
        """Whether what the device lets this manager map now, not its memory limit or its virtual capacity,
        is what stops it from handing out one more page of blocks: when that is so, other engines on the
        device giving memory back would help (:class:`kvcached_core.pressure.PressureWatch`)."""
        snap = self.snapshot()
        caps = [c for c in (snap["limit_bytes"], self.yield_cap) if c is not None]
        if caps and snap["mapped_bytes"] + self.page_bytes * self.num_buffers > min(caps):
            return False  # a cap of its own (a limit, or yielding to a neighbour) stops it, not the device
        return snap["allocated_blocks"] + max(1, self.page_bytes // self.block_bytes) < snap["total_blocks"]

    # -- control --------------------------------------------------------------------------------------

    def set_memory_limit(self, limit_bytes: int | None, revision: int | None = None) -> dict:
        """Cap the physical memory this manager may map (``None`` removes the cap).

        Returns a dict whose ``status`` is ``applied``, ``deferred`` (the cap is below what is in use:
        allocation stops until frees bring use under it; no allocated block is taken back), ``stale`` (an
        older ``revision`` than the current one: ignored) or ``conflict`` (same revision, other value:
        ignored). Without ``revision`` the next one is used.
        """
        if limit_bytes is not None:
            _int_in("limit_bytes", limit_bytes, 0, MAX_BYTES)
        if revision is not None:
            _int_in("revision", revision, 0, MAX_BYTES)
        if self._control is not None:  # kvctl sees the outcome, and picks a later revision
            return self._control.set_memory_limit(limit_bytes, revision)
        return self._set_memory_limit(limit_bytes, revision)

    def close(self) -> None:
        """Unmap and release all memory and remove the control segment. Idempotent."""
        if self._control is not None:
            self._control.close()
        super().close()
        if self._page_table is not None:
            self._page_table.unlink()  # workers keep their mappings until they close their mirrors
        registry.unregister(self)

    def operation_snapshot(self) -> dict:
        """Cumulative operation counters (names in ``capabilities()["operation_counters"]``), the last error
        (code, time, message cut to a bound), and the pool's labels. Never takes the allocator lock."""
        ops = super().operation_snapshot()
        ops.update(self._labels)
        return ops

    def snapshot(self) -> dict:
        """Pool occupancy: total/allocated/available blocks, mapped and used bytes, the limit, and labels."""
        snap = self._snapshot()
        snap.update(self._snapshot_labels)
        return snap

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.available_size()} blocks available"
        return (
            f"KVCacheManager(name={self.name!r}, pool_name={self.pool_name!r}, device={self.device!r}, "
            f"num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, {state})"
        )
