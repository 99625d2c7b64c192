"""The worker's paged KV cache, with one owner: this object.

It holds the attention backend (which defines the cache layout, the per-step metadata and the
kernels) and one tensor `[K/V, layer, *backend.cache_shape(num_blocks)]`. Attention layers get
this object and their layer index when the model is built and read their K/V views from it at
each step, so allocating (or, after memory profiling on CUDA, reallocating) touches no layer.
"""
from __future__ import annotations

import ctypes
import mmap

import torch

from kvflow.workers.attention import AttentionBackend


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
        num_kv_heads, head_dim = b.kv_shape
        return 2 * self.num_layers * b.block_size * num_kv_heads * head_dim * b.kv_dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        """A fresh cache of `num_blocks` blocks (0: none), replacing the one held."""
        self.layers, self.tensor = [], torch.empty(0)        # free the old one first
        if num_blocks:
            b = self.backend
            shape = (2, self.num_layers) + b.cache_shape(num_blocks)
            # Zeroed: padded attention slots are masked, but 0 * NaN garbage is still NaN.
            self.tensor = torch.empty(shape, dtype=b.kv_dtype, device=b.device)
            if self.tensor.device.type == "cpu":
                advise_huge_pages(self.tensor)
            self.tensor.zero_()
            self.layers = [(self.tensor[0, i], self.tensor[1, i])
                           for i in range(self.num_layers)]
        self.num_blocks = num_blocks


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a (not yet touched) CPU tensor with 2 MB pages; True if it agreed.
    Attention reads the cache in block-sized pieces (2 KB for 16 bf16 rows of 64) anywhere in
    it: with 4 KB pages nearly every piece is a TLB miss, and decode attention read the cache
    ~6% slower (benchmarks/cpu_kernels.py). Linux only; where transparent huge
    pages are off (or "never"), a no-op."""
    madvise = getattr(_libc(), "madvise", None)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if madvise is None or huge is None:
        return False
    page = 2 << 20
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end <= start:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), huge) == 0


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
