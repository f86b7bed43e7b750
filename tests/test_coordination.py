"""What engines on one device tell each other without a server: the start-up lock (one start-up at a time)
and the pressure record (an engine short of memory says so). Real processes, real files in a runtime
directory of the test's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from kvcached_core import load_settings
from kvcached_core.pressure import DevicePressure
from kvcached_core.startup_lock import StartupLock


@pytest.fixture()
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    return load_settings()


def hold_lock_in_child(tmp_path) -> subprocess.Popen:
    code = textwrap.dedent(
        """
        import sys
        from kvcached_core import load_settings
        from kvcached_core.startup_lock import StartupLock
        lock = StartupLock(load_settings(), "gpu-A")
        lock.acquire()
        print("held", flush=True)
        sys.stdin.readline()
        lock.release()
        print("released", flush=True)
        sys.stdin.readline()
        """
    )
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path))
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_start_up_waits_for_the_first(settings, tmp_path):
    child = hold_lock_in_child(tmp_path)
    try:
        lock = StartupLock(settings, "gpu-A", timeout_s=0.3)
        assert lock.acquire() >= 0.3 and not lock.held  # timed out: goes on without the lock, as documented
        other_device = StartupLock(settings, "gpu-B")
        assert other_device.acquire() < 0.1 and other_device.held  # another device is not held up
        other_device.release()
        waiting = StartupLock(settings, "gpu-A", timeout_s=30)
        start = time.monotonic()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        assert waiting.acquire() < 30 and waiting.held
        assert time.monotonic() - start < 5
        waiting.release()
        assert os.stat(waiting.path).st_mode & 0o777 == 0o600
    finally:
        child.kill()
        child.wait()


def test_a_killed_holder_never_blocks_the_next_start_up(settings, tmp_path):
    child = hold_lock_in_child(tmp_path)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    lock = StartupLock(settings, "gpu-A", timeout_s=5)
    assert lock.acquire() < 1 and lock.held
    lock.release()


def test_a_failed_start_up_holds_the_lock_until_its_process_exits_or_the_delay_ends(settings, tmp_path):
    """An engine whose start-up failed still holds device memory until its process is gone: the lock stays
    held until then (the child exits), or for ``delay_s`` in a process that lives on."""
    code = textwrap.dedent(
        """
        import sys
        from kvcached_core import load_settings
        from kvcached_core.startup_lock import StartupLock
        lock = StartupLock(load_settings(), "gpu-A")
        lock.acquire()
        lock.release_later(60)
        print("failed", flush=True)
        sys.stdin.readline()
        """
    )
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path))
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "failed"
        assert StartupLock(settings, "gpu-A", timeout_s=0.3).acquire() >= 0.3  # still held after the failure
        child.stdin.write("\n")  # the process exits
        child.stdin.flush()
        child.wait(timeout=30)
        after_exit = StartupLock(settings, "gpu-A", timeout_s=5)
        assert after_exit.acquire() < 1 and after_exit.held
        after_exit.release_later(0.2)
        after_exit.acquire()  # a new start-up in the same process holds on past the delay
        time.sleep(0.4)
        assert after_exit.held
        after_exit.release_later(0.2)  # in a process that lives on: released after the delay
        waiting = StartupLock(settings, "gpu-A", timeout_s=5)
        assert 0.1 <= waiting.acquire() < 5 and waiting.held
        waiting.release()
    finally:
        child.kill()
        child.wait()


def signal_in_child(tmp_path, device: str = "cuda:0") -> None:
    code = (
        f"from kvcached_core import load_settings\nfrom kvcached_core.pressure import DevicePressure\n"
        f"DevicePressure(load_settings(), {device!r}).signal()"
    )
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_pressure_from_another_process_is_seen_once(settings, tmp_path):
    mine = DevicePressure(settings, "cuda:0")
    assert mine.poll() is None and mine.read() is None
    signal_in_child(tmp_path)
    seen = mine.poll()
    assert seen is not None and seen.pid != os.getpid() and seen.sequence == 1
    assert mine.poll() is None  # not news twice
    mine.signal()  # this process's own shortfall is not news to itself
    assert mine.poll() is None and mine.read().sequence == 2
    signal_in_child(tmp_path, "cuda:1")  # another device's record
    assert mine.poll() is None
    assert os.stat(mine.path).st_mode & 0o777 == 0o600


def test_a_shortfall_recorded_before_an_engine_started_is_not_news_to_it(settings, tmp_path):
    """An engine starting on a device whose record holds an old shortfall (its engine may be gone) does not
    give memory back for it; the next shortfall is news."""
    signal_in_child(tmp_path)
    late = DevicePressure(settings, "cuda:0")
    assert late.read().sequence == 1 and late.poll() is None
    signal_in_child(tmp_path)
    seen = late.poll()
    assert seen is not None and seen.sequence == 2


def test_a_foreign_or_corrupt_pressure_record_is_ignored_and_left_alone(settings, caplog):
    record = DevicePressure(settings, "cuda:0")
    with open(record.path, "wb") as f:
        f.write(b"not a pressure record, 32 bytes!")
    os.chmod(record.path, 0o600)
    before = open(record.path, "rb").read()
    with caplog.at_level("WARNING", logger="kvcached"):
        assert record.poll() is None
        record.signal()
    assert open(record.path, "rb").read() == before  # never rewritten
    assert "is not a pressure record of this kvcached version; remove it" in caplog.text
    os.chmod(record.path, 0o644)  # open to others: not trusted
    other = DevicePressure(settings, "cuda:0")
    with caplog.at_level("WARNING", logger="kvcached"):
        assert other.read() is None
    assert "is not a pressure record of this user" in caplog.text


def test_memory_other_processes_hold_counts_mapped_pages_and_ready_handles(settings, tmp_path):
    """What a plugin counts as free at its engine's start-up: another process's mapped pages and the physical
    handles its pool keeps ready (both are memory that comes back when that engine idles), on this device
    label only, never this process's own."""
    from kvcached_core import KVCacheManager
    from kvcached_core.segment import held_by_other_processes

    code = textwrap.dedent(
        """
        import sys, time, kvcached_core as kc
        m = kc.KVCacheManager(num_blocks=64, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1,
                              reserved_pages=0, pool_target=3, name="holder")
        assert m.alloc(10) is not None
        while m.snapshot()["pool_ready_handles"] < 3:
            time.sleep(0.01)
        m._control.publish()
        print("ready", m.snapshot()["mapped_bytes"], m.page_bytes, flush=True)
        sys.stdin.readline()
        """
    )
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path))
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ready, mapped, page = child.stdout.readline().split()
        assert ready == "ready"
        mine = KVCacheManager(num_blocks=8, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1, name="mine")
        mine.alloc(4)
        assert held_by_other_processes(settings, "cpu") == int(mapped) + 3 * int(page)
        assert held_by_other_processes(settings, "cuda:0") == 0
        mine.close()
    finally:
        child.kill()
        child.wait()


