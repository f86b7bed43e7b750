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
        (dict(reserved_pages=-1), "must not be negative"),
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
    for env, value in (
        ("KVCACHED_POOL_TARGET", "-1"),
        ("KVCACHED_POOL_TARGET", "many"),
        ("KVCACHED_HOST_DEVICE_BYTES", "2X"),
        ("KVCACHED_ENABLE", "maybe"),
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
