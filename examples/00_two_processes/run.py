"""Two engines, one memory budget: kvcached's main job, shown with two processes.

Starts engine-A and engine-B (worker.py), each a KVCacheManager with twice the budget of virtual capacity.
A is busy in phases 1 and 3 of the run, B in 2 and 4; what the idle one frees goes to the busy one. Prints
both engines' mapped bytes over time and checks that their sum stayed within the budget, that memory moved
at each phase change and that every block read back what was written.

The budget: on the CPU, KVCACHED_HOST_DEVICE_BYTES in a private runtime directory; on CUDA, the GPU itself,
with all other free memory held as ballast. Exit status: 0 when every check passed, 1 when one failed,
128 + the signal number when interrupted. Example: python run.py --plot /tmp/two_proc.png
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import kvcached_core as kc
from kvcached_core.control import settings_for
from kvcached_core.segment import segment_dir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from demo_device import hold_gpu_ballast, resolve_device  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
MIB = 1 << 20
INTERVAL_S = 0.1  # the workers sample every 100 ms (a "tick")
ROW_TICKS = 5  # one timeline row every 0.5 s
BAR = 32  # width of the text bar

Events = queue.Queue[tuple["Engine", "str | None"]]  # (engine, a line it printed, or None at its end)


@dataclass
class Engine:
    """One worker process and what it reported."""

    name: str
    busy_phases: tuple[int, ...]
    color: str  # in the plot
    proc: subprocess.Popen[str] | None = None
    eof: bool = False  # its output ended and it was reaped
    samples: dict[int, int] = field(default_factory=dict)  # tick -> mapped bytes
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ready", "done" -> the line

    def mapped_at(self, tick: int) -> int:
        """Mapped bytes at ``tick``, or at the latest sample before it."""
        earlier = [k for k in self.samples if k <= tick]
        return self.samples[max(earlier)] if earlier else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], epilog=__doc__.split("\n\n")[2])
    p.add_argument("--budget", default="256M", help="memory both processes share, e.g. 256M, 1G (default: 256M)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds, split into 4 phases (default: 12)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (default): cuda if usable")
    p.add_argument("--plot", metavar="PATH", help="also write a PNG of the timeline (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.budget_bytes = kc.parse_size(args.budget)
    except ValueError as exc:
        p.error(f"--budget: {exc}")
    if args.budget_bytes < 32 * MIB or not 1 <= args.duration <= 600:
        p.error("--budget must be at least 32M and --duration between 1 and 600 seconds")
    return args


def read_lines(engine: Engine, events: Events) -> None:
    """Pass the worker's lines on; at their end reap it (a zombie's memory counts as held), pass None."""
    assert engine.proc is not None and engine.proc.stdout is not None
    for line in engine.proc.stdout:
        events.put((engine, line))
    engine.proc.wait()
    events.put((engine, None))


def take(events: Events, deadline: float) -> bool:
    """Take in one worker line: a sample, a report, or the end of its output. False at the deadline."""
    try:
        engine, line = events.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return False
    if line is None:
        engine.eof = True
    elif "t" in (msg := json.loads(line)):
        engine.samples[round(msg["t"] / INTERVAL_S)] = msg["mapped_bytes"]
    else:
        engine.reports[msg["event"]] = msg
    return True


def stop(engines: list[Engine]) -> None:
    """Leave no worker running: SIGTERM (a worker frees, closes and exits), SIGKILL after 3 s."""
    for e in engines:
        if e.proc is not None and e.proc.poll() is None:
            e.proc.terminate()
            try:
                e.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                e.proc.kill()
                e.proc.wait()


def phase_of(tick: float, duration: float) -> int:
    """Phase (0-3) of the run at ``tick``."""
    return min(int(tick * INTERVAL_S * 4 / duration + 1e-9), 3)


def row(engines: list[Engine], tick: int, budget: int, duration: float) -> str:
    """A timeline row: who is busy, each engine's mapped MiB, their sum, and a bar of the budget."""
    values = [e.mapped_at(tick) for e in engines]
    cells = "".join(e.name[-1] * round(v / budget * BAR) for e, v in zip(engines, values, strict=True))
    bar = "|" + cells[:BAR].ljust(BAR, ".") + "|" + "!" * (len(cells) - BAR)  # '!': past the budget
    phase = phase_of(tick - 0.01, duration)  # a sample right at a phase change shows the phase that ended
    busy = next(e.name[-1] for e in engines if phase in e.busy_phases)
    mib = "".join(f"{v / MIB:10.0f}" for v in values)
    return f"{tick * INTERVAL_S:5.1f}{busy:>5}{mib}{sum(values) / MIB:7.0f}  {bar}"


