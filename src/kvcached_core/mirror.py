"""PageMirror: a worker process's view of a planner's pages (docs/architecture.md, "Planner and workers").

The scheduler process owns a ``KVCacheManager(..., mapped_by_workers=True)``: it decides which blocks are
used at bookkeeping cost and publishes which pages must be mapped. Each worker process opens a PageMirror
on that page table with its own device and calls :meth:`PageMirror.sync` at the start of every step; the
KV tensors it hands to the model are the mirror's. Nothing crosses processes but the shared bitmap.
"""

from __future__ import annotations

from . import _native
from .backends import DeviceLike, device_name, get_backend
from .config import Settings, load_settings
from .tensors import KVTensorViews


class PageMirror(_native.PageMirror, KVTensorViews):
    """A worker's mappings of the pages a planner wants mapped, on this worker's ``device``."""

    def __init__(
        self,
        page_table_path: str,
        device: DeviceLike = "cpu",
        *,
        pool_target: int | None = None,
        pool_max: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        """Opens the planner's page table and reserves this worker's buffers; maps nothing until sync().

        Raises SegmentError for a file that is not a page table of this user and version, and
        ValueError when the planner's page size does not suit this device.
        """
        s = settings if settings is not None else load_settings()
        self.device = device_name(device)
        _native.PageMirror.__init__(
            self,
            page_table_path,
            get_backend(self.device, s),
            pool_target=s.pool_target if pool_target is None else pool_target,
            pool_max=s.pool_max if pool_max is None else pool_max,
        )
        g = self.geometry
        self.num_blocks = g["num_blocks"]
        self.block_bytes = g["block_bytes"]
        self.num_layers = g["num_layers"]
        self.num_kv_buffers = g["num_kv_buffers"]
        self.page_bytes = g["page_bytes"]

    def sync(self) -> dict:
        """Maps the pages the planner wants and unmaps (after a fence) those it gave up.

        Call at the start of each step, before the step touches its blocks. Returns ``mapped``,
        ``unmapped`` (pages this call changed) and the bitmap ``generation`` it applied. Raises
        BackendError when this device has no memory left for a planned page.
        """
        return super().sync()

    def __enter__(self) -> PageMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