def test_fair_share_yields_to_a_short_neighbour_and_lifts_after(tmp_path, monkeypatch):
    """``KVCACHED_FAIR_SHARE=1``: when another process on the device falls short, a process holding more than
    an equal share of what the engines there hold caps its pool at that share: it serves nothing new, gives
    back its empty pages above the cap, and does not call itself short. The process that fell short has
    exited: its claim ends with it, and a second after the last shortfall the cap lifts."""
    from conftest import wait_for

    from kvcached_core import KVCacheManager
    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    settings = fair_share_settings(monkeypatch, tmp_path, "64MiB")
    code = textwrap.dedent(
        """
        import sys, kvcached_core as kc
        m = kc.KVCacheManager(num_blocks=64, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1,
                              reserved_pages=0, pool_target=0, name="neighbour")
        assert m.alloc(16) is not None
        m._control.publish()
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    env = dict(os.environ, KVCACHED_RUNTIME_DIR=str(tmp_path), KVCACHED_FAIR_SHARE="0")
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    mine = KVCacheManager(64, 1 << 20, 1, 1, reserved_pages=0, pool_target=0, name="mine", settings=settings)
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        assert child.stdout.readline().strip() == "ready"
        held = mine.alloc(48)  # 48 MiB here, 16 MiB there: an equal share is 32 MiB
        assert held is not None and mine.yield_cap is None
        assert wait_for(lambda: FairShare(settings, "cpu").share_bytes() == (32 * MiB, 48 * MiB, 2))
        signal_in_child(tmp_path, "cpu")
        assert wait_for(lambda: mine.yield_cap == 32 * MiB)
        assert mine.available_size() == 0 and mine.alloc(1) is None
        assert not mine.physically_short()  # its own cap stops it: it must not make the neighbour yield
        mine.free(held[:32])  # 16 MiB in use
        assert wait_for(lambda: mine.snapshot()["mapped_bytes"] <= 32 * MiB)  # empty pages above the cap go
        assert mine.alloc(16) is not None and mine.alloc(2) is None  # up to the cap, not beyond
        assert wait_for(lambda: mine.yield_cap is None, timeout=5)  # no shortfall for a second: lifted
        assert mine.alloc(2) is not None
    finally:
        watch.close()
        mine.close()
        child.kill()
        child.wait()


def fair_share_settings(monkeypatch, tmp_path, budget: str, **more: str):
    """Settings with fair share on, this test's runtime directory and a host budget of ``budget`` (what the
    neighbours started after this see too), plus ``more`` KVCACHED_* values."""
    for name, value in {"RUNTIME_DIR": str(tmp_path), "HOST_DEVICE_BYTES": budget, "FAIR_SHARE": "1", **more}.items():
        monkeypatch.setenv(f"KVCACHED_{name}", value)
    return load_settings()


NEIGHBOUR = textwrap.dedent(
    """
    import sys, kvcached_core as kc
    m = kc.KVCacheManager(num_blocks=64, block_bytes=1 << 20, num_layers=1, num_kv_buffers=1,
                          reserved_pages=0, pool_target=0, pool_max=0, name="neighbour")
    held = m.alloc(16)
    m._control.publish()
    print("ok", flush=True)
    from kvcached_core.pressure import DevicePressure
    for command in iter(sys.stdin.readline, ""):  # "short", "grow": 16 MiB more, "free": everything back
        if command.strip() == "short":
            DevicePressure(kc.load_settings(), "cpu").signal()
        elif command.strip() == "grow":
            held += m.alloc(16)
        else:
            m.free(held)
            held = []
            m.trim()
        m._control.publish()
        print("ok", flush=True)
    """
)


def start_neighbour() -> tuple[subprocess.Popen, Callable[[str], None]]:
    """A process holding 16 MiB of the host budget (KVCACHED_RUNTIME_DIR and the budget come from the
    environment), and a function that sends it a command and waits for it to be done."""
    child = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR],
        env=dict(os.environ, KVCACHED_FAIR_SHARE="0"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def tell(command: str) -> None:
        child.stdin.write(command + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"

    assert child.stdout.readline().strip() == "ok"
    return child, tell


def my_pool(settings):
    """This process's pool beside :func:`start_neighbour`'s: 64 blocks of 1 MiB, nothing mapped ahead or kept."""
    from kvcached_core import KVCacheManager

    return KVCacheManager(
        64, 1 << 20, 1, 1, reserved_pages=0, pool_target=0, pool_max=0, name="mine", settings=settings
    )


def test_fair_share_keeps_a_short_neighbours_share_for_it_until_its_claim_ends(tmp_path, monkeypatch):
    """On a 64 MiB host budget the caps outlast the neighbour's shortfalls: it stopped signalling because it
    has its share, not because it no longer needs it, and lifting then would only start the next round of
    preemptions. When the neighbour gives its memory back, its share stays kept for it (spare memory a yield
    freed is not memory nobody needs: the H200 run with three engines passed it back and forth), until its
    claim ends (``CLAIM_S`` after its last shortfall); then the caps lift."""
    from conftest import wait_for

    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    settings = fair_share_settings(monkeypatch, tmp_path, "64MiB")
    child, tell = start_neighbour()
    mine = my_pool(settings)
    monkeypatch.setattr(FairShare, "CLAIM_S", 5.0)
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        held = mine.alloc(48)  # 48 + 16 MiB: the budget is full
        assert held is not None and mine.device_spare_bytes() == 0
        assert wait_for(lambda: FairShare(settings, "cpu").share_bytes() == (32 * MiB, 48 * MiB, 2))
        tell("short")
        assert wait_for(lambda: mine.yield_cap == 32 * MiB)
        mine.free(held[32:])  # down to the cap; the neighbour takes what that gave back
        assert wait_for(lambda: mine.snapshot()["mapped_bytes"] == 32 * MiB)
        tell("grow")
        tell("short")  # still short (a short engine signals at every failed step)
        time.sleep(3 * FairShare.LIFT_S)  # time to lift, but no memory is spare
        assert mine.yield_cap == 32 * MiB and mine.alloc(1) is None
        tell("short")
        tell("free")  # the neighbour's 32 MiB are spare, but its share is kept for it while its claim lasts
        freed = time.monotonic()
        time.sleep(2 * FairShare.LIFT_S)
        assert mine.yield_cap == 32 * MiB and mine.alloc(1) is None
        assert wait_for(lambda: mine.yield_cap is None, timeout=8)
        assert time.monotonic() - freed >= FairShare.CLAIM_S - 2 * FairShare.LIFT_S  # the claim ran out first
        assert mine.alloc(16) is not None
    finally:
        watch.close()
        mine.close()
        child.kill()
        child.wait()


def test_a_fair_share_floor_keeps_part_of_an_idle_neighbours_share_free_for_it(tmp_path, monkeypatch):
    """``KVCACHED_FAIR_SHARE_FLOOR=0.5`` on a 64 MiB budget shared by two engines (an equal share 32 MiB): with
    the neighbour holding nothing, this engine grows to 48 MiB and no further, so the neighbour's next 16 MiB
    are there at once, without a shortfall or a yield (its process fails if they are not). A neighbour holding
    more than its floor leaves this engine the rest; a claim caps below the floor's cap while it lasts, and
    the floor's cap stays when it ends; alone on the device, no cap at all."""
    from conftest import wait_for

    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    monkeypatch.setattr(FairShare, "CLAIM_S", 2.0)
    settings = fair_share_settings(monkeypatch, tmp_path, "64MiB", FAIR_SHARE_FLOOR="0.5")
    child, tell = start_neighbour()
    tell("free")  # the neighbour idles on nothing
    mine = my_pool(settings)
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        assert wait_for(lambda: mine.yield_cap == 48 * MiB)
        assert mine.admit_cap is None  # growth is bounded, not what it keeps: idle pages still go when asked
        held = mine.alloc(48)
        assert held is not None and mine.alloc(1) is None
        assert not mine.physically_short()  # its floor cap stops it, not the device: no neighbour must yield
        tell("grow")  # 16 MiB: its floor, free although this engine wanted more
        mine.free(held[16:])
        mine.trim()
        tell("grow")  # 32 MiB, above its floor: this engine may have the rest, 32 MiB
        assert wait_for(lambda: mine.yield_cap == 32 * MiB)
        tell("free")
        assert wait_for(lambda: mine.yield_cap == 48 * MiB)
        more = mine.alloc(32)  # 48 MiB again, then the neighbour falls short: the claim's cap is the lower
        assert more is not None
        tell("short")
        assert wait_for(lambda: mine.yield_cap == 32 * MiB)
        assert wait_for(lambda: mine.yield_cap == 48 * MiB, timeout=4 * FairShare.CLAIM_S)  # the claim ended
        child.kill()
        child.wait()  # its segment goes with it: alone on the device
        assert wait_for(lambda: mine.yield_cap is None and mine.admit_cap is None)
        assert mine.alloc(16) is not None  # 64 MiB: beyond what the floor capped it at
    finally:
        watch.close()
        mine.close()
        child.kill()
        child.wait()


