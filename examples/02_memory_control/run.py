"""Memory control with kvctl and kvtop: cap a busy engine, watch the other one take the memory.

Two worker processes, engine-A and engine-B, burst against one shared budget (each allocates KV blocks
until ``alloc()`` returns None, frees the oldest half, and repeats), so each gets roughly half of it.
A third of the way in, the driver runs ``kvctl limit engine-A CAP``: engine-A is above the cap, so the
limit is deferred (no new allocation) until its own frees bring it under; engine-B takes what engine-A
gave back. Two thirds of the way in, ``kvctl limit engine-A none`` lifts the cap and engine-A grows again.
``kvtop --once`` shows each state. The driver samples both instances' mapped bytes at 20 Hz from their
control segments (the rows ``kvctl list --json`` prints), checks what happened and can plot it.

Exit status: 0 when every check passed, 1 when one failed, 128 + the signal number when interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import kvcached_core as kc
from kvcached_core import control
from kvcached_core.segment import segment_dir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from demo_device import hold_gpu_ballast, resolve_device  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20
NAMES = ("engine-A", "engine-B")  # engine-A is the one that gets capped
COLORS = {"engine-A": "tab:blue", "engine-B": "tab:orange"}
BLOCK_BYTES = 64 * 1024  # per buffer; 2 layers x K/V = 256 KiB a block, 8 MiB logical pages
SAMPLE_S = 0.05
STATES = ("deferred", "applied")  # limit_status while above the limit, then once under it


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options of the driver."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python examples/02_memory_control/run.py --plot /tmp/memory_control.png",
    )
    p.add_argument("--budget", default="512M", help="memory both engines share (default: %(default)s)")
    p.add_argument("--cap", default="128M", help="the limit kvctl puts on engine-A (default: %(default)s)")
    p.add_argument(
        "--duration",
        type=float,
        default=12.0,
        help="seconds of bursting; the cap comes at 1/3 of it, the lift at 2/3 (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (the default): cuda when kvcached_core.available_backends() has it and torch sees a GPU, else "
        "cpu. On cpu the budget is a host budget (KVCACHED_HOST_DEVICE_BYTES); on cuda the driver holds all "
        "other free GPU memory as ballast",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG of both engines' mapped memory over time")
    p.add_argument(
        "--converge-within",
        type=float,
        default=2.0,
        metavar="S",
        help="engine-A must be under the cap this many seconds after kvctl (default: %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        args.budget_bytes, args.cap_bytes = kc.parse_size(args.budget), kc.parse_size(args.cap)
    except ValueError as exc:
        p.error(str(exc))
    if not 0 < args.cap_bytes < args.budget_bytes // 2:
        p.error("--cap must be positive and below half the budget (or capping changes nothing)")
    if not 6.0 <= args.duration <= 120.0:
        p.error("--duration must be between 6 and 120 seconds")
    return args


def cli(tool: str) -> list[str]:
    """The argv prefix of the kvctl or kvtop console script installed next to this Python."""
    path = os.path.join(os.path.dirname(sys.executable), tool)
    return [path] if os.access(path, os.X_OK) else [sys.executable, "-m", f"kvcached_core.{tool}"]


@dataclass
class Timeline:
    """Samples of the control segments plus the moments the driver acted (driver clock, t=0 at go)."""

    start: float
    samples: list[tuple[float, dict[str, dict]]] = field(default_factory=list)  # (t, name -> row)
    events: dict[str, float] = field(default_factory=dict)  # "cap"/"capped"/"lift"/"lifted" -> t
    next_print: float = 0.0  # when wait_until prints its next status line
    stop: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.start

    def poll(self, settings: kc.Settings) -> None:
        """Read every live segment at 20 Hz (what `kvctl list --json` prints) until stopped."""
        while not self.stop.wait(SAMPLE_S - (self.now() % SAMPLE_S)):
            table = {r["name"]: r for r in control.instances(settings) if r["name"] in NAMES}
            self.samples.append((self.now(), table))

    def latest(self) -> dict[str, dict]:
        """The newest sample's rows."""
        return self.samples[-1][1] if self.samples else {}

    def mapped(self, name: str, t0: float = 0.0, t1: float = float("inf")) -> list[tuple[float, int]]:
        """(t, mapped bytes) of ``name`` for samples in [t0, t1)."""
        return [(t, s[name]["mapped_bytes"]) for t, s in self.samples if t0 <= t < t1 and name in s]


