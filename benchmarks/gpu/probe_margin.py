"""How much of the memory cuMemGetInfo reports free can really be mapped, page by page, on a CUDA device.

Another user holds all but LEAVE MiB of the device; a manager then maps 2 MiB pages until the driver refuses.
Prints JSON: per LEAVE, the free figure before, the pages kvcached reported available, the pages really
mapped, and the free figure at the refusal (the driver's own reserve).

    python benchmarks/gpu/probe_margin.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import kvcached_core as kc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import write_report  # noqa: E402

MiB = 1 << 20


def probe(leave_mib: int) -> dict:
    free, _total = torch.cuda.mem_get_info()
    hog = torch.empty(free - leave_mib * MiB, dtype=torch.uint8, device="cuda")
    try:
        before, _ = torch.cuda.mem_get_info()
        mgr = kc.KVCacheManager(
            num_blocks=4096,
            block_bytes=2 * MiB,
            num_layers=1,
            num_kv_buffers=1,
            device="cuda:0",
            reserved_pages=0,
            pool_target=0,
        )
        reported = mgr.available_size()
        mapped = 0
        while mgr.alloc(1) is not None:
            mapped += 1
        at_refusal, _ = torch.cuda.mem_get_info()
        mgr.close()
    finally:
        del hog
        torch.cuda.empty_cache()
    return {
        "free_before_mib": before / MiB,
        "reported_pages": reported,
        "mapped_pages": mapped,
        "free_at_refusal_mib": at_refusal / MiB,
        "reported_le_mapped": reported <= mapped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "leave_mib": {m: probe(m) for m in (64, 512, 2048)}}
    print(write_report(result, args.out))


if __name__ == "__main__":
    main()
