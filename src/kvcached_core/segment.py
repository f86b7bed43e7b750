"""Control segments on disk: where they live, which are live, and collecting the stale ones.

The binary layout and its validation are native (``csrc/control/segment_layout.h``); this module only
finds files and judges their owners. A segment is live while its owner process runs; a pid reused by
another process is told apart by the owner's start time.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import _native
from .backends import host_device_label
from .config import Settings
from .runtime_dir import runtime_subdir

SUFFIX = ".seg"
TMP_SUFFIX = ".seg.tmp"
PAGE_TABLE_SUFFIX = ".pt"


def segment_dir(settings: Settings) -> str:
    """The per-user segment directory (0700), created on first use."""
    return runtime_subdir(settings, "segments")


def page_table_dir(settings: Settings) -> str:
    """The per-user directory (0700) of planners' page tables (see kvcached_core.mirror)."""
    return runtime_subdir(settings, "pagetables")


PID_MAX = (1 << 22) - 1  # Linux's largest pid (pid_max can be at most 4194304)


def creator_pid(name: str) -> int | None:
    """The pid a kvcached file name starts with (``<pid>-...``), or None when the name holds no pid a process
    can have (a stray file: it is left alone)."""
    head = name.split("-", 1)[0]
    if not (head.isascii() and head.isdigit()) or len(head) > 7:
        return None
    pid = int(head)
    return pid if 0 < pid <= PID_MAX else None


def _own_regular_file(entry: os.DirEntry) -> bool:
    """Whether ``entry`` is a regular file of this user (not a link, directory or another user's file): only
    those are ever removed."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _unlink_all(paths: Sequence[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def collect_page_tables(directory: str) -> list[str]:
    """Removes page tables (and their temporary files) whose planner process is gone.

    A page table's name starts with its planner's pid; the planner removes it on close, so one whose pid no
    longer runs was left by a crash. Anything else in the directory is left alone.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    dead = []
    for entry in entries:
        pid = creator_pid(entry.name)
        if pid is None or PAGE_TABLE_SUFFIX not in entry.name or not _own_regular_file(entry):
            continue
        if not _native.process_alive(pid, 0):
            dead.append(entry.path)
    return _unlink_all(dead)


def new_segment_path(directory: str) -> str:
    """A fresh file name for a segment of this process."""
    return os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}")


@dataclass
class Segment:
    path: str
    info: dict

    @property
    def live(self) -> bool:
        return _native.process_alive(self.info["owner_pid"], self.info["owner_start_time"])


@dataclass
class Scan:
    live: list[Segment] = field(default_factory=list)
    stale: list[Segment] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, why it was skipped)
    leftovers: list[str] = field(default_factory=list)  # temporary files of dead creators


def scan(directory: str) -> Scan:
    """Reads every segment in ``directory``; files that are not usable segments land in ``bad``."""
    result = Scan()
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return result
    for entry in entries:
        if entry.name.endswith(TMP_SUFFIX):
            pid = creator_pid(entry.name)
            if pid is not None and _own_regular_file(entry) and not _native.process_alive(pid, 0):
                result.leftovers.append(entry.path)
            continue
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            seg = Segment(entry.path, _native.read_segment(entry.path))
        except _native.SegmentError as exc:
            if "gone" not in str(exc):  # closed between listing and reading: not a problem
                result.bad.append((entry.path, str(exc).split(": ", 1)[-1]))
            continue
        (result.live if seg.live else result.stale).append(seg)
    result.live = _without_copies(result.live, result.bad)
    return result


def _identity(seg: Segment) -> tuple:
    i = seg.info
    return (i["owner_pid"], i["owner_start_time"], i["created_unix_ns"], i["name"], i["pool_name"])


def _without_copies(live: list[Segment], bad: list[tuple[str, str]]) -> list[Segment]:
    """A byte copy of a live segment (a backup tool's, say) or a second name of it (a hard link) reads as a
    second live pool of its owner, and a limit would be split between them. Where several files carry one
    identity, only the one the owner maps is its segment, under one name; the others land in ``bad``.
    Without /proc to tell (a hidden process), copies are kept."""
    groups: dict[tuple, list[Segment]] = {}
    for seg in live:
        groups.setdefault(_identity(seg), []).append(seg)
    kept = []
    for segs in groups.values():
        mapped = _mapped_inodes(segs[0].info["owner_pid"]) if len(segs) > 1 else None
        seen: set[int] = set()
        for seg in segs:
            try:
                inode = os.stat(seg.path, follow_symlinks=False).st_ino
            except OSError:
                continue
            if inode in seen:
                bad.append((seg.path, "another name (a hard link) of a live segment; remove it"))
            elif mapped is not None and inode not in mapped:
                bad.append((seg.path, "a copy of a live segment (its owner does not map it); remove it"))
            else:
                seen.add(inode)
                kept.append(seg)
    return kept


def _mapped_inodes(pid: int) -> set[int] | None:
    """Inode numbers of the files process ``pid`` maps, or None when /proc does not say."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {int(fields[4]) for fields in (line.split(maxsplit=5) for line in f) if len(fields) > 4}
    except (OSError, ValueError):
        return None


def collect(directory: str, name: str | None = None, pool_name: str | None = None) -> list[str]:
    """Removes segments whose owner is gone (only those of ``name``/``pool_name`` when given)."""
    found = scan(directory)
    targets = [
        s.path for s in found.stale if name is None or (s.info["name"], s.info["pool_name"]) == (name, pool_name)
    ]
    if name is None:
        targets += found.leftovers
    return _unlink_all(targets)


def held_by_other_processes(settings: Settings, device: str) -> int:
    """Physical bytes that live kvcached pools of other processes hold on ``device`` ("cpu", "cuda:N"):
    mapped pages and the physical handles their pools keep ready.

    Engine plugins count this as free in the memory readings their engine takes at start-up (its free-memory
    check, its profiling), so the KV capacity an engine plans for does not shrink, and its checks do not
    fail, because another elastic engine holds memory right now or gives it back meanwhile: that memory
    comes back when it goes idle. (Device labels are per process: under different CUDA_VISIBLE_DEVICES two
    labels can name different GPUs; the capacity this sizes is virtual, so an overestimate costs only
    address space.)
    """
    me = os.getpid()
    return sum(held for pid, held in held_per_process(settings, device).items() if pid != me)


def held_per_process(settings: Settings, device: str) -> dict[int, int]:
    """Physical bytes (mapped pages and ready handles) that each process's live kvcached pools hold on
    ``device``, by pid, this process included."""
    device = host_device_label(device)
    held: dict[int, int] = {}
    for s in scan(segment_dir(settings)).live:
        if s.info["device"] == device:
            pid = s.info["owner_pid"]
            ready = max(0, s.info["pool_ready_handles"]) * s.info["page_bytes"]
            held[pid] = held.get(pid, 0) + s.info["mapped_bytes"] + ready
    return held
