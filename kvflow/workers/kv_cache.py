"""The worker's paged KV cache, with one owner: this object.

It holds the attention backend (which defines the cache layout, the per-step metadata and the
kernels) and one tensor `[K/V, layer, *backend.cache_shape(num_blocks)]`. Attention layers get
this object and their layer index when the model is built and read their K/V views from it at
each step, so allocating (or, after memory profiling on CUDA, reallocating) touches no layer.
"""
from __future__ import annotations

import torch

from kvflow.workers.attention import AttentionBackend
from kvflow.workers.huge_pages import advise


class KVCache:
    def __init__(self, backend: AttentionBackend, num_layers: int) -> None:
        self.backend = backend
        self.num_layers = num_layers
        self.num_blocks = 0
        self.tensor = torch.empty(0)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []   # (K, V) view per layer

    @property
    def bytes_per_block(self) -> int:
        b = self.backend
        elements = 1
        for n in b.cache_shape(1):           # one block's K (or V) of one layer
            elements *= n
        return 2 * self.num_layers * elements * b.kv_dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        """A fresh cache of `num_blocks` blocks (0: none), replacing the one held."""
        self.layers, self.tensor = [], torch.empty(0)        # free the old one first
        if num_blocks:
            b = self.backend
            shape = (2, self.num_layers) + b.cache_shape(num_blocks)
            # Zeroed: padded attention slots are masked, but 0 * NaN garbage is still NaN.
            self.tensor = torch.empty(shape, dtype=b.kv_dtype, device=b.device)
            if self.tensor.device.type == "cpu":
                advise(self.tensor)     # 2 MB pages (workers/huge_pages.py)
            self.tensor.zero_()
            self.layers = [(self.tensor[0, i], self.tensor[1, i])
                           for i in range(self.num_layers)]
        self.num_blocks = num_blocks