def sums(engines: list[Engine]) -> dict[int, int]:
    """Both engines' mapped bytes added up, at each tick where both sampled."""
    a, b = engines
    return {k: a.samples[k] + b.samples[k] for k in sorted(a.samples.keys() & b.samples.keys())}


def summarize(engines: list[Engine], budget: int, duration: float, segments: str) -> int:
    """Print the summary, one check a line (FAIL where it failed); returns the number of failed checks."""
    checks: list[tuple[bool, str]] = []
    for e in engines:
        d, rc = e.reports.get("done", {}), e.proc.returncode if e.proc else None
        text = (
            f"{e.name}: peak {max(e.samples.values(), default=0) / MIB:.0f} MiB mapped; {d.get('misses', '?')} "
            f"alloc() misses (budget full); {d.get('checks', 0)} blocks read back, {d.get('mismatches', '?')} "
            f"wrong; exit status {rc}"
        )
        checks.append((rc == 0 and d.get("checks", 0) > 0 and d.get("mismatches") == 0, text))
    total = sums(engines)
    top = max(total, key=lambda k: total[k], default=0)
    peak = total.get(top, 0)
    text = f"peak of the sum: {peak / MIB:.0f} MiB at t={top * INTERVAL_S:.1f} s ({len(total)} samples)"
    checks.append((0 < peak <= budget, f"{text}, {'within' if peak <= budget else 'OVER'} the budget"))

    def peak_in(e: Engine, phase: int) -> int:
        """Highest mapped bytes of ``e`` sampled during ``phase``."""
        return max((v for k, v in e.samples.items() if phase_of(k, duration) == phase), default=0)

    for p in range(1, 4):  # at each phase change the newly busy engine maps what the other one gave back
        new = next(e for e in engines if p in e.busy_phases)
        old = next(e for e in engines if e is not new)
        had, got = peak_in(old, p - 1), peak_in(new, p)
        text = f"at {p * duration / 4:g} s: {old.name} had {had / MIB:.0f} MiB, then {new.name} {got / MIB:.0f} MiB"
        checks.append((had + got > budget, f"{text}: at least {max(0, had + got - budget) / MIB:.0f} MiB moved"))
    left = [f for f in os.listdir(segments) if f.endswith(".seg")]  # each manager removes its own on close
    checks.append((not left, f"segment files left behind: {len(left)}"))

    print(f"\nSummary (budget {budget / MIB:.0f} MiB)")
    for ok, text in checks:
        print(f"  {'ok  ' if ok else 'FAIL'}  {text}")
    return sum(not ok for ok, _ in checks)


