"""Torch views over KV memory, shared by KVCacheManager (its own memory) and PageMirror (a worker's).

torch is imported only here, and only when a view is asked for: the core needs no torch to run.
"""

from __future__ import annotations

import math


class KVTensorViews:
    """Mixin: needs ``num_blocks``, ``block_bytes``, ``num_layers``, ``num_kv_buffers`` and the native
    ``_export_bytes(buffer, offset, nbytes)`` and ``_export_all()``, which return DLPack capsules."""

    num_blocks: int
    block_bytes: int
    num_layers: int
    num_kv_buffers: int

    def buffer_index(self, layer: int, kv: int = 0) -> int:
        """Index of the buffer holding ``layer``'s K (kv=0) or V (kv=1) blocks."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if not 0 <= kv < self.num_kv_buffers:
            raise ValueError(f"kv {kv} out of range [0, {self.num_kv_buffers})")
        return layer * self.num_kv_buffers + kv

    def buffer(self, layer: int = 0, kv: int = 0):
        """One buffer as a flat ``torch.uint8`` tensor of ``num_blocks * block_bytes`` bytes.

        Block ``b`` is bytes ``[b * block_bytes, (b + 1) * block_bytes)``. This is the form of an engine
        that allocates one backing buffer per KV tensor and slices it itself. Touch only allocated blocks:
        other pages may be unmapped.
        """
        import torch

        capsule = self._export_bytes(self.buffer_index(layer, kv), 0, self.num_blocks * self.block_bytes)
        return torch.from_dlpack(capsule)

    def flat_buffer(self):
        """Every buffer as one flat ``torch.uint8`` tensor: buffer ``i`` starts at ``i * buffer_stride``.

        For engines that stride all layers over one backing buffer: when ``num_blocks * block_bytes`` is a
        multiple of the page size, ``buffer_stride`` equals it and layer ``l``'s block ``b`` is at
        ``l * num_blocks * block_bytes + b * block_bytes``.
        """
        import torch

        return torch.from_dlpack(self._export_all())

    def kv_tensors(self, block_shape: tuple[int, ...], dtype) -> list[list]:
        """Per-layer views: ``result[layer][kv]`` has shape ``(num_blocks, *block_shape)`` and ``dtype``.

        ``prod(block_shape) * dtype.itemsize`` must equal ``block_bytes``.
        """
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(block_shape) * itemsize != self.block_bytes:
            raise ValueError(
                f"block_shape {tuple(block_shape)} of {dtype} is {math.prod(block_shape) * itemsize} bytes, "
                f"but this manager's blocks are {self.block_bytes} bytes"
            )
        return [
            [
                self.buffer(layer, kv).view(dtype).view(self.num_blocks, *block_shape)
                for kv in range(self.num_kv_buffers)
            ]
            for layer in range(self.num_layers)
        ]
