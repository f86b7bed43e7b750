"""Operation counters, the last error, snapshots under load, the pool registry, hooks and Prometheus."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from conftest import wait_for

import kvcached_core as kc
from kvcached_core import _native, registry
from kvcached_core.backends import get_backend
from kvcached_core.hookspecs import hookimpl
from kvcached_core.plugins import get_plugin_manager, mount_exporters

PER_PAGE = 32  # 64 KiB blocks in 2 MiB pages
BUFFERS = 4  # 2 layers x K/V


def counters(mgr) -> dict:
    ops = mgr.operation_snapshot()
    return {name: ops[name] for name in _native.OPERATION_COUNTERS}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_capabilities_list_the_counters_of_the_snapshot():
    names = kc.capabilities()["operation_counters"]
    assert names == list(_native.OPERATION_COUNTERS)
    for required in (
        "allocation_requests_total",
        "allocation_successes_total",
        "allocation_failures_total",
        "capacity_exhausted_total",
        "allocated_blocks_total",
        "freed_blocks_total",
        "free_requests_total",
        "manager_page_allocations_total",
        "manager_page_releases_total",
        "page_maps_total",
        "page_unmaps_total",
        "resize_requests_total",
        "resize_errors_total",
    ):
        assert required in names


def test_success_free_and_page_counters(make_manager):
    mgr = make_manager(reserved_pages=0)
    before = counters(mgr)
    ids = mgr.alloc(PER_PAGE + 1)  # two logical pages
    mgr.free(ids)
    mgr.trim()
    assert delta(before, counters(mgr)) == {
        "allocation_requests_total": 1,
        "allocation_successes_total": 1,
        "allocated_blocks_total": PER_PAGE + 1,
        "free_requests_total": 1,
        "freed_blocks_total": PER_PAGE + 1,
        "manager_page_allocations_total": 2,
        "manager_page_releases_total": 2,
        "page_maps_total": 2 * BUFFERS,
        "page_unmaps_total": 2 * BUFFERS,
    }


def test_capacity_rejection_and_rollback_inflate_nothing(make_manager):
    mgr = make_manager(reserved_pages=4, reclaim_delay_ms=10_000)
    mgr.set_memory_limit(2 * BUFFERS * 2 * 1024 * 1024)  # two logical pages
    before = counters(mgr)
    assert mgr.alloc(3 * PER_PAGE) is None  # maps two pages, then the limit stops it: rolled back
    d = delta(before, counters(mgr))
    assert d == {
        "allocation_requests_total": 1,
        "allocation_failures_total": 1,
        "capacity_exhausted_total": 1,
        "manager_page_allocations_total": 2,  # real handoffs: the pages stay mapped for reuse
        "page_maps_total": 2 * BUFFERS,
    }
    assert mgr.snapshot()["allocated_blocks"] == 0
    assert delta(before, counters(mgr)).get("allocated_blocks_total", 0) == 0


def test_mapping_error_raises_is_counted_apart_and_recorded(make_manager, settings):
    mgr = make_manager(reserved_pages=0)
    backend = get_backend("cpu", settings)
    before = counters(mgr)
    backend._fail_map_after(3)  # the third physical page of the first logical page fails
    with pytest.raises(kc.BackendError, match="injected map failure"):
        mgr.alloc(1)
    d = delta(before, counters(mgr))
    assert d == {
        "allocation_requests_total": 1,
        "allocation_errors_total": 1,
        "mapping_errors_total": 1,
        "page_maps_total": 2,  # two maps succeeded ...
        "page_unmaps_total": 2,  # ... and were undone: nothing half-mapped
    }
    ops = mgr.operation_snapshot()
    assert ops["last_error_code"] == 5  # EIO
    assert "injected map failure" in ops["last_error_message"]
    assert ops["last_error_time"] > time.time() - 60
    assert mgr.snapshot()["mapped_bytes"] == 0
    assert mgr.alloc(1) is not None  # still usable


def test_freed_blocks_count_even_when_the_page_release_fails(make_manager, settings):
    mgr = make_manager(reserved_pages=0, reclaim_delay_ms=10_000)
    ids = mgr.alloc(4)
    get_backend("cpu", settings)._fail_unmap_after(1)
    mgr.free(ids)
    mgr.trim()  # the release fails for one physical page
    ops = mgr.operation_snapshot()
    assert ops["freed_blocks_total"] == 4 and ops["free_requests_total"] == 1
    assert ops["mapping_errors_total"] == 1
    assert "injected unmap failure" in ops["last_error_message"]


def test_later_error_replaces_an_earlier_one(make_manager, settings):
    mgr = make_manager(reserved_pages=0)
    backend = get_backend("cpu", settings)
    backend._fail_map_after(1)
    with pytest.raises(kc.BackendError):
        mgr.alloc(1)
    first = mgr.operation_snapshot()["last_error_time"]
    ids = mgr.alloc(1)
    mgr.free(ids)
    backend._fail_unmap_after(1)
    mgr.trim()
    ops = mgr.operation_snapshot()
    assert "unmap" in ops["last_error_message"] and ops["last_error_time"] >= first


def test_resize_counters(make_manager):
    mgr = make_manager()
    mgr.set_memory_limit(1 << 30, revision=3)
    mgr.set_memory_limit(1 << 29, revision=2)  # stale
    mgr.set_memory_limit(1 << 29, revision=3)  # conflict
    ops = mgr.operation_snapshot()
    assert ops["resize_requests_total"] == 3 and ops["resize_errors_total"] == 2


def test_collector_at_100hz_sees_monotonic_counters_that_reconcile(make_manager):
    mgr = make_manager(num_blocks=4096, reserved_pages=1, reclaim_delay_ms=1)
    stop = threading.Event()
    errors: list[BaseException] = []
    samples: list[dict] = []

    def collect() -> None:
        while not stop.is_set():
            try:
                samples.append(counters(mgr))
            except BaseException as exc:
                errors.append(exc)
            time.sleep(0.01)

    collector = threading.Thread(target=collect)
    collector.start()
    held: list[list[int]] = []
    deadline = time.monotonic() + 10.0
    step = 0
    while len(samples) < 100 and time.monotonic() < deadline:
        ids = mgr.alloc(1 + step % 90)
        if ids:
            held.append(ids)
        if len(held) > 20 or step % 7 == 0:
            while held:
                mgr.free(held.pop())
        step += 1
    stop.set()
    collector.join()
    assert not errors and len(samples) >= 100
    for earlier, later in zip(samples, samples[1:], strict=False):
        assert all(later[k] >= earlier[k] for k in earlier), "a counter went backwards"
    final = counters(mgr)
    outstanding = sum(len(ids) for ids in held)
    assert final["allocated_blocks_total"] - final["freed_blocks_total"] == outstanding
    assert (
        final["allocation_requests_total"] == final["allocation_successes_total"] + final["allocation_failures_total"]
    )
    assert mgr.snapshot()["allocated_blocks"] == outstanding


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    @hookimpl
    def kvcached_pool_registered(self, pool) -> None:
        self.events.append(("registered", pool.name))

    @hookimpl
    def kvcached_pool_unregistered(self, pool) -> None:
        self.events.append(("unregistered", pool.name))


def test_registry_lists_live_pools_and_hooks_announce_them(settings):
    recorder = Recorder()
    pm = get_plugin_manager()
    pm.register(recorder)
    try:
        closed = kc.KVCacheManager(64, 4096, 1, 2, name="closed-one", settings=settings)
        collected = kc.KVCacheManager(64, 4096, 1, 2, name="collected-one", pool_name="mamba", settings=settings)
        names = {(p.name, p.pool_name, p.engine) for p in registry.live_pools()}
        assert {("closed-one", "mha", "python"), ("collected-one", "mamba", "python")} <= names
        closed.close()
        del collected
        gc.collect()
        names = {p.name for p in registry.live_pools()}
        assert "closed-one" not in names and "collected-one" not in names
        assert recorder.events == [
            ("registered", "closed-one"),
            ("registered", "collected-one"),
            ("unregistered", "closed-one"),
            ("unregistered", "collected-one"),
        ]
    finally:
        pm.unregister(recorder)


def test_prometheus_exporter_is_discovered_and_its_output_parses(make_manager):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    assert "prometheus" in dict(get_plugin_manager().list_name_plugin())  # found by entry point
    mgr = make_manager(name="scraped", reserved_pages=0)
    ids = mgr.alloc(40)
    mgr.free(ids[:10])
    engine_registry = CollectorRegistry()
    mount_exporters(engine_registry)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(engine_registry).decode())}
    for name in _native.OPERATION_COUNTERS:
        assert "kvcached_" + name.removesuffix("_total") in families, name

    def value(family: str, metric: str) -> float:
        (sample,) = [s for s in families[family].samples if s.name == metric and s.labels.get("instance") == "scraped"]
        assert sample.labels["pool_name"] == "mha" and sample.labels["device"] == "cpu"
        return sample.value

    assert value("kvcached_allocated_blocks", "kvcached_allocated_blocks_total") == 40
    assert value("kvcached_freed_blocks", "kvcached_freed_blocks_total") == 10
    assert value("kvcached_pool_allocated_blocks", "kvcached_pool_allocated_blocks") == 30
    assert value("kvcached_pool_mapped_bytes", "kvcached_pool_mapped_bytes") == 2 * BUFFERS * 2 * 1024 * 1024


def test_segment_collector_shows_pools_of_other_processes(make_manager, settings):
    """What an engine's metrics endpoint in a process without pools serves: counters and occupancy as the
    owners publish them in their control segments."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvcached_core.exporters.prometheus import SegmentCollector

    mgr = make_manager(name="published", engine="vllm", reserved_pages=0)
    ids = mgr.alloc(40)
    mgr.free(ids[:10])
    make_manager(name="other-engine", engine="sglang").alloc(1)
    scrape = CollectorRegistry()
    scrape.register(SegmentCollector(engine="vllm", settings=settings))

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(generate_latest(scrape).decode())}

    def value(family: str, metric: str) -> float:
        (sample,) = [s for s in families()[family].samples if s.name == metric]  # the sglang pool is not shown
        assert (sample.labels["instance"], sample.labels["pool_name"]) == ("published", "mha")
        return sample.value

    assert wait_for(lambda: value("kvcached_freed_blocks", "kvcached_freed_blocks_total") == 10)
    assert value("kvcached_allocated_blocks", "kvcached_allocated_blocks_total") == 40
    assert value("kvcached_pool_allocated_blocks", "kvcached_pool_allocated_blocks") == 30
    assert value("kvcached_pool_mapped_bytes", "kvcached_pool_mapped_bytes") == mgr.snapshot()["mapped_bytes"]