def test_a_floor_cap_leaves_room_for_every_pool_of_an_engine(tmp_path, monkeypatch):
    """An engine with two pools on the device (SGLang's hybrid models: K/V and Mamba state) under a floor's
    cap of 48 MiB: the room above what they map is split between them, so the pool that maps nothing yet can
    still grow (a split in proportion to what each maps would give it none)."""
    from conftest import wait_for

    from kvcached_core import KVCacheManager
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    settings = fair_share_settings(monkeypatch, tmp_path, "64MiB", FAIR_SHARE_FLOOR="0.5")
    child, tell = start_neighbour()
    tell("free")
    first = my_pool(settings)
    second = KVCacheManager(
        64, 1 << 20, 1, 1, reserved_pages=0, pool_target=0, pool_max=0, name="second", settings=settings
    )
    assert first.alloc(16) is not None
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        assert wait_for(lambda: (first.yield_cap, second.yield_cap) == (32 * MiB, 16 * MiB))
        assert second.alloc(16) is not None
    finally:
        watch.close()
        first.close()
        second.close()
        child.kill()
        child.wait()


def test_a_shortfall_never_raises_a_cap_even_while_this_engines_segment_lags_its_frees(tmp_path, monkeypatch):
    """A shortfall read while this process's published segment still shows pages it has freed (it republishes
    every watch interval; here an hour) must not see a share above the one it yields to: counting both its old
    holdings and the neighbour's growth into them once raised the cap from 32 to 40 MiB. The policy is driven
    by hand here (no watch thread), so the stale segment stays stale."""
    from kvcached_core.fair_share import FairShare

    MiB = 1 << 20
    for name, value in (
        ("RUNTIME_DIR", str(tmp_path)),
        ("HOST_DEVICE_BYTES", "64MiB"),
        ("WATCH_INTERVAL_MS", "3600000"),
    ):
        monkeypatch.setenv(f"KVCACHED_{name}", value)
    settings = load_settings()
    child, tell = start_neighbour()
    mine = my_pool(settings)
    policy = FairShare(settings, "cpu")
    try:
        held = mine.alloc(48)
        assert held is not None
        mine._control.publish()
        assert policy.on_shortfall(child.pid) and mine.yield_cap == 32 * MiB
        mine.free(held[32:])
        mine.trim()
        assert mine.snapshot()["mapped_bytes"] == 32 * MiB  # the segment still says 48
        tell("grow")  # the neighbour maps what that gave back: 32 MiB each, nothing spare
        assert policy.on_shortfall(child.pid) and mine.yield_cap == 32 * MiB
        assert policy.share_bytes() == (32 * MiB, 32 * MiB, 2)
    finally:
        mine.close()
        child.kill()
        child.wait()


