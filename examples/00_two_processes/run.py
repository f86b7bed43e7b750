"""Two engines, one memory budget: kvcached's main job, shown with two processes.

This driver starts two worker processes (``worker.py``), "engine-A" and "engine-B". Each runs its own
KVCacheManager whose virtual capacity is twice the shared budget. The run is split into four phases: A
is busy in phases 1 and 3, B in phases 2 and 4. A busy engine allocates KV blocks until the budget is
full, holds them, frees them and starts over; an idle one holds nothing, its pages are unmapped, and the
busy one maps that memory. The driver prints both engines' mapped bytes over time, checks that their sum
never exceeded the budget, and reports how memory moved from one engine to the other.

On a CPU-only machine the budget is the host budget that every host-backend process of this user shares
(``KVCACHED_HOST_DEVICE_BYTES``, counted in a ledger in ``KVCACHED_RUNTIME_DIR``). With a usable CUDA
device the engines share the GPU itself: the driver holds all free GPU memory beyond the budget as ballast,
so that the budget is what the GPU has left for them.

Exit status: 0 when every check passed, 1 when one failed, 128 + the signal number when interrupted
(130 for Ctrl-C); the workers are stopped in every case.
"""

from __future__ import annotations

import argparse
import json
import math
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
from typing import IO, Any

import kvcached_core as kc

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
MIB = 1 << 20
NUM_PHASES = 4
INTERVAL_S = 0.1  # workers sample every 100 ms
PRINT_EVERY_TICKS = 5  # one timeline line every 0.5 s
BLOCK_BYTES = 64 * 1024
NUM_LAYERS = 2
NUM_KV_BUFFERS = 2
READY_TIMEOUT_S = 60.0
BAR_WIDTH = 32

# name, letter on the bar, busy phases (0-based), plot colour
ENGINES = [("engine-A", "A", (0, 2), "tab:blue"), ("engine-B", "B", (1, 3), "tab:orange")]


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: stop the workers and leave."""

    def __init__(self, signum: int) -> None:
        """Remember which signal it was."""
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Engine:
    """One worker process and everything it reported."""

    name: str
    letter: str
    busy_phases: tuple[int, ...]
    color: str
    proc: subprocess.Popen[str] | None = None
    ready: bool = False
    started: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)  # tick -> sample
    last_tick: int = -1
    eof: bool = False  # stdout closed
    stderr_eof: bool = False
    returncode: int | None = None


# -- arguments and setup ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of the driver."""
    p = argparse.ArgumentParser(
        description=(
            "Two worker processes share one memory budget elastically: each maps KV-cache memory only "
            "while it is busy, and the idle one's memory goes to the busy one. Prints both processes' "
            "mapped bytes over time and checks that their sum stays within the budget."
        ),
        epilog=(
            "example: python examples/00_two_processes/run.py --budget 256M --duration 12 --plot /tmp/two_proc.png"
        ),
    )
    p.add_argument(
        "--budget",
        default="256M",
        help="memory both processes share, e.g. 256M or 1G (binary units). On the CPU it becomes "
        "KVCACHED_HOST_DEVICE_BYTES; on CUDA the driver leaves only this much GPU memory free "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=12.0,
        help="seconds of the run, split into 4 phases: A busy, B busy, A busy, B busy (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (the default) = cuda when kvcached_core.available_backends() has it and torch sees a GPU, else cpu",
    )
    p.add_argument(
        "--plot", metavar="PATH", default=None, help="also write a PNG of the timeline here (needs matplotlib)"
    )
    p.add_argument(
        "--runtime-dir",
        default=None,
        help="KVCACHED_RUNTIME_DIR for the workers (the host budget's ledger lives there); default: a "
        "fresh temporary directory, so the demo never shares a budget with a real deployment",
    )
    args = p.parse_args(argv)
    try:
        args.budget_bytes = kc.parse_size(args.budget)
    except ValueError as exc:
        p.error(f"--budget: {exc}")
    logical_page = 2 * MIB * NUM_LAYERS * NUM_KV_BUFFERS
    if args.budget_bytes < 4 * logical_page:
        p.error(f"--budget must be at least {4 * logical_page // MIB}M (a few {logical_page // MIB} MiB pages)")
    if not 1.0 <= args.duration <= 600.0:
        p.error("--duration must be between 1 and 600 seconds")
    return args


