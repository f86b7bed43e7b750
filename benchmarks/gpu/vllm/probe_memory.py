"""Device memory as the driver reports it after each step of loading vLLM with the plugin (diagnostic).

python probe_memory.py
"""

from __future__ import annotations

import importlib
import subprocess

import torch


def report(step: str) -> None:
    free, total = torch.cuda.mem_get_info(0)
    print(f"{step:<45} free {free / 2**30:8.2f} GiB  total {total / 2**30:8.2f} GiB", flush=True)


report("torch")
for module in (
    "kvcached_core",
    "vllm",
    "vllm.utils.mem_utils",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.attn_utils",
    "vllm.v1.engine.core",
    "kvcached_vllm.patches",
):
    importlib.import_module(module)
    report(f"import {module}")
import kvcached_vllm  # noqa: E402

kvcached_vllm.register()
report("register (patches installed)")
from vllm.utils.mem_utils import MemorySnapshot  # noqa: E402

snap = MemorySnapshot(device=torch.device("cuda:0"))
report(f"snapshot free {snap.free_memory / 2**30:.2f} total {snap.total_memory / 2**30:.2f}")
print(
    subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"], capture_output=True, text=True
    ).stdout
)