def test_fair_share_yields_only_to_a_neighbour_below_its_share(tmp_path, monkeypatch):
    """Three processes on a 112 MiB host budget, all backlogged (no memory spare): this one and a neighbour
    hold 48 MiB each, another neighbour 16; an equal share is 37.3 MiB. The large neighbour's shortfalls cap
    nothing (it holds more than a share: yielding to it would only move the overload here); the small one's
    cap this process at the share."""
    from conftest import wait_for

    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    settings = fair_share_settings(monkeypatch, tmp_path, "112MiB")
    (large, tell_large), (small, tell_small) = start_neighbour(), start_neighbour()
    mine = my_pool(settings)
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        tell_large("grow")
        tell_large("grow")  # 48 MiB
        assert mine.alloc(48) is not None and mine.device_spare_bytes() == 0
        share = 112 * MiB // 3
        assert wait_for(lambda: FairShare(settings, "cpu").share_bytes() == (share, 48 * MiB, 3))
        for _ in range(10):  # two seconds of shortfalls
            tell_large("short")
            time.sleep(0.2)
        assert mine.yield_cap is None and mine.snapshot()["mapped_bytes"] == 48 * MiB
        tell_small("short")
        assert wait_for(lambda: mine.yield_cap == share)
    finally:
        watch.close()
        mine.close()
        for child in (large, small):
            child.kill()
            child.wait()