def resolve_device(choice: str) -> str:
    """'cpu' or 'cuda' for ``--device``; exits with a message when cuda was asked for and is unusable."""
    if choice == "cpu":
        return "cpu"
    reason = kc.cuda_unavailable_reason()
    if not reason:
        import torch  # only here: the CPU path never needs torch in the driver

        if not torch.cuda.is_available():
            reason = f"torch {torch.__version__} sees no CUDA device"
    if not reason:
        return "cuda"
    if choice == "cuda":
        sys.exit(f"run.py: --device cuda is not usable: {reason}")
    return "cpu"


def make_runtime_dir(path: str | None) -> tuple[str, bool]:
    """The workers' runtime directory (mode 0700) and whether it is a temporary one to remove at the end."""
    if path is None:
        return tempfile.mkdtemp(prefix="kvcached-two-proc-"), True  # mkdtemp makes it 0700
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.geteuid():
        sys.exit(f"run.py: --runtime-dir {path} belongs to another user")
    os.chmod(path, 0o700)
    return path, False


def hold_gpu_ballast(budget: int) -> tuple[Any, int]:
    """Allocate GPU memory until only about ``budget`` bytes are free; returns (ballast tensor, free bytes).

    Called after both workers made their CUDA contexts and before they make their managers, so that what
    is left free is what the two KV caches share. The ballast is freed when the driver exits.
    """
    import torch

    free, _total = torch.cuda.mem_get_info()
    grain = 2 * MIB
    size = math.ceil(max(0, free - budget) / grain) * grain
    ballast = None
    while size > 0 and ballast is None:
        try:
            ballast = torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:  # free memory is never quite all allocatable: take a bit less
            size -= 32 * grain
    free_after, _ = torch.cuda.mem_get_info()
    return ballast, free_after


# -- the worker processes --------------------------------------------------------------------------------


