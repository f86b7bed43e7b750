"""Device pressure: an engine that cannot get memory on a device says so; the other engines there read it.

Each device has one small owner-only record in the runtime directory (``pressure/<device>``): a sequence
number, the pid of the engine that last fell short and when. An engine whose scheduler could not get blocks
because the device (not its own limit) is full calls :meth:`DevicePressure.signal`; engines on the same
device poll :meth:`DevicePressure.poll` and, on a new shortfall from another process, give back memory
they keep only as a cache (cached prefixes, least recently used first, down to
``KVCACHED_PREFIX_CACHE_FLOOR_BYTES``, then the empty pages kept mapped for their own recent demand). No
allocated block is ever taken back; the record is a hint. :class:`PressureWatch` is one engine process's
side of it: the plugins say what they can give back and run the give-back on their scheduler's thread.

A record that is not a regular file of this user, is open to others, or has the wrong size or magic is
ignored (never trusted, never rewritten); one warning says so.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .backends import host_device_label
from .config import Settings
from .fair_share import FairShare
from .idle_hold import IdleHold
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
        self._warned = False
        # A shortfall recorded before this object existed is not news (its engine may be long gone; one still
        # short signals again at its next failed allocation, within 50 ms), so the record's sequence is seen.
        last = self.read()
        self._seen = last.sequence if last else 0

    def signal(self) -> None:
        """Record that this process could not get memory on the device (bumps the sequence)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            self._warn(f"cannot open {self.path}: {exc.strerror}")
            return
        try:
            if not self._lock(fd, fcntl.LOCK_EX):
                return
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
            if not self._lock(fd, fcntl.LOCK_SH):
                return None
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

    LOCK_WAIT_S = 0.05  # a scheduler's thread calls signal(): another process's lock must not stall it

    def _lock(self, fd: int, kind: int) -> bool:
        """Take the record's lock, waiting at most ``LOCK_WAIT_S`` (the record is a hint: skip it if held)."""
        deadline = time.monotonic() + self.LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._warn(f"{self.path} stays locked by another process; pressure signals skip it meanwhile")
                    return False
                time.sleep(0.001)

    def _trusted(self, fd: int, allow_empty: bool) -> bool:
        st = os.fstat(fd)
        ok = (
            stat.S_ISREG(st.st_mode)
            and st.st_nlink == 1  # a hard link planted here would have the record written into another file
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


class PressureWatch:
    """One engine process's side of device pressure.

    A daemon thread polls the device's record every ``KVCACHED_WATCH_INTERVAL_MS``. A shortfall from another
    process, while ``has_spare()`` says this engine keeps memory it could give back, sets :attr:`pending` and
    calls ``wake()`` (an engine loop that blocks while idle needs the nudge). The engine's scheduler thread
    checks :meth:`take_pending` between its turns and gives back what its plugin's policy allows; giving back
    on the watcher thread would race the scheduler. :meth:`report_shortfall` tells the other engines when
    this one falls short itself. With ``KVCACHED_FAIR_SHARE`` the watcher thread also caps this process's
    pools while a neighbour is short (:class:`kvcached_core.fair_share.FairShare`; the caps are atomic, so
    no scheduler thread is needed for them). With ``KVCACHED_IDLE_HOLD_MS`` it also keeps the engine's recent
    demand mapped while no other kvcached engine shares the device (:class:`kvcached_core.idle_hold.IdleHold`;
    the window is atomic too).
    """

    MIN_SIGNAL_INTERVAL_S = 0.05  # a scheduler retries every step: one signal per 50 ms is enough

    def __init__(
        self,
        settings: Settings,
        device: str,
        has_spare: Callable[[], bool],
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.pressure = DevicePressure(settings, device)
        self.pending = threading.Event()
        self._has_spare, self._wake = has_spare, wake
        self.fair_share = FairShare(settings, device) if settings.fair_share else None
        self.idle_hold = IdleHold(settings, device) if settings.idle_hold_ms > 0 else None
        self._interval = settings.watch_interval_ms / 1000
        self._last_signal = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvcached-pressure", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                shortfall = self.pressure.poll()
                if shortfall is not None and self.fair_share is not None:
                    self.fair_share.on_shortfall(shortfall.pid)
                if shortfall is not None and self._has_spare():
                    self.pending.set()
                    if self._wake is not None:
                        self._wake()
                if self.fair_share is not None:
                    self.fair_share.tick()
                if self.idle_hold is not None:
                    self.idle_hold.tick()
            except Exception as exc:  # the watcher must outlive a bad read or a wake into a closing engine
                logger.debug("kvcached: pressure watch: %s", exc)

    def take_pending(self) -> bool:
        """On the scheduler's thread: whether another engine fell short since the last call (clears it)."""
        if not self.pending.is_set():
            return False
        self.pending.clear()
        return True

    def report_shortfall(self, device_short: Callable[[], bool]) -> None:
        """This engine could not get memory: tell the others, if ``device_short()`` says the device (not this
        engine's own limit or virtual capacity) is what is short. At most once per ``MIN_SIGNAL_INTERVAL_S``."""
        now = time.monotonic()
        if now - self._last_signal < self.MIN_SIGNAL_INTERVAL_S:
            return
        self._last_signal = now
        if device_short():
            try:
                self.pressure.signal()
            except OSError as exc:
                logger.warning("kvcached: cannot signal memory pressure: %s", exc)

    def close(self) -> None:
        """Stop the watcher thread (it is a daemon: an engine that exits without this loses nothing)."""
        self._stop.set()