def test_fair_share_waits_for_a_neighbour_short_for_longer_than_the_wait(tmp_path, monkeypatch):
    """``KVCACHED_FAIR_SHARE_WAIT_MS``: a neighbour's shortfall is left to the engines' own requests finishing
    until it has lasted the wait. A lone shortfall, and one after a break of more than ``LIFT_S`` (its wait
    starts over), cap nothing, not even admissions of a pool that could gate them (no
    ``KVCACHED_FAIR_SHARE_ADMIT_FIRST``); shortfalls kept up for the wait cap this process at an equal share."""
    from conftest import wait_for

    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    settings = fair_share_settings(monkeypatch, tmp_path, "64MiB", FAIR_SHARE_WAIT_MS="2000")
    child, tell = start_neighbour()
    mine = my_pool(settings)
    mine.gates_admissions = True
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        assert mine.alloc(48) is not None
        assert wait_for(lambda: FairShare(settings, "cpu").share_bytes() == (32 * MiB, 48 * MiB, 2))
        tell("short")
        time.sleep(1.5 * FairShare.LIFT_S)  # a break: the next shortfall starts a new wait
        tell("short")
        time.sleep(0.5)
        assert mine.yield_cap is None and mine.admit_cap is None
        started = time.monotonic()  # 2 s after the first signal: without the break's reset, capped at once
        while mine.yield_cap is None and time.monotonic() - started < 10:
            tell("short")  # a short engine signals at every failed step
            time.sleep(0.2)
        waited = time.monotonic() - started
        assert mine.yield_cap == 32 * MiB
        assert 1.2 <= waited <= 4  # the wait, 2 s from the signal before the loop (0.5 s before it)
    finally:
        watch.close()
        mine.close()
        child.kill()
        child.wait()