def start_engine(engine: Engine, device: str, args: argparse.Namespace, env: dict[str, str]) -> None:
    """Start ``engine``'s worker: an argument list (no shell), its own session (so a Ctrl-C in the
    terminal reaches only the driver, which then stops the workers), pipes for stdin, stdout and stderr."""
    num_blocks = 2 * args.budget_bytes // (BLOCK_BYTES * NUM_LAYERS * NUM_KV_BUFFERS)
    cmd = [
        sys.executable,
        WORKER,
        "--name",
        engine.name,
        "--busy-phases",
        ",".join(str(p) for p in engine.busy_phases),
        "--duration",
        str(args.duration),
        "--device",
        device,
        "--num-blocks",
        str(num_blocks),
        "--block-bytes",
        str(BLOCK_BYTES),
        "--num-layers",
        str(NUM_LAYERS),
        "--num-kv-buffers",
        str(NUM_KV_BUFFERS),
        "--reserved-pages",
        "0",
        "--reclaim-delay-ms",
        "20",
        "--chunk-blocks",
        str(max(4, num_blocks // 128)),  # a full budget in ~64 chunks, whatever its size
        "--interval",
        str(INTERVAL_S),
    ]
    engine.proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
    )


def pump(engine: Engine, stream: IO[str], kind: str, events: queue.Queue[tuple[Engine, str, str]]) -> None:
    """Forward each line of one of ``engine``'s output streams to the main thread; then an 'eof'."""
    for line in stream:
        events.put((engine, kind, line.rstrip("\n")))
    events.put((engine, kind + "-eof", ""))


def stop_engines(engines: list[Engine], grace_s: float = 3.0) -> None:
    """Make sure no worker is left running: close stdin and SIGTERM, then SIGKILL after ``grace_s``."""
    for e in engines:
        if e.proc is None or e.proc.poll() is not None:
            continue
        try:
            if e.proc.stdin is not None:
                e.proc.stdin.close()
        except OSError:
            pass
        e.proc.terminate()
    deadline = time.monotonic() + grace_s
    for e in engines:
        if e.proc is None:
            continue
        try:
            e.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()
        e.returncode = e.proc.returncode


def reap(engine: Engine, t: float) -> None:
    """Wait for a worker whose stdout closed, so that it does not linger as a zombie (the host budget
    counts a zombie's share as still in use until its parent reaps it); report an early or bad exit."""
    assert engine.proc is not None
    try:
        engine.returncode = engine.proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return  # closed stdout but still running: stop_engines() deals with it
    if engine.returncode != 0 or engine.done is None:
        print(f"  ** {engine.name} exited with status {engine.returncode} at t={t:.1f} s", flush=True)


def handle_line(engine: Engine, kind: str, line: str) -> None:
    """Record one line a worker printed (a sample, an event, or stderr text)."""
    if kind == "stderr":
        engine.stderr_tail = (engine.stderr_tail + [line])[-30:]
        print(f"[{engine.name} stderr] {line}", file=sys.stderr)
        return
    try:
        msg = json.loads(line)
    except json.JSONDecodeError:
        engine.errors.append(f"unparsable output line: {line!r}")
        return
    event = msg.get("event")
    if event is None:
        engine.samples[msg["tick"]] = msg
        engine.last_tick = max(engine.last_tick, msg["tick"])
    elif event == "ready":
        engine.ready = True
    elif event == "started":
        engine.started = msg
    elif event == "done":
        engine.done = msg
    elif event == "error":
        engine.errors.append(msg.get("error", "unknown error"))
        print(f"[{engine.name}] error: {msg.get('error')}", file=sys.stderr)


def drain(engines: list[Engine], events: queue.Queue[tuple[Engine, str, str]], timeout: float = 2.0) -> None:
    """After the workers exited: take in what is left in the pipes (a last report, a traceback)."""
    deadline = time.monotonic() + timeout
    while not all(e.eof and e.stderr_eof for e in engines) and time.monotonic() < deadline:
        try:
            engine, kind, line = events.get(timeout=0.05)
        except queue.Empty:
            continue
        if kind == "stdout-eof":
            engine.eof = True
        elif kind == "stderr-eof":
            engine.stderr_eof = True
        else:
            handle_line(engine, kind, line)


def wait_ready(engines: list[Engine], events: queue.Queue[tuple[Engine, str, str]]) -> bool:
    """Wait until every worker printed 'ready' (torch imported, device warmed up); False if one died."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(e.ready for e in engines):
        try:
            engine, kind, line = events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            print(f"run.py: workers not ready after {READY_TIMEOUT_S:.0f} s", file=sys.stderr)
            return False
        if kind == "stdout-eof":
            engine.eof = True
            return False
        if kind == "stderr-eof":
            engine.stderr_eof = True
            continue
        handle_line(engine, kind, line)
    return True


# -- the timeline ----------------------------------------------------------------------------------------


def sample_at(engine: Engine, tick: int) -> dict[str, Any] | None:
    """``engine``'s sample at ``tick``, or its latest one before it."""
    for k in range(tick, -1, -1):
        s = engine.samples.get(k)
        if s is not None:
            return s
    return None


def bar(values: list[int], letters: list[str], budget: int) -> str:
    """A text bar of the budget: each engine's share as its letter, '.' for free, '!' past the budget."""
    cells = ""
    for value, letter in zip(values, letters, strict=True):
        cells += letter * round(value / budget * BAR_WIDTH)
    if len(cells) > BAR_WIDTH:
        return "|" + cells[:BAR_WIDTH] + "|" + "!" * (len(cells) - BAR_WIDTH)
    return "|" + cells + "." * (BAR_WIDTH - len(cells)) + "|"


def secs(x: float) -> str:
    """Seconds with one decimal, or two where one would round (phases of 7 s / 4 = 1.75 s)."""
    return f"{x:.1f}" if abs(x * 10 - round(x * 10)) < 1e-6 else f"{x:.2f}"


def row_phase(t: float, duration: float) -> int:
    """Phase a timeline row belongs to: a sample taken exactly at a phase change still shows the phase
    that just ended (the engines switch right after it)."""
    return phase_of(max(0.0, t - 1e-6), duration)


def phase_banner(engines: list[Engine], phase: int, duration: float) -> str:
    """A separator line naming the phase, its span and who is busy."""
    phase_len = duration / NUM_PHASES
    busy = next(e for e in engines if phase in e.busy_phases)
    idle = ", ".join(e.name for e in engines if e is not busy)
    return (
        f"  -- phase {phase + 1} ({secs(phase * phase_len)}-{secs((phase + 1) * phase_len)} s): "
        f"{busy.name} busy, {idle} idle --"
    )


def timeline_header(engines: list[Engine]) -> str:
    """Column titles of the timeline."""
    names = "".join(f"{e.name:>10}" for e in engines)
    letters = ", ".join(f"{e.letter}={e.name}" for e in engines)
    return f"{'t[s]':>5}{names}{'sum':>9}{'budget':>8}  (MiB mapped; bar: {letters})"


def timeline_line(engines: list[Engine], tick: int, budget: int) -> str:
    """One line of the timeline at ``tick``."""
    values = []
    cols = ""
    for e in engines:
        if e.eof and tick > e.last_tick:  # the process is gone (and reaped): it holds nothing
            values.append(0)
            cols += f"{'exited':>10}"
            continue
        s = sample_at(e, tick)
        values.append(s["mapped_bytes"] if s else 0)
        cols += f"{values[-1] / MIB:>10.0f}"
    t = tick * INTERVAL_S
    total = sum(values)
    letters = [e.letter for e in engines]
    return f"{t:>5.1f}{cols}{total / MIB:>9.0f}{budget / MIB:>8.0f}  {bar(values, letters, budget)}"


# -- the summary -----------------------------------------------------------------------------------------


def common_ticks(engines: list[Engine]) -> list[int]:
    """Ticks at which every engine sampled (the same instant on the common clock, to within jitter)."""
    ticks = set(engines[0].samples)
    for e in engines[1:]:
        ticks &= set(e.samples)
    return sorted(ticks)


def phase_of(t: float, duration: float) -> int:
    """Phase index (0..3) of time ``t``."""
    return min(int(t / (duration / NUM_PHASES)), NUM_PHASES - 1)


def peak_in_phase(engine: Engine, phase: int, duration: float) -> tuple[int, float]:
    """(peak mapped bytes, time of the peak) of ``engine`` during ``phase``."""
    best = (0, phase * duration / NUM_PHASES)
    for s in engine.samples.values():
        if 0 <= s["t"] < duration and phase_of(s["t"], duration) == phase and s["mapped_bytes"] > best[0]:
            best = (s["mapped_bytes"], s["t"])
    return best


def summarize(engines: list[Engine], budget: int, duration: float) -> list[str]:
    """Print the summary; returns the failed checks (empty when all passed)."""
    failures: list[str] = []
    print("\nSummary")
    for e in engines:
        peak = max(e.samples.values(), key=lambda s: s["mapped_bytes"], default=None)
        misses = e.done["alloc_misses"] if e.done else (peak or {}).get("alloc_misses", "?")
        where = f" at t={peak['t']:.1f} s" if peak else ""
        checks = f"{e.done['checks']} block read-backs, {e.done['mismatches']} mismatches" if e.done else "no report"
        print(
            f"  {e.name}: peak mapped {(peak or {}).get('mapped_bytes', 0) / MIB:.0f} MiB{where}; "
            f"{misses} alloc() misses (budget full); {checks}; exit status {e.returncode}"
        )

    ticks = common_ticks(engines)
    sums = [(sum(e.samples[k]["mapped_bytes"] for e in engines), k) for k in ticks]
    peak_sum, peak_tick = max(sums, key=lambda x: (x[0], -x[1]), default=(0, 0))
    over = [(s, k) for s, k in sums if s > budget]
    verdict = "within" if not over else "OVER"
    print(
        f"  peak of the sum: {peak_sum / MIB:.0f} MiB at t={peak_tick * INTERVAL_S:.1f} s, "
        f"{verdict} the budget of {budget / MIB:.0f} MiB ({len(ticks)} common samples)"
    )
    for s, k in over[:5]:
        parts = ", ".join(f"{e.name} {e.samples[k]['mapped_bytes'] / MIB:.0f}" for e in engines)
        failures.append(f"sum of mapped bytes {s / MIB:.0f} MiB > budget at t={k * INTERVAL_S:.1f} s ({parts})")

    # Memory moving between the engines: in each phase after the first, the busy engine should map more
    # than the budget minus what the other engine had at its peak in the phase before. If it does, part of
    # what it mapped is memory the other one gave back.
    phase_len = duration / NUM_PHASES
    for phase in range(NUM_PHASES):
        busy = next(e for e in engines if phase in e.busy_phases)
        other = next(e for e in engines if e is not busy)
        peak, at = peak_in_phase(busy, phase, duration)
        start = phase * phase_len
        tick = round(at / INTERVAL_S)
        then = sample_at(other, tick) or {"mapped_bytes": 0, "pool_bytes": 0}
        if other.eof and tick > other.last_tick:
            other_now = f"{other.name} had exited by t={at:.1f} s"
        else:
            other_now = (
                f"{other.name}: {then['mapped_bytes'] / MIB:.0f} MiB mapped "
                f"+ {then['pool_bytes'] / MIB:.0f} MiB in its page pool at t={at:.1f} s"
            )
        if busy.eof and start / INTERVAL_S > busy.last_tick:
            print(f"  phase {phase + 1}: {busy.name} had exited before its busy phase")
            continue  # the exit itself is reported as a failure below
        head = (
            f"  phase {phase + 1} ({secs(start)}-{secs(start + phase_len)} s, {busy.letter} busy): "
            f"{busy.name} reached {peak / MIB:.0f} MiB at t={at:.1f} s"
        )
        if phase == 0:
            print(f"{head} ({other_now})")
            continue
        other_peak, _ = peak_in_phase(other, phase - 1, duration)
        room = budget - other_peak  # all the busy engine could have had if the other had kept its memory
        if peak <= room:
            print(f"{head} ({other_now})")
            failures.append(
                f"phase {phase + 1}: {busy.name} reached only {peak / MIB:.0f} MiB although {other.name} "
                f"(peak {other_peak / MIB:.0f} MiB in phase {phase}) went idle: its memory did not move"
            )
            continue
        first = min(
            (s["t"] for s in busy.samples.values() if start <= s["t"] and s["mapped_bytes"] > room),
            default=at,
        )
        print(f"{head} after {other.name} released its memory")
        print(f"      {other_now}; in phase {phase} it had {other_peak / MIB:.0f} MiB mapped")
        print(
            f"      {other_peak / MIB:.0f} + {peak / MIB:.0f} MiB > {budget / MIB:.0f} MiB budget: at least "
            f"{(peak - room) / MIB:.0f} MiB of {busy.name}'s memory was {other.name}'s before"
        )
        print(
            f"      {busy.name} was above {room / MIB:.0f} MiB (the budget minus {other.name}'s peak) "
            f"{first - start:.1f} s into the phase"
        )

    for e in engines:
        if e.returncode != 0:
            failures.append(f"{e.name} exited with status {e.returncode}")
        if e.done is None:
            failures.append(f"{e.name} printed no final report (crashed?)")
        else:
            if e.done["mismatches"]:
                failures.append(
                    f"{e.name}: {e.done['mismatches']} blocks read back wrong: {e.done['mismatch_details']}"
                )
            left = e.done.get("mapped_bytes_after_release")
            if left:
                failures.append(f"{e.name}: {left / MIB:.0f} MiB still mapped 2 s after freeing every block")
        failures.extend(f"{e.name}: {msg}" for msg in e.errors)
    return failures


def write_plot(path: str, engines: list[Engine], budget: int, duration: float, device: str) -> None:
    """Draw mapped MiB of both engines over time, the budget, and the busy phases, into a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    phase_len = duration / NUM_PHASES
    top = budget / MIB * 1.18
    for e in engines:
        for phase in e.busy_phases:
            ax.axvspan(phase * phase_len, (phase + 1) * phase_len, color=e.color, alpha=0.08, lw=0)
            ax.text(
                (phase + 0.5) * phase_len,
                top * 0.955,
                f"{e.letter} busy",
                ha="center",
                va="center",
                color=e.color,
                fontsize=9,
            )
    for e in engines:
        pts = sorted(e.samples.values(), key=lambda s: s["t"])
        ax.plot(
            [s["t"] for s in pts],
            [s["mapped_bytes"] / MIB for s in pts],
            color=e.color,
            lw=2,
            label=f"{e.name} mapped",
        )
    ticks = common_ticks(engines)
    ax.plot(
        [k * INTERVAL_S for k in ticks],
        [sum(e.samples[k]["mapped_bytes"] for e in engines) / MIB for k in ticks],
        color="0.45",
        lw=1,
        ls=":",
        label="sum",
    )
    ax.axhline(budget / MIB, color="tab:red", ls="--", lw=1.3, label=f"budget {budget / MIB:.0f} MiB")
    ax.set_xlim(0, duration)
    ax.set_ylim(0, top)
    ax.set_xlabel("time since start [s]")
    ax.set_ylabel("mapped memory [MiB]")
    where = "host budget" if device == "cpu" else "free GPU memory"
    ax.set_title(f"kvcached: two processes sharing {budget / MIB:.0f} MiB of {where}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize=9, frameon=False)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot written to {path}")


# -- main ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, engines: list[Engine], runtime_dir: str) -> int:
    """Start the workers, follow them to the end and summarize; the exit status."""
    device = resolve_device(args.device)
    budget = args.budget_bytes
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=runtime_dir, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["KVCACHED_HOST_DEVICE_BYTES"] = str(budget)
    else:
        env.pop("KVCACHED_HOST_DEVICE_BYTES", None)  # the GPU is the shared device

    events: queue.Queue[tuple[Engine, str, str]] = queue.Queue()
    for e in engines:
        start_engine(e, device, args, env)
        assert e.proc is not None and e.proc.stdout is not None and e.proc.stderr is not None
        for stream, kind in ((e.proc.stdout, "stdout"), (e.proc.stderr, "stderr")):
            threading.Thread(target=pump, args=(e, stream, kind, events), daemon=True).start()

    print(f"device: {device}; budget {budget / MIB:.0f} MiB; runtime dir {runtime_dir}")
    print(f"starting {', '.join(e.name for e in engines)} (pids {', '.join(str(e.proc.pid) for e in engines)})")
    if not wait_ready(engines, events):
        stop_engines(engines)
        drain(engines, events)
        print("run.py: a worker failed to start (its stderr is above)", file=sys.stderr)
        return 1

    ballast = None
    if device == "cuda":
        ballast, free_after = hold_gpu_ballast(budget)
        if abs(free_after - budget) >= MIB:
            print(
                f"note: {free_after / MIB:.0f} MiB of GPU memory is free, not {budget / MIB:.0f} MiB; "
                "that is the budget now"
            )
        budget = free_after  # what the GPU really has left for the two engines
        held = ballast.numel() / MIB if ballast is not None else 0
        print(f"holding {held:.0f} MiB of GPU memory as ballast: {free_after / MIB:.0f} MiB left free to share")

    start = time.monotonic() + 0.5  # time for the workers to make their managers
    for e in engines:
        assert e.proc is not None and e.proc.stdin is not None
        e.proc.stdin.write(f"{start!r}\n")
        e.proc.stdin.flush()

    phase_len = args.duration / NUM_PHASES
    plan = "; ".join(
        f"{e.letter} busy in "
        + ", ".join(f"{secs(p * phase_len)}-{secs((p + 1) * phase_len)} s" for p in e.busy_phases)
        for e in engines
    )
    print(f"phases of {secs(phase_len)} s: {plan}\n")
    print(timeline_header(engines))

    deadline = start + args.duration + 20.0
    next_print = 0
    shown_phase = -1
    while not all(e.eof for e in engines):
        try:
            engine, kind, line = events.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() > deadline:
                print("run.py: workers did not finish in time; stopping them", file=sys.stderr)
                for e in engines:
                    if not e.eof:
                        e.errors.append("did not finish in time (hung?)")
                break
            continue
        if kind == "stdout-eof":
            engine.eof = True
            reap(engine, time.monotonic() - start)
        elif kind == "stderr-eof":
            engine.stderr_eof = True
        else:
            handle_line(engine, kind, line)
        # Print every 0.5 s of the timeline once every engine has reported that far (or has finished).
        horizon = min(e.last_tick if not e.eof else 10**9 for e in engines)
        last = round(args.duration / INTERVAL_S)
        while next_print <= min(horizon, last) and any(e.samples for e in engines):
            phase = row_phase(next_print * INTERVAL_S, args.duration)
            if phase != shown_phase:
                print(phase_banner(engines, phase, args.duration))
                shown_phase = phase
            print(timeline_line(engines, next_print, budget))
            next_print += PRINT_EVERY_TICKS
    stop_engines(engines)
    drain(engines, events)
    del ballast

    s = engines[0].started
    if s:
        print(
            f"\neach engine: {s['num_blocks']} blocks, virtual capacity {s['virtual_bytes'] / MIB:.0f} MiB "
            f"(twice the budget), mapped in pages of {s['logical_page_bytes'] / MIB:.0f} MiB "
            f"({NUM_LAYERS} layers x {NUM_KV_BUFFERS} KV buffers x {s['page_bytes'] / MIB:.0f} MiB)"
        )
    failures = summarize(engines, budget, args.duration)
    if args.plot:
        write_plot(args.plot, engines, budget, args.duration, device)
    if failures:
        print("\nFAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("\nOK: the sum stayed within the budget and memory moved between the processes")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: set up, run, and always stop the workers and remove a temporary runtime directory."""
    args = parse_args(argv)
    engines = [Engine(name, letter, phases, color) for name, letter, phases, color in ENGINES]
    runtime_dir, created = make_runtime_dir(args.runtime_dir)

    def on_signal(signum: int, _frame: object) -> None:
        """Turn the signal into an exception, so that the ``finally`` below stops the workers."""
        raise Interrupted(signum)

    # SIGINT too: a shell that starts the demo in the background makes it ignore SIGINT otherwise.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        return run(args, engines, runtime_dir)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"\nrun.py: interrupted ({signal.Signals(signum).name}); stopping the workers", file=sys.stderr)
        return 128 + signum
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # finish the clean-up even on a second Ctrl-C
        stop_engines(engines)
        if created:
            shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
