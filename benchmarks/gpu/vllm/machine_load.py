"""The machine a run used and what else it was doing while something was timed: where it ran (the host, the
GPU as nvidia-smi names it, :func:`gpu_machine`), the GPU's clocks (a power or thermal cap, a lower clock)
and the host's busy and stolen cores (a neighbour on the same physical host). A slower round shows its
cause here rather than being read as the engine's. Used by the harness around each served rate, by the
offline engines around each timed batch and by the multimodel runs; it needs nothing beyond the standard
library and ``nvidia-smi`` (without it the GPU's figures are empty).
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import time


def gpu_machine(index: str) -> dict[str, str]:
    """Where a run ran: the host, GPU ``index`` as nvidia-smi names it (name, memory, driver) and the UTC
    time, so that a comparison across runs can tell a machine or a GPU model apart. The GPU fields are
    missing where nvidia-smi is."""
    info = {"host": platform.node(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    query = "name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", index],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return info
    fields = [f.strip() for f in out.stdout.strip().split(",")]
    if out.returncode == 0 and len(fields) == 3:
        info.update(zip(("gpu", "gpu_memory", "driver"), fields, strict=True))
    return info


def host_cpu_seconds() -> dict[str, float]:
    """The whole machine's CPU seconds so far, all cores (/proc/stat): ``busy`` (not idle, not waiting on
    I/O) and ``steal`` (taken by the host from this virtual machine; 0 where it is not reported)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    tick = os.sysconf("SC_CLK_TCK")
    return {"busy": (sum(ticks) - ticks[3] - ticks[4]) / tick, "steal": ticks[7] / tick}


class GpuClocks:
    """``nvidia-smi`` sampling the GPU's SM clock, power, temperature and clock-event reasons every 200 ms
    from construction to :meth:`stop` (the GPU of ``CUDA_VISIBLE_DEVICES``, else 0). Without nvidia-smi,
    :meth:`stop` returns {}."""

    QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self) -> None:
        index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        command = ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-i", index]
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [*command, "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            self.proc = None

    def stop(self) -> dict:
        """Stop sampling; the median and lowest SM clock (MHz), median power (W), highest temperature (C)
        and every clock-event bit mask seen (0x1: idle; 0x4: software power cap; 0x20, 0x40: thermal)."""
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGINT)  # what its loop mode is stopped with (Ctrl-C): it exits cleanly
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        rows = []
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                rows.append((float(fields[0]), float(fields[1]), float(fields[2]), fields[3]))
            except (ValueError, IndexError):  # "[N/A]" or a cut last line
                continue
        if not rows:
            return {}
        return {
            "sm_mhz_p50": statistics.median(r[0] for r in rows),
            "sm_mhz_min": min(r[0] for r in rows),
            "power_w_p50": statistics.median(r[1] for r in rows),
            "temperature_c_max": max(r[2] for r in rows),
            "clock_events": sorted({r[3] for r in rows}),
            "samples": len(rows),
        }


class MachineLoad:
    """Both figures over one timed span: ``stop()`` returns ``{"gpu": ..., "host": ...}``, the host's as cores
    (seconds of CPU per second of wall time)."""

    def __init__(self) -> None:
        self._clocks = GpuClocks()
        self._host = host_cpu_seconds()
        self._begin = time.monotonic()

    def stop(self) -> dict[str, dict]:
        """The GPU's clocks (:meth:`GpuClocks.stop`) and the host's ``busy_cores`` and ``steal_cores``."""
        wall_s = max(time.monotonic() - self._begin, 1e-9)
        gpu, host = self._clocks.stop(), host_cpu_seconds()
        return {"gpu": gpu, "host": {f"{k}_cores": (host[k] - self._host[k]) / wall_s for k in host}}