def test_an_engine_alone_on_its_device_holds_its_recent_demand_until_a_neighbour_appears(tmp_path, monkeypatch):
    """``KVCACHED_IDLE_HOLD_MS``: while no other process holds a kvcached pool on the device, a process's
    pools keep their recent demand mapped for the hold instead of their own (short) demand window; once a
    neighbour publishes a pool there, the window is the pool's own again and the held pages go back; when
    the neighbour is gone, the hold returns."""
    from conftest import wait_for

    from kvcached_core import KVCacheManager
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    for name, value in (("RUNTIME_DIR", str(tmp_path)), ("RECLAIM_DELAY_MS", "20"), ("IDLE_HOLD_MS", "60000")):
        monkeypatch.setenv(f"KVCACHED_{name}", value)
    settings = load_settings()
    mine = KVCacheManager(64, 1 << 20, 1, 1, reserved_pages=0, pool_target=0, name="mine", settings=settings)
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    child = None
    try:
        assert mine.demand_window_ms == 20
        assert wait_for(lambda: mine.reclaim_delay_ms == 60000)  # alone: the hold
        mine.free(mine.alloc(8))
        time.sleep(0.5)  # 25 of its own windows
        assert mine.snapshot()["mapped_bytes"] == 8 * MiB
        child, _tell = start_neighbour()
        appeared = time.monotonic()
        assert wait_for(lambda: mine.reclaim_delay_ms == 20, timeout=3)
        assert wait_for(lambda: mine.snapshot()["mapped_bytes"] == 0, timeout=3)
        assert time.monotonic() - appeared < 2.5  # one look (a second) and two short windows
        child.kill()
        child.wait()
        assert wait_for(lambda: mine.reclaim_delay_ms == 60000, timeout=3)  # its pool is gone with it
    finally:
        watch.close()
        mine.close()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()


