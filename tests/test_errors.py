"""Bad input: a clear ValueError/RuntimeError naming the problem and the fix; nothing half-built."""

from __future__ import annotations

import pytest

import kvcached_core as kc


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_blocks=0), "num_blocks must be a positive integer"),
        (dict(num_blocks=-5), "num_blocks must be a positive integer"),
        (dict(num_blocks=10.0), "num_blocks must be a positive integer"),
        (dict(block_bytes=True), "block_bytes must be a positive integer"),
        (dict(num_layers="4"), "num_layers must be a positive integer"),
        (dict(num_kv_buffers=0), "num_kv_buffers must be a positive integer"),
        (dict(device="tpu"), "unknown device 'tpu'; use 'cpu', 'cuda' or 'cuda:N'"),
        (dict(device="cuda:x"), "unknown device"),
        (dict(pool_name=""), "pool_name must be a non-empty printable string"),
        (dict(name="x" * 200), "longer than 127 bytes"),
        (dict(page_bytes=1000), "multiple of the host granularity"),
        (dict(block_bytes=4 * 1024 * 1024, page_bytes=2 * 1024 * 1024), "set page_bytes to at least 4194304"),
        (dict(reserved_pages=-1), "reserved_pages must be an integer from 0 to 2147483647"),
        # Numbers beyond every integer type the native layer holds: refused here, never an overflow there.
        (dict(num_blocks=2**70), "num_blocks must be a positive integer of at most 2147483647"),
        (dict(block_bytes=2**70), "block_bytes must be a positive integer of at most"),
        (dict(num_layers=2**40), "num_layers must be a positive integer of at most 65536"),
        (dict(num_layers=512, num_kv_buffers=512), "num_kv_buffers must be a positive integer of at most 128"),
        (dict(page_bytes=2**64), "page_bytes must be an integer from 0 to"),
        (dict(reclaim_delay_ms=2**40), "reclaim_delay_ms must be an integer from 0 to 2147483647"),
        (dict(pool_target=2**63), "pool_target must be an integer from 0 to 2147483647"),
        (dict(pool_max=-1), "pool_max must be an integer from 0"),
    ],
)
def test_bad_geometry_is_a_value_error_naming_the_fix(settings, kwargs, message):
    params = dict(num_blocks=64, block_bytes=4096, num_layers=1, num_kv_buffers=2, device="cpu", settings=settings)
    params.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kc.KVCacheManager(**params)


def test_block_larger_than_default_page_gets_a_larger_page(make_manager):
    mgr = make_manager(num_blocks=8, block_bytes=3 * 1024 * 1024, num_layers=1)
    assert mgr.page_bytes == 3 * 1024 * 1024
    assert len(mgr.alloc(8)) == 8


def test_cuda_device_without_cuda_is_a_runtime_error_with_the_reason(settings):
    if "cuda" in kc.available_backends():
        with pytest.raises(ValueError, match="does not exist"):
            kc.KVCacheManager(8, 4096, 1, 2, device="cuda:999", settings=settings)
    else:
        with pytest.raises(RuntimeError, match="use device='cpu'"):
            kc.KVCacheManager(8, 4096, 1, 2, device="cuda", settings=settings)


def test_settings_parse_and_name_the_variable():
    s = kc.load_settings({"KVCACHED_HOST_DEVICE_BYTES": "1.5GiB", "KVCACHED_POOL_TARGET": "0"})
    assert s.host_device_bytes == 1536 * 1024 * 1024 and s.pool_target == 0
    assert kc.load_settings({"KVCACHED_ENABLE": "off"}).enable is False
    assert kc.load_settings({"KVCACHED_KV_LAYOUT": " Block-Outer"}).kv_layout == "block-outer"
    assert kc.load_settings({"KVCACHED_FAIR_SHARE_FLOOR": "0.25"}).fair_share_floor == 0.25
    with pytest.raises(kc.ConfigError, match="KVCACHED_KV_LAYOUT=.*use engine or block-outer"):
        kc.load_settings({"KVCACHED_KV_LAYOUT": "blocks"})
    for env, value in (
        ("KVCACHED_POOL_TARGET", "-1"),
        ("KVCACHED_POOL_TARGET", "many"),
        ("KVCACHED_HOST_DEVICE_BYTES", "2X"),
        ("KVCACHED_ENABLE", "maybe"),
        ("KVCACHED_FAIR_SHARE_FLOOR", "1.5"),
        ("KVCACHED_FAIR_SHARE_FLOOR", "half"),
        ("KVCACHED_FAIR_SHARE_FLOOR", "nan"),
    ):
        with pytest.raises(kc.ConfigError, match=env):
            kc.load_settings({env: value})
    with pytest.raises(TypeError, match="unknown setting"):
        kc.load_settings({}, pool_tagret=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("64kb", 64 << 10)],
)
def test_parse_size(text, expected):
    assert kc.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "1.2345K", "-5M", "12 parsecs"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        kc.parse_size(text)


def test_foreign_runtime_dir_is_refused(tmp_path):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    s = kc.load_settings({}, runtime_dir=str(target), host_device_bytes=1 << 30)
    with pytest.raises(PermissionError, match="KVCACHED_RUNTIME_DIR"):
        kc.KVCacheManager(8, 4096, 1, 2, device="cpu", settings=s)


@pytest.mark.parametrize(
    "variable",
    [
        "KVCACHED_PAGE_BYTES",
        "KVCACHED_RESERVED_PAGES",
        "KVCACHED_RECLAIM_DELAY_MS",
        "KVCACHED_POOL_TARGET",
        "KVCACHED_POOL_MAX",
        "KVCACHED_HOST_DEVICE_BYTES",
        "KVCACHED_WATCH_INTERVAL_MS",
        "KVCACHED_PREFIX_CACHE_BYTES",
        "KVCACHED_PREFIX_CACHE_FLOOR_BYTES",
    ],
)
@pytest.mark.parametrize("value", ["9" * 30, "1" * 400])
def test_settings_beyond_every_integer_type_are_a_config_error_naming_the_variable(variable, value):
    with pytest.raises(kc.ConfigError, match=f"^{variable}=.*larger than"):
        kc.load_settings({variable: value})


def test_limits_and_block_ids_beyond_64_bits_are_value_errors(make_manager):
    mgr = make_manager(num_blocks=64)
    with pytest.raises(ValueError, match="limit_bytes must be an integer from 0 to"):
        mgr.set_memory_limit(2**70)
    with pytest.raises(ValueError, match="revision must be an integer from 0 to"):
        mgr.set_memory_limit(None, 2**64)
    with pytest.raises(ValueError, match=r"alloc\(\) count is out of range"):
        mgr.alloc(2**70)
    with pytest.raises(ValueError, match="a block id is out of range"):
        mgr.free([2**70])
    assert mgr.snapshot()["allocated_blocks"] == 0 and mgr.snapshot()["limit_bytes"] is None  # nothing applied
