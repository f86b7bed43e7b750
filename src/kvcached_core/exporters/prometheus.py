"""Prometheus exporter (``pip install kvcached-core[prometheus]``).

One metric family per operation counter (``kvcached_<name>_total``) and per occupancy gauge
(``kvcached_pool_<name>``), labelled by instance, pool_name and
device, read at scrape time from the live pools of this process (:class:`KvcachedCollector`) or from the
control segments of pools in other processes (:class:`SegmentCollector`). Serve it on a port of your own with
:func:`start_http_server`, or mount it in an engine's registry (the ``kvcached_mount_exporter`` hook does
this for ``kvcached_core.plugins.mount_exporters(registry)``). prometheus_client is imported only when used.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .. import _native, registry
from ..hookspecs import hookimpl

PREFIX = "kvcached_"
GAUGE_PREFIX = "kvcached_pool_"  # occupancy gauges; apart from the counters (allocated_blocks vs _total)
LABELS = ("instance", "pool_name", "device")
GAUGES = {
    "total_blocks": "Blocks the pool can ever hand out",
    "allocated_blocks": "Blocks allocated now",
    "available_blocks": "Blocks alloc() could hand out now",
    "mapped_bytes": "Physical memory mapped by the pool",
    "used_bytes": "Bytes of allocated blocks",
    "limit_bytes": "Memory limit of the pool (absent when unlimited)",
}


def _families(pools: list[tuple[list[str], dict, dict]]) -> Iterator[Any]:
    """Metric families from ``(labels, counters, occupancy)`` per pool."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name in _native.OPERATION_COUNTERS:
        family = CounterMetricFamily(PREFIX + name.removesuffix("_total"), name.replace("_", " "), labels=LABELS)
        for labels, counters, _ in pools:
            family.add_metric(labels, counters[name])
        yield family
    for name, help_text in GAUGES.items():
        family = GaugeMetricFamily(GAUGE_PREFIX + name, help_text, labels=LABELS)
        for labels, _, occupancy in pools:
            if occupancy[name] is not None:
                family.add_metric(labels, occupancy[name])
        yield family


class KvcachedCollector:
    """A prometheus_client collector over this process's live pools."""

    def collect(self) -> Iterator[Any]:
        """One family per counter and gauge over the managers of this process that are still open."""
        pools = [
            ([m.name, m.pool_name, m.device], m.operation_snapshot(), m.snapshot())
            for m in registry.live_managers()
            if not m.closed
        ]
        yield from _families(pools)


class SegmentCollector:
    """A prometheus_client collector over the control segments of live pools in other processes.

    For an engine whose metrics endpoint runs in a process that holds no pool (vLLM's API server, whose
    pools live in EngineCore): counters and occupancy as their owners last published them (every
    ``KVCACHED_WATCH_INTERVAL_MS``). ``engine`` and ``name`` select the pools shown.
    """

    def __init__(self, engine: str | None = None, name: str | None = None, settings: Any = None) -> None:
        self.engine, self.name, self.settings = engine, name, settings

    def collect(self) -> Iterator[Any]:
        """One family per counter and gauge over the live segments of the chosen engine and instance."""
        from .. import control, load_settings

        pools = []
        for seg in control.scan_segments(self.settings or load_settings()).live:
            i = seg.info
            if (self.engine is None or i["engine"] == self.engine) and (self.name is None or i["name"] == self.name):
                pools.append(([i["name"], i["pool_name"], i["device"]], i["counters"], i))
        yield from _families(pools)


def start_http_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serves this process's kvcached metrics on ``addr:port`` in a registry of their own."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import start_http_server as serve

    own = CollectorRegistry()
    own.register(KvcachedCollector())
    return serve(port, addr=addr, registry=own)


@hookimpl
def kvcached_mount_exporter(registry: Any) -> None:  # noqa: F811 - the hook's name is fixed by the spec
    registry.register(KvcachedCollector())