def test_no_hold_when_it_is_off_or_shorter_than_the_pools_own_window(tmp_path, monkeypatch):
    """``KVCACHED_IDLE_HOLD_MS=0`` leaves every window as configured; a pool whose own window is longer than
    the hold keeps its own."""
    from kvcached_core import KVCacheManager
    from kvcached_core.idle_hold import IdleHold
    from kvcached_core.pressure import PressureWatch

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    off = load_settings(idle_hold_ms=0, reclaim_delay_ms=20)
    on = load_settings(idle_hold_ms=1000, reclaim_delay_ms=20)
    short = KVCacheManager(64, 1 << 20, 1, 1, pool_target=0, name="short", settings=off)
    long = KVCacheManager(64, 1 << 20, 1, 1, pool_target=0, name="long", reclaim_delay_ms=5000, settings=off)
    try:
        watch = PressureWatch(off, "cpu", has_spare=lambda: False)
        assert watch.idle_hold is None
        watch.close()
        hold = IdleHold(on, "cpu")
        hold.tick()
        assert hold.alone
        assert (short.reclaim_delay_ms, long.reclaim_delay_ms) == (1000, 5000)
    finally:
        short.close()
        long.close()


def test_an_engine_that_gates_admissions_stops_admitting_at_once_and_yields_after_the_wait(tmp_path, monkeypatch):
    """Fair share's two strengths (``KVCACHED_FAIR_SHARE_ADMIT_FIRST``) on a 64 MiB host budget (this process
    48 MiB, a neighbour 16): a pool whose plugin gates admissions gets an admission cap at the neighbour's
    first shortfall (new requests wait, allocations go on: nothing is preempted); once the neighbour has been
    short for ``KVCACHED_FAIR_SHARE_WAIT_MS`` the cap holds every block; when its claim ends, both lift."""
    from conftest import wait_for

    from kvcached_core.control import instances
    from kvcached_core.fair_share import FairShare
    from kvcached_core.pressure import PressureWatch

    MiB = 1 << 20
    monkeypatch.setattr(FairShare, "CLAIM_S", 3.0)
    settings = fair_share_settings(
        monkeypatch, tmp_path, "64MiB", FAIR_SHARE_WAIT_MS="2000", FAIR_SHARE_ADMIT_FIRST="1"
    )
    child, tell = start_neighbour()
    mine = my_pool(settings)
    mine.gates_admissions = True
    watch = PressureWatch(settings, "cpu", has_spare=lambda: False)
    try:
        held = mine.alloc(40)
        assert held is not None and mine.admits_new_requests()
        assert wait_for(lambda: FairShare(settings, "cpu").share_bytes() == (32 * MiB, 40 * MiB, 2))
        started = time.monotonic()
        tell("short")
        assert wait_for(lambda: mine.admit_cap == 32 * MiB, timeout=1)
        assert mine.yield_cap is None and not mine.admits_new_requests()
        # kvctl and kvtop see it: the pool's published row carries the cap
        assert wait_for(lambda: [r["admit_cap_bytes"] for r in instances(settings, name="mine")] == [32 * MiB])
        more = mine.alloc(8)  # running requests still grow: no cap on the blocks themselves
        assert more is not None
        while mine.yield_cap is None and time.monotonic() - started < 10:
            tell("short")  # a short engine signals at every failed step
            time.sleep(0.2)
        assert 1.5 <= time.monotonic() - started <= 4  # the wait
        assert mine.yield_cap == 32 * MiB and mine.admit_cap == 32 * MiB and mine.alloc(1) is None
        mine.free(held + more)  # its requests finished
        assert wait_for(lambda: mine.admits_new_requests() and mine.alloc(1) is not None)  # under the share
        assert wait_for(lambda: mine.admit_cap is None and mine.yield_cap is None, timeout=8)  # the claim ended
    finally:
        watch.close()
        mine.close()
        child.kill()
        child.wait()
