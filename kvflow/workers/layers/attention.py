"""The attention layer: store this step's K/V in the paged cache, then attend over it.

Per-step metadata is built once by the model runner and passed down explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvflow.kernels.torch_attention import TorchAttnGroup, group_attention, store_kv


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [num_tokens] cache slot of each new token
    groups: list[TorchAttnGroup] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound once by the worker when it allocates the cache.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for group in meta.groups:
            group_attention(q, self.k_cache, self.v_cache, group, self.scale, out)
        return out