def write_plot(path: str, engines: list[Engine], budget: int, duration: float, device: str) -> None:
    """Write a PNG: each engine's mapped MiB over time, their sum, the budget and the busy phases."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    phase = duration / 4
    for e in engines:
        for p in e.busy_phases:
            ax.axvspan(p * phase, (p + 1) * phase, color=e.color, alpha=0.08, lw=0)
            ax.text((p + 0.5) * phase, budget / MIB * 1.12, f"{e.name[-1]} busy", ha="center", color=e.color)
        pts = sorted(e.samples.items())
        ax.plot([k * INTERVAL_S for k, _ in pts], [v / MIB for _, v in pts], color=e.color, lw=2, label=e.name)
    total = sums(engines)
    ax.plot([k * INTERVAL_S for k in total], [v / MIB for v in total.values()], "k:", lw=1, alpha=0.6, label="sum")
    ax.axhline(budget / MIB, color="tab:red", ls="--", lw=1.3, label=f"budget {budget / MIB:.0f} MiB")
    where = "host budget" if device == "cpu" else "free GPU memory"
    ax.set(xlim=(0, duration), ylim=(0, budget / MIB * 1.2), xlabel="time since start [s]")
    ax.set(ylabel="mapped memory [MiB]", title=f"kvcached: two processes sharing {budget / MIB:.0f} MiB of {where}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, frameon=False)
    ax.grid(alpha=0.25)
    fig.savefig(path, bbox_inches="tight")
    print(f"plot written to {path}")


def run(args: argparse.Namespace, engines: list[Engine], runtime_dir: str) -> int:
    """Start the workers, print the timeline while they run, check and plot; the exit status."""
    device = resolve_device(args.device)
    budget = args.budget_bytes
    # On the CPU: one host budget for every process using runtime_dir. On CUDA the GPU is the shared device.
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=runtime_dir, KVCACHED_HOST_DEVICE_BYTES=str(budget))
    if device == "cuda":
        del env["KVCACHED_HOST_DEVICE_BYTES"]
    events: Events = queue.Queue()
    for e in engines:
        argv = [sys.executable, WORKER, "--name", e.name, "--busy-phases", ",".join(map(str, e.busy_phases))]
        argv += ["--duration", str(args.duration), "--device", device, "--capacity", str(2 * budget)]
        # No shell. A session of its own: a Ctrl-C in the terminal reaches only the driver, which stops it.
        e.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        threading.Thread(target=read_lines, args=(e, events), daemon=True).start()
    pids = ", ".join(str(e.proc.pid) for e in engines if e.proc)
    print(f"device {device}; budget {budget / MIB:.0f} MiB; runtime dir {runtime_dir}; worker pids {pids}")

    deadline = time.monotonic() + 60  # the workers import torch first
    while not all("ready" in e.reports or e.eof for e in engines) and take(events, deadline):
        pass
    if not all("ready" in e.reports for e in engines):
        print("run.py: a worker did not start (its error is above)", file=sys.stderr)
        return 1
    ballast = None
    if device == "cuda":
        ballast, budget = hold_gpu_ballast(budget)  # the budget is now what the GPU really has left
        print(f"GPU ballast held: {budget / MIB:.0f} MiB of GPU memory left free for the two engines")

    start = time.monotonic() + 0.5  # time for the workers to make their managers
    for e in engines:
        assert e.proc is not None and e.proc.stdin is not None
        e.proc.stdin.write(f"{start!r}\n")
        e.proc.stdin.flush()
    print(f"\n t[s] busy  engine-A  engine-B    sum  MiB mapped; bar: budget of {budget / MIB:.0f} MiB")
    last, next_row = round(args.duration / INTERVAL_S), 0
    deadline = start + args.duration + 20
    while not all(e.eof for e in engines):
        if not take(events, deadline):
            print("run.py: the workers did not finish in time", file=sys.stderr)
            break
        reached = min(last if e.eof else max(e.samples, default=-1) for e in engines)
        while next_row <= min(reached, last):
            print(row(engines, next_row, budget, args.duration))
            next_row += ROW_TICKS
    stop(engines)
    del ballast

    failed = summarize(engines, budget, args.duration, segment_dir(settings_for(runtime_dir)))
    if args.plot:
        write_plot(args.plot, engines, budget, args.duration, device)
    if failed:
        print(f"\nFAILED: {failed} check(s), marked FAIL above")
        return 1
    print("\nOK: the sum stayed within the budget and memory moved between the processes")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, and in every case stop the workers and remove the runtime directory."""
    args = parse_args(argv)
    engines = [Engine("engine-A", (0, 2), "tab:blue"), Engine("engine-B", (1, 3), "tab:orange")]
    runtime_dir = tempfile.mkdtemp(prefix="kvcached-two-proc-")  # mode 0700: a budget of our own

    def on_signal(signum: int, _frame: object) -> None:
        """Leave through ``finally`` below (SIGINT too: a background job would ignore it otherwise)."""
        print(f"\nrun.py: {signal.Signals(signum).name}; stopping the workers", file=sys.stderr)
        raise SystemExit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        return run(args, engines, runtime_dir)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # finish cleaning up even on a second Ctrl-C
        stop(engines)
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
