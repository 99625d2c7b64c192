"""The attention layer: store this step's K/V in the paged cache, then attend over it.

How both are done belongs to the attention backend (kvflow/workers/attention/): its
cache layout, its per-step metadata (built once by the model runner, passed down explicitly)
and its kernels. The layer is built with the worker's KV cache (kvflow/workers/kv_cache.py),
which holds the backend, and its own index in it.
"""
from __future__ import annotations

import torch
from torch import nn

from kvflow.workers.attention.base import AttentionMetadata
from kvflow.workers.kv_cache import KVCache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_cache: KVCache, layer_index: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache = kv_cache
        self.layer_index = layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        backend = self.kv_cache.backend
        k_cache, v_cache = self.kv_cache.layers[self.layer_index]
        backend.store_kv(k, v, k_cache, v_cache, meta)
        return backend.attend(q, k_cache, v_cache, meta, self.scale)
