"""Seeing and capping the kvcached instances on this machine.

What ``kvctl``, ``kvtop``, the Prometheus exporter, the examples, the benchmarks and the tests share: the rows
of the live pools (the schema of ``kvctl list --json``), setting an instance's limit across its processes and
pools and waiting for each owner's acknowledgement, and removing what dead processes left. The command-line
tools only parse arguments and print what these functions return.

A limit applies to each process of an instance (each holds memory on its own device); inside one process it
is split across the pools in proportion to their virtual capacity.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import _native
from .config import Settings, load_settings
from .segment import Scan, Segment, collect, collect_page_tables, page_table_dir, scan, segment_dir

ACK_TIMEOUT_S = 1.0  # how long set_limit waits for every owner to acknowledge

# A row of `kvctl list --json` / `kvtop --once --json`: row key -> the segment field it comes from.
ROW_FIELDS = {
    "name": "name",
    "pid": "owner_pid",
    "engine": "engine",
    "device": "device",
    "pool_name": "pool_name",
    "limit_bytes": "limit_bytes",
    "limit_status": "limit_status",
    "admit_cap_bytes": "admit_cap_bytes",  # fair share (None: none): no new request above it
    "yield_cap_bytes": "yield_cap_bytes",  # fair share (None: none): no block above it
    "mapped_bytes": "mapped_bytes",
    "used_bytes": "used_bytes",
    "virtual_bytes": "virtual_bytes",
    "device_total_bytes": "device_total_bytes",
    "allocated_blocks": "allocated_blocks",
    "total_blocks": "total_blocks",
    "published_unix_ns": "publish_unix_ns",
}


class InstanceGone(Exception):
    """The instance, or one of its processes, is not running."""


class LimitNotTaken(Exception):
    """A live process of the instance could not be asked (its segment was locked by another process)."""


def settings_for(runtime_dir: str | None = None) -> Settings:
    """The settings of the KVCACHED_* environment, with ``runtime_dir`` in place of its runtime directory."""
    return load_settings(**({"runtime_dir": runtime_dir} if runtime_dir else {}))


def scan_segments(settings: Settings) -> Scan:
    """Every control segment of this user: live, stale (owner gone) and unusable files (with why)."""
    return scan(segment_dir(settings))


def rows(segments: Sequence[Segment]) -> list[dict]:
    """One plain dict per pool (keys: ``ROW_FIELDS``, plus the segment's path)."""
    return [{**{key: seg.info[field] for key, field in ROW_FIELDS.items()}, "segment": seg.path} for seg in segments]


def instances(settings: Settings | None = None, *, name: str | None = None, engine: str | None = None) -> list[dict]:
    """The rows of every live pool on this machine, or only those of instance ``name`` / of ``engine``."""
    found = scan_segments(settings if settings is not None else load_settings())
    return [r for r in rows(found.live) if name in (None, r["name"]) and engine in (None, r["engine"])]


def split_limit(limit: int | None, pools: Sequence[Segment]) -> list[int | None]:
    """Shares of one process's limit for its pools, in proportion to virtual capacity; they sum to it."""
    if limit is None:
        return [None] * len(pools)
    weights = [max(1, p.info["virtual_bytes"]) for p in pools]
    total = sum(weights)
    shares = [limit * w // total for w in weights]
    shares[-1] += limit - sum(shares)
    return shares


@dataclass(frozen=True)
class LimitOutcome:
    """What became of a limit request to one pool."""

    name: str
    pid: int
    pool_name: str
    share: int | None  # the bytes this pool was asked to keep under (None: no limit)
    status: str  # "applied", "deferred" (above it now: no new allocation until frees), "exited" or "pending"
    stopped: bool = False  # pending because the process is stopped (SIGSTOP, a debugger), not busy


LimitOfProcess = Callable[[list[Segment]], "int | None"]


def set_limit(
    found: Scan, name: str, limit_of_process: LimitOfProcess, timeout_s: float = ACK_TIMEOUT_S
) -> list[LimitOutcome]:
    """Requests a limit on every live pool of instance ``name`` in ``found`` (``limit_of_process`` gives each
    process's limit from its pools) and waits up to ``timeout_s`` for the owners to acknowledge it.

    Raises InstanceGone when no live pool is named ``name`` or an owner exits before it could be asked, and
    LimitNotTaken when a live owner's segment was locked; nothing is requested from the pools after that one.
    """
    targets = [s for s in found.live if s.info["name"] == name]
    if not targets:
        raise InstanceGone(f"no live instance named {name!r}; `kvctl list` shows the live ones")
    by_pid: dict[int, list[Segment]] = defaultdict(list)
    for seg in targets:
        by_pid[seg.info["owner_pid"]].append(seg)
    plan: list[tuple[Segment, int | None]] = []
    for pools in by_pid.values():
        pools.sort(key=lambda s: s.info["pool_name"])
        plan.extend(zip(pools, split_limit(limit_of_process(pools), pools), strict=True))
    revision = 1 + max(
        max(s.info["request_revision"], s.info["applied_revision"], s.info["limit_revision"]) for s in targets
    )
    for seg, share in plan:
        try:
            _native.request_limit(seg.path, share, revision)
        except _native.SegmentError as exc:
            pid = seg.info["owner_pid"]
            if seg.live:
                raise LimitNotTaken(f"process {pid} of {name!r} is running but {exc}; try again") from None
            raise InstanceGone(f"process {pid} of {name!r} went away: {exc}") from None
    return _acknowledged(plan, revision, timeout_s)


def _acknowledged(plan: list[tuple[Segment, int | None]], revision: int, timeout_s: float) -> list[LimitOutcome]:
    def outcome(seg: Segment, share: int | None, status: str, stopped: bool = False) -> LimitOutcome:
        return LimitOutcome(seg.info["name"], seg.info["owner_pid"], seg.info["pool_name"], share, status, stopped)

    deadline = time.monotonic() + timeout_s
    outcomes: dict[str, LimitOutcome] = {}
    pending = list(plan)
    while True:
        still = []
        for seg, share in pending:
            try:
                info = _native.read_segment(seg.path)
            except _native.SegmentError:
                outcomes[seg.path] = outcome(seg, share, "exited")
                continue
            if info["handled_revision"] >= revision:
                outcomes[seg.path] = outcome(seg, share, info["limit_status"])
            else:
                still.append((seg, share))
        pending = still
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    for seg, share in pending:
        outcomes[seg.path] = outcome(seg, share, "pending", process_state(seg.info["owner_pid"]) in ("T", "t"))
    return [outcomes[seg.path] for seg, _ in plan]


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T``/``t``: stopped), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def collect_stale(settings: Settings) -> tuple[list[str], list[str]]:
    """Removes the segments and page tables whose owner is gone; returns the paths removed (segments, tables)."""
    return collect(segment_dir(settings)), collect_page_tables(page_table_dir(settings))
