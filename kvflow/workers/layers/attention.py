"""The attention layer: store this step's K/V in the paged cache, then attend over it.

How both are done belongs to the attention backend (kvflow/workers/attention/): its
cache layout, its per-step metadata (built once by the model runner, passed down explicitly)
and its kernels. The worker binds the backend and this layer's slice of the cache once.
"""
from __future__ import annotations

import torch
from torch import nn

from kvflow.workers.attention.base import AttentionBackend, AttentionMetadata

class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound once by the worker when it allocates the cache.
        self.backend: AttentionBackend | None = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        assert self.backend is not None, "the worker binds a backend and a KV cache first"
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta)
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)
