"""A bounded fuzz pass over the readers of files other processes can write: control segments (random bytes,
random truncations and byte flips of a real live segment) and the host budget ledger (random slots under a
valid header). Each pass runs in a child process, so a crash is a signal the test sees, not a lost run; the
readers must answer with a value or a SegmentError/BackendError, and a damaged ledger must never grant memory
beyond its budget. ``KVCACHED_FUZZ_CASES`` sets the number of cases per pass (default 3000: a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CASES = int(os.environ.get("KVCACHED_FUZZ_CASES", "3000"))

SEGMENTS = textwrap.dedent(
    """
    import os, random, sys
    import kvcached_core as kc
    from kvcached_core import _native
    runtime, cases, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = kc.load_settings({}, runtime_dir=runtime)
    m = kc.KVCacheManager(64, 4096, 1, 2, name="fuzzed", settings=s)
    seg_dir = os.path.join(runtime, "segments")
    good = open(os.path.join(seg_dir, os.listdir(seg_dir)[0]), "rb").read()
    rng = random.Random(seed)
    path = os.path.join(seg_dir, "fuzz.seg")
    outcomes = {"read": 0, "refused": 0}
    for _ in range(cases):
        kind = rng.randrange(3)
        if kind == 0:
            data = rng.randbytes(rng.randrange(2 * len(good)))
        elif kind == 1:
            data = good[: rng.randrange(len(good) + 1)]
        else:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 16)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
        try:
            _native.read_segment(path)
            outcomes["read"] += 1
        except _native.SegmentError:
            outcomes["refused"] += 1
    from kvcached_core import kvctl
    assert kvctl.main(["--runtime-dir", runtime, "list", "--json"]) == 0
    m.close()
    print("OUTCOMES", outcomes["read"], outcomes["refused"], flush=True)
    """
)

LEDGER = textwrap.dedent(
    """
    import os, random, struct, sys
    import kvcached_core as kc
    runtime, cases, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    budget = 64 << 20
    header = struct.pack("<QII", 0x4B5643484F535442, 1, 256)
    live = [1, os.getppid()]  # processes that are alive whatever happens here
    granted_beyond = 0
    for case in range(cases // 100):
        runtime_case = os.path.join(runtime, str(case))
        os.makedirs(runtime_case, mode=0o700)
        slots = []
        for _ in range(256):
            pid = rng.choice([0, 0, 0, rng.choice(live), rng.randrange(-2**31, 2**31)])
            held = rng.choice([0, rng.randrange(1 << 30), 2**64 - 1, rng.randrange(2**64)])
            slots.append([pid, rng.choice([0, rng.randrange(2**64)]), held])
        if rng.random() < 0.5:  # live claims whose 64-bit sum wraps around to almost nothing
            claims = sum(held for pid, start, held in slots[1:] if pid in live and start == 0)
            slots[0] = [1, 0, (2**64 - claims % 2**64 + rng.randrange(budget // 2)) % 2**64]
        raw = header + b"".join(struct.pack("<iIQQ", pid, 0, start, held) for pid, start, held in slots)
        if rng.random() < 0.2:
            raw = rng.randbytes(len(raw))  # a foreign file: started over
        path = os.path.join(runtime_case, "host-device.ledger")
        with open(path, "wb") as f:
            f.write(raw)
        os.chmod(path, 0o600)
        s = kc.load_settings({}, runtime_dir=runtime_case, host_device_bytes=budget, reclaim_delay_ms=0)
        try:
            m = kc.KVCacheManager(16, 1 << 20, 1, 1, device="cpu", name=f"l{case}", settings=s, reserved_pages=0,
                                  pool_target=0)
        except RuntimeError:
            continue  # no free slot (every slot names a live process): refused, as it must be
        ids = m.alloc(16)
        if ids is not None:  # granted: then what live slots claim must leave room for it
            with open(path, "rb") as f:
                data = f.read()
            others = 0
            for i in range(256):
                pid, _, start, held = struct.unpack_from("<iIQQ", data, 16 + 24 * i)
                if pid in live and pid != os.getpid() and start == 0:
                    others += held
            if others + (16 << 20) > budget:
                granted_beyond += 1
        m.close()
    print("GRANTED_BEYOND", granted_beyond, flush=True)
    """
)


def run(code: str, tmp_path, seed: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "rt"), str(CASES), str(seed)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a negative one is a signal)\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("seed", [1, 2])
def test_segment_reader_survives_random_and_truncated_files(tmp_path, seed):
    (tmp_path / "rt").mkdir(mode=0o700)
    out = run(SEGMENTS, tmp_path, seed)
    read, refused = map(int, out.split("OUTCOMES")[1].split())
    assert read + refused == CASES and refused > CASES // 2  # nearly every damaged file is refused


@pytest.mark.parametrize("seed", [1, 2])
def test_a_damaged_ledger_never_grants_memory_beyond_its_budget(tmp_path, seed):
    (tmp_path / "rt").mkdir(mode=0o700)
    out = run(LEDGER, tmp_path, seed)
    assert out.split("GRANTED_BEYOND")[1].split() == ["0"]
