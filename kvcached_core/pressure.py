"""Device pressure: an engine that cannot get memory on a device says so; the other engines there read it.

Each device has one small owner-only record in the runtime directory (``pressure/<device>``): a sequence
number, the pid of the engine that last fell short and when. An engine whose scheduler could not get blocks
because the device (not its own limit) is full calls :meth:`DevicePressure.signal`; engines on the same
device poll :meth:`DevicePressure.poll` and, on a new shortfall from another process, give back memory
they keep only as a cache (the vLLM plugin: cached prefix blocks, least recently used first, down to
``KVCACHED_PREFIX_CACHE_FLOOR_BYTES``). No allocated block is ever taken back; the record is a hint.

A record that is not a regular file of this user, is open to others, or has the wrong size or magic is
ignored (never trusted, never rewritten); one warning says so.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import time
from dataclasses import dataclass

from .backends import host_device_label
from .config import Settings
from .runtime_dir import runtime_subdir

logger = logging.getLogger("kvcached")

_RECORD = struct.Struct("<QIiQQ")  # magic, layout version, pid, sequence, unix time in ns
_MAGIC = 0x5253455250564B  # "KVPRESR"
_VERSION = 1


@dataclass(frozen=True)
class Shortfall:
    """The last shortfall signalled on a device."""

    sequence: int
    pid: int
    unix_ns: int


def pressure_dir(settings: Settings) -> str:
    """The per-user directory (0700) of device pressure records."""
    return runtime_subdir(settings, "pressure")


class DevicePressure:
    """The pressure record of one device (``cpu`` or ``cuda:N``)."""

    def __init__(self, settings: Settings, device: str) -> None:
        self.device = host_device_label(device)
        self.path = os.path.join(pressure_dir(settings), self.device.replace(":", "-"))
        self._seen = 0
        self._warned = False

    def signal(self) -> None:
        """Record that this process could not get memory on the device (bumps the sequence)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            self._warn(f"cannot open {self.path}: {exc.strerror}")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not self._trusted(fd, allow_empty=True):
                return
            raw = os.pread(fd, _RECORD.size, 0)
            last = self._decode(raw) if raw else None
            if raw and last is None:
                return
            sequence = (last.sequence if last else 0) + 1
            os.pwrite(fd, _RECORD.pack(_MAGIC, _VERSION, os.getpid(), sequence, time.time_ns()), 0)
            self._seen = max(self._seen, sequence)  # our own shortfall is not news to us
        finally:
            os.close(fd)

    def read(self) -> Shortfall | None:
        """The last shortfall on the device, or None (none yet, or the record is not usable)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(f"cannot open {self.path}: {exc.strerror}")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not self._trusted(fd, allow_empty=False):
                return None
            return self._decode(os.pread(fd, _RECORD.size, 0))
        finally:
            os.close(fd)

    def poll(self) -> Shortfall | None:
        """A shortfall from another process that this object has not returned before, or None."""
        last = self.read()
        if last is None or last.sequence <= self._seen:
            return None
        self._seen = last.sequence
        return last if last.pid != os.getpid() else None

    def _trusted(self, fd: int, allow_empty: bool) -> bool:
        st = os.fstat(fd)
        ok = (
            stat.S_ISREG(st.st_mode)
            and st.st_uid == os.geteuid()
            and not st.st_mode & 0o077
            and (st.st_size == _RECORD.size or (allow_empty and st.st_size == 0))
        )
        if not ok:
            self._warn(f"{self.path} is not a pressure record of this user; remove it")
        return ok

    def _decode(self, raw: bytes) -> Shortfall | None:
        if len(raw) != _RECORD.size:
            return None
        magic, version, pid, sequence, unix_ns = _RECORD.unpack(raw)
        if magic != _MAGIC or version != _VERSION:
            self._warn(f"{self.path} is not a pressure record of this kvcached version; remove it")
            return None
        return Shortfall(sequence, pid, unix_ns)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("kvcached: %s", message)
