"""The activation reserve each plugin makes torch cache at the end of an engine's start-up
(kvcached_core.activations). Holding it needs CUDA (tests/test_gpu.py and the plugins' GPU tests); how much
to hold is arithmetic on torch's memory statistics, checked here with torch's keys and chosen values."""

from __future__ import annotations

from kvcached_core.activations import activation_reserve_bytes

MiB = 1 << 20
STATS = {
    "allocated_bytes.all.current": 900 * MiB,  # weights and buffers
    "allocated_bytes.all.peak": 1500 * MiB,  # during the start-up's largest forward pass
    "reserved_bytes.all.current": 1000 * MiB,  # 100 MiB cached unused
}


def test_the_engines_measured_peak_wins_less_what_torch_caches():
    assert activation_reserve_bytes(STATS, 400 * MiB) == 300 * MiB
    assert activation_reserve_bytes(STATS, 50 * MiB) == 0  # torch already caches more than the peak


def test_without_a_measured_peak_torchs_own_peak_above_what_is_allocated():
    assert activation_reserve_bytes(STATS) == 500 * MiB  # 600 MiB above current, less 100 cached
    assert activation_reserve_bytes({}) == 0