def run_tool(argv: list[str], title: str) -> int:
    """Run a CLI (argument list, no shell), print the command and its indented output; its exit status."""
    print(f"$ {title}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        print("    (killed after 30 s)")
        return 1
    for line in (done.stdout + done.stderr).rstrip().splitlines():
        print(f"    {line}".rstrip())
    if done.returncode:
        print(f"    (exit status {done.returncode})")
    return done.returncode


def wait_until(tl: Timeline, t: float, procs: list[subprocess.Popen[str]]) -> None:
    """Sleep until ``t``, printing both engines' mapped memory once a second; raises if a worker died."""
    while (now := tl.now()) < t:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker exited early (see its message above)")
        if now >= tl.next_print and tl.samples:
            tl.next_print = math.floor(now) + 1.0
            at, latest = tl.samples[-1]
            cols = "  ".join(f"{n} {latest[n]['mapped_bytes'] / MIB:4.0f} MiB" for n in NAMES if n in latest)
            a = latest.get(NAMES[0], {})
            limit = "none"
            if a.get("limit_bytes") is not None:
                limit = f"{kc.format_bytes(a['limit_bytes'])} ({a['limit_status']})"
            print(f"  t={at:5.2f} s  {cols}   engine-A limit: {limit}")
        time.sleep(min(0.02, t - now))


def start_workers(procs: list[subprocess.Popen[str]], device: str, budget: int, env: dict[str, str]) -> None:
    """Start both workers into ``procs`` (argument lists; own sessions: a terminal Ctrl-C reaches only the
    driver, which stops them) and wait until both have made their managers."""
    for name, hold in zip(NAMES, ("0.25", "0.3"), strict=True):  # slightly different rhythms
        argv = [sys.executable, os.path.join(HERE, "worker.py"), "--name", name, "--device", device]
        argv += ["--num-blocks", str(2 * budget // (4 * BLOCK_BYTES)), "--block-bytes", str(BLOCK_BYTES)]
        argv += ["--hold-s", hold]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        procs.append(subprocess.Popen(argv, **pipes, text=True, env=env, start_new_session=True))
    for name, p in zip(NAMES, procs, strict=True):
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{name} failed to start (see its message above)")


def stop_workers(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Close the workers' stdin (they free, close and exit), SIGTERM/SIGKILL stragglers; their last lines."""
    last = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                out, _ = p.communicate(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
        except ValueError:  # interrupted mid-communicate earlier: the pipes are half closed
            p.kill()
            p.wait()
            out = ""
        last.append((out or "").strip().rpartition("\n")[2])
    return last


def converge_time(tl: Timeline, cap: int) -> tuple[float | None, list[tuple[float, int]]]:
    """Seconds from the cap command to engine-A's first sample at or under the cap, and the samples
    above the cap after that one and before the lift command."""
    capped = tl.mapped(NAMES[0], tl.events["cap"], tl.events["lift"])
    first = next((t for t, m in capped if m <= cap), None)
    if first is None:
        return None, []
    return first - tl.events["cap"], [(t, m) for t, m in capped if t > first and m > cap]


def mean(values: list[tuple[float, int]]) -> float:
    """Mean of the byte values."""
    return sum(m for _, m in values) / max(1, len(values))


def summarize(tl: Timeline, args: argparse.Namespace, budget: int) -> list[str]:
    """Print the checks; returns the failed ones."""
    cap, (a, b), ev, failures = args.cap_bytes, NAMES, tl.events, []
    print("\nSummary")
    ran = ev["capped"] - ev["cap"]
    print(f"  `kvctl limit {a} {args.cap}` started at t={ev['cap']:.2f} s, returned (acknowledged) {ran:.2f} s later")
    took, over = converge_time(tl, cap)
    if took is None:
        failures.append(f"{a} never got under the cap of {cap / MIB:.0f} MiB")
    else:
        print(f"  {a} at or under {cap / MIB:.0f} MiB {took:.2f} s after it started (allowed {args.converge_within} s)")
        if took > args.converge_within:
            failures.append(f"{a} took {took:.2f} s to get under the cap (more than {args.converge_within} s)")
    if over:
        t, m = over[0]
        failures.append(f"{a} above the cap again: {len(over)} samples, first {m / MIB:.0f} MiB at {t:.2f}")
    elif took is not None:
        n = len(tl.mapped(a, ev["cap"] + took, ev["lift"]))
        print(f"  {a} stayed at or under the cap until the lift at t={ev['lift']:.2f} s ({n} samples)")

    # What the control plane published about the limit: the cap from kvctl's answer to the lift, then none.
    a_rows = [(t, s[a]) for t, s in tl.samples if a in s]
    wrong = [t for t, r in a_rows if ev["capped"] <= t < ev["lift"] and r["limit_bytes"] != cap]
    wrong += [t for t, r in a_rows if t >= ev["lifted"] and r["limit_bytes"] is not None]
    if wrong:
        failures.append(f"the segment showed a wrong limit on {a} at {len(wrong)} samples, first t={wrong[0]:.2f} s")
    seen = {st: next((t for t, r in a_rows if t >= ev["cap"] and r["limit_status"] == st), None) for st in STATES}
    if seen["applied"] is None or seen["applied"] >= ev["lift"]:
        failures.append(f"the limit on {a} never went from deferred to applied before the lift")
    else:
        print("  kvctl list rows for the limit: " + ", ".join(f"{st} from t={t:.2f} s" for st, t in seen.items() if t))

    settle = ev["cap"] + (took or 0.0)
    before, during = tl.mapped(b, 1.0, ev["cap"]), tl.mapped(b, settle, ev["lift"])
    peak0, peak1 = max((m for _, m in before), default=0), max((m for _, m in during), default=0)
    print(
        f"  {b}: mean {mean(before) / MIB:.0f} MiB (peak {peak0 / MIB:.0f}) from t=1 s to the cap, "
        f"mean {mean(during) / MIB:.0f} MiB (peak {peak1 / MIB:.0f}) while {a} was under it"
    )
    if not mean(during) > mean(before):
        failures.append(f"{b} did not grow while {a} was capped")

    after = tl.mapped(a, ev["lifted"])
    t_peak, peak = max(after, key=lambda x: x[1], default=(0.0, 0))
    print(f"  {a} after the lift: mean {mean(after) / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB at t={t_peak:.2f} s")
    if not peak > cap:
        failures.append(f"{a} did not grow above the old cap after the lift")
    sums = [sum(r["mapped_bytes"] for r in s.values()) for _, s in tl.samples]
    print(f"  peak of the sum: {max(sums, default=0) / MIB:.0f} MiB (budget {budget / MIB:.0f} MiB)")
    return failures


def write_plot(path: str, tl: Timeline, args: argparse.Namespace, budget: int, device: str) -> None:
    """Mapped MiB of both engines over time, the kvctl moments as vertical lines, the cap as a segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    top = budget / MIB * 1.2
    for name in NAMES:
        pts = tl.mapped(name)
        ax.plot([t for t, _ in pts], [m / MIB for _, m in pts], color=COLORS[name], lw=1.8, label=f"{name} mapped")
    ax.axhline(budget / MIB, color="tab:red", ls="--", lw=1.2, label=f"shared budget {budget / MIB:.0f} MiB")
    ev = tl.events
    cap = args.cap_bytes / MIB  # the limit, from kvctl's acknowledgement to the lift's
    ax.hlines(cap, ev["capped"], ev["lifted"], color="black", lw=2.5, label=f"engine-A limit {args.cap}")
    for key, text in (("cap", f"kvctl limit engine-A {args.cap}"), ("lift", "kvctl limit engine-A none")):
        ax.axvline(ev[key], color="0.3", lw=1, ls=":")
        ax.text(ev[key] + 0.08, top * 0.97, text, va="top", fontsize=9, color="0.2")
    took, _ = converge_time(tl, args.cap_bytes)
    if took is not None:
        ax.annotate(
            f"engine-A \u2264 limit {took:.2f} s after kvctl started",
            xy=(ev["cap"] + took, cap),
            xytext=(ev["cap"] + took + 0.4, cap * 0.25),
            fontsize=9,
            arrowprops={"arrowstyle": "->", "color": "0.3"},
        )
    ax.set_xlim(0, tl.samples[-1][0] if tl.samples else args.duration)
    ax.set_ylim(0, top)
    ax.set_xlabel("time [s]")
    ax.set_ylabel("mapped memory [MiB]")
    ax.set_title(f"kvctl caps engine-A; engine-B takes the freed memory ({device})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=9, frameon=False)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot written to {path}")


def script(tl: Timeline, args: argparse.Namespace, procs: list[subprocess.Popen[str]], runtime_dir: str) -> int:
    """The operator's part: kvtop, cap engine-A while it is busy, kvtop, lift, kvtop; kvctl's exit status."""
    kvctl, kvtop, where = cli("kvctl"), cli("kvtop"), ["--runtime-dir", runtime_dir]
    d, a, ev = args.duration, NAMES[0], tl.events
    wait_until(tl, d / 3 - 0.5, procs)
    run_tool(kvtop + where + ["--once"], "kvtop --once")
    wait_until(tl, d / 3, procs)
    while tl.latest().get(a, {}).get("mapped_bytes", 0) <= args.cap_bytes and tl.now() < d / 3 + 2:
        time.sleep(0.01)  # cap engine-A while it is busy (above the cap)
    ev["cap"] = tl.now()
    status = run_tool(kvctl + where + ["limit", a, args.cap], f"kvctl limit {a} {args.cap}")
    ev["capped"] = tl.now()
    run_tool(kvtop + where + ["--once"], "kvtop --once")  # most likely still above: '*' = deferred
    wait_until(tl, ev["cap"] + 1.5, procs)
    run_tool(kvtop + where + ["--once"], "kvtop --once")
    wait_until(tl, 2 * d / 3, procs)
    ev["lift"] = tl.now()
    status |= run_tool(kvctl + where + ["limit", a, "none"], f"kvctl limit {a} none")
    ev["lifted"] = tl.now()
    wait_until(tl, ev["lift"] + 1.5, procs)
    run_tool(kvtop + where + ["--once"], "kvtop --once")
    wait_until(tl, d, procs)
    return status


def leftovers(runtime_dir: str, segments: str) -> list[str]:
    """What is left of the engines after they stopped: live rows in `kvctl list --json`, segment files."""
    argv = cli("kvctl") + ["--runtime-dir", runtime_dir, "list", "--json"]
    listed = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    live = [r["name"] for r in json.loads(listed.stdout or "[]") if r["name"] in NAMES]
    files = [f for f in os.listdir(segments) if f.endswith(".seg")]
    print(f"  after stopping: kvctl list shows {live or 'none of them'}; segment files left: {len(files)}")
    if live or files or listed.returncode:
        return [f"left behind: live {live}, segment files {files}, kvctl list exit status {listed.returncode}"]
    return []


def run(args: argparse.Namespace, runtime_dir: str, procs: list[subprocess.Popen[str]]) -> int:
    """Start the workers, run the script, check, plot; the exit status (main stops the workers on errors)."""
    device = resolve_device(args.device)
    budget = args.budget_bytes
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=runtime_dir, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["KVCACHED_HOST_DEVICE_BYTES"] = str(budget)  # one host budget for every process using runtime_dir
    else:
        env.pop("KVCACHED_HOST_DEVICE_BYTES", None)  # the GPU is the shared device
    print(f"device {device}; budget {budget / MIB:.0f} MiB; runtime dir {runtime_dir}")
    start_workers(procs, device, budget, env)
    ballast = None
    if device == "cuda":  # leave only the budget free on the GPU, as examples/00_two_processes does
        ballast, budget = hold_gpu_ballast(budget)
        print(f"GPU ballast held: {budget / MIB:.0f} MiB left free for the two engines")
    settings = control.settings_for(runtime_dir)
    segments = segment_dir(settings)

    tl = Timeline(start=time.monotonic())
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    sampler = threading.Thread(target=tl.poll, args=(settings,), daemon=True)
    sampler.start()
    print(f"{', '.join(NAMES)} bursting (pids {', '.join(str(p.pid) for p in procs)})")
    try:
        status = script(tl, args, procs, runtime_dir)
    finally:
        tl.stop.set()
        sampler.join()
    for line in stop_workers(procs):
        print(f"  worker done: {line}")
    del ballast

    failures = summarize(tl, args, budget)
    if status:
        failures.append("a kvctl command failed (its output is above)")
    failures += [f"{n} exited with status {p.returncode}" for n, p in zip(NAMES, procs, strict=True) if p.returncode]
    failures += leftovers(runtime_dir, segments)
    if args.plot:
        write_plot(args.plot, tl, args, budget, device)
    if failures:
        print("\nFAILED:\n" + "\n".join(f"  - {f}" for f in failures))
        return 1
    print("\nOK: the cap took hold, engine-B grew into the freed memory, engine-A grew again after the lift")
    return 0


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: stop the workers and leave with 128 + its number."""

    def __init__(self, signum: int) -> None:
        """Remember the signal."""
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, and always stop the workers and remove the private runtime directory."""
    args = parse_args(argv)
    runtime_dir = tempfile.mkdtemp(prefix="kvcached-control-")  # 0700: a private budget and segments
    procs: list[subprocess.Popen[str]] = []

    def on_signal(signum: int, _frame: object) -> None:
        """Raise, so that ``finally`` below stops the workers (SIGINT too: a background job ignores it)."""
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        return run(args, runtime_dir, procs)
    except Interrupted as exc:
        print(f"\nrun.py: interrupted ({exc}); stopping the workers", file=sys.stderr)
        return 128 + exc.signum
    except RuntimeError as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # finish the clean-up even on a second Ctrl-C
        stop_workers([p for p in procs if p.returncode is None])
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
