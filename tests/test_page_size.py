"""The default physical page size: large pages for large CUDA buffers, 2 MiB elsewhere, a setting wins."""

from __future__ import annotations

import pytest

import kvcached_core as kc
from kvcached_core.manager import page_bytes_for

MiB = 1 << 20


@pytest.mark.parametrize(
    ("buffer_bytes", "page"),
    [
        (0, 2 * MiB),
        (127 * MiB, 2 * MiB),  # fewer than 64 pages of 2 MiB: the granule
        (256 * MiB, 4 * MiB),
        (1 << 30, 16 * MiB),
        (2 << 30, 32 * MiB),  # exactly 64 pages of 32 MiB
        (2048 * MiB - 1, 16 * MiB),
        (100 << 30, 32 * MiB),  # never above 32 MiB
    ],
)
def test_cuda_pools_get_the_largest_page_that_leaves_64_pages_a_buffer(settings, buffer_bytes, page):
    assert page_bytes_for(settings, device="cuda:0", buffer_bytes=buffer_bytes) == page


def test_host_pools_keep_2_mib_pages_whatever_their_size(settings, make_manager):
    assert page_bytes_for(settings, device="cpu", buffer_bytes=100 << 30) == 2 * MiB
    mgr = make_manager(num_blocks=8192, block_bytes=1 * MiB, num_layers=1, num_kv_buffers=1)  # 8 GiB virtual
    assert mgr.page_bytes == 2 * MiB


def test_a_page_size_setting_wins_over_the_rule():
    s = kc.load_settings({"KVCACHED_PAGE_BYTES": "8M"})
    assert page_bytes_for(s, device="cuda:0", buffer_bytes=100 << 30) == 8 * MiB
    assert page_bytes_for(s, device="cpu") == 8 * MiB
