"""One engine start-up at a time on a device.

An engine measures device memory while it starts (vLLM: a free-memory check, then a profile run compared
against the reading taken before it), and another engine starting on the same device meanwhile (loading
weights, profiling, capturing CUDA graphs, freeing its caches) moves those readings: the KV size comes out
wrong, or the engine refuses to start. Memory held by *running* kvcached engines is accounted for (see
``kvcached_core.segment.held_by_other_processes``); engines that are starting are serialized by this lock,
so two engines started at the same moment both come up, one after the other.

The lock is an owner-only file in the runtime directory (``startup/<device key>``) held with ``flock``: the
kernel releases it when its holder exits, even by SIGKILL, so a crashed start-up never blocks the next one.
A start-up that fails keeps it until its process exits (:meth:`StartupLock.release_later`): the process
still holds device memory while it goes, and the next engine must not profile while that comes free. A
holder that hangs is waited for at most ``timeout_s``, then start-up goes on with a warning.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time

from .config import Settings
from .runtime_dir import runtime_subdir

logger = logging.getLogger("kvcached")


class StartupLock:
    """The start-up lock of one device, named by a key that is the same in every process (a GPU's UUID)."""

    def __init__(self, settings: Settings, device_key: str, timeout_s: float = 600.0) -> None:
        self.path = os.path.join(runtime_subdir(settings, "startup"), re.sub(r"[^A-Za-z0-9_.-]", "_", device_key)[:200])
        self.timeout_s = timeout_s
        self._fd: int | None = None
        self._releasing = threading.Lock()  # release() may run on release_later's timer thread too
        self._timer: threading.Timer | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> float:
        """Take the lock, waiting for another start-up on the device to finish; returns seconds waited."""
        if self._fd is not None:
            if self._timer is not None:  # a new start-up in this process after a failed one: it holds on
                self._timer.cancel()
                self._timer = None
            return 0.0
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        started = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= self.timeout_s:
                    os.close(fd)
                    logger.warning(
                        "kvcached: another engine has been starting on this device for %.0f s; starting anyway",
                        waited,
                    )
                    return waited
                if not announced:
                    logger.info("kvcached: waiting for another engine to finish starting on this device")
                    announced = True
                time.sleep(0.1)
        self._fd = fd
        return time.monotonic() - started

    def release(self) -> None:
        """Let the next start-up on the device go on (idempotent)."""
        with self._releasing:
            fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def release_later(self, delay_s: float = 60.0) -> None:
        """Keep the lock until this process exits, or ``delay_s`` at most (a process that lives on after a
        failed start-up, e.g. one that built an engine in-process, must not hold the next one up for long)."""
        if self._fd is None:
            return
        self._timer = threading.Timer(delay_s, self.release)
        self._timer.daemon = True  # the process's exit releases the lock first
        self._timer.start()
