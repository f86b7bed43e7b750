"""kvcached's counters and gauges in vLLM's own Prometheus ``/metrics``.

vLLM serves ``/metrics`` from its API server process, where no pool lives (the scheduler's planner is in
EngineCore), so this stat logger mounts a collector that reads the pools' control segments, filtered to this
engine's instance name. Loaded by vLLM through the ``vllm.stat_logger_plugins`` entry point.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvcached_core import load_settings

from .engine import instance_name

logger = logging.getLogger("vllm.kvcached")
_mounted: set[str | None] = set()


class KvcachedStatLogger(StatLoggerBase):
    """Mounts kvcached's metrics (labelled by instance, pool_name, device) in vLLM's Prometheus registry."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        name = instance_name(vllm_config)
        if not load_settings().enable or name in _mounted:
            return
        from prometheus_client import REGISTRY

        from kvcached_core.exporters.prometheus import SegmentCollector

        REGISTRY.register(SegmentCollector(engine="vllm", name=name))
        _mounted.add(name)
        logger.info("kvcached: metrics of instance %s mounted in vLLM's /metrics", name)

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to record: kvcached's figures are read from its pools at scrape time."""

    def log_engine_initialized(self) -> None:
        """Nothing to log."""
