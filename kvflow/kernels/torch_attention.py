"""Paged attention in plain torch: the CPU path and the reference for the other backends.

The batch's requests are split into groups of similar query length (decodes, prefills), so
padding stays small; within a group every request's query rows and KV slots are gathered into
padded [batch, len] index tensors, built once per step and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TorchAttnGroup:
    q_index: torch.Tensor       # [batch, max_q] rows of the packed query (padding -> row 0)
    kv_index: torch.Tensor      # [batch, max_kv] cache slots (padding -> slot 0)
    mask: torch.Tensor          # [batch, 1, 1, max_q, max_kv] True where attention is allowed
    valid: torch.Tensor         # [batch * max_q] True for real (not padded) query rows
    out_rows: torch.Tensor      # [num_valid] packed rows the valid outputs go to


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the paged cache. key/value: [num_tokens, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = key.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: TorchAttnGroup, scale: float, out: torch.Tensor) -> None:
    """Attention for one group; writes its rows of `out` ([num_tokens, num_heads, head_dim])."""
    batch, max_q = group.q_index.shape
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    g = num_heads // num_kv_heads
    qg = q[group.q_index].view(batch, max_q, num_kv_heads, g, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, g * max_q, head_dim)
    k = k_cache.view(-1, num_kv_heads, head_dim)[group.kv_index]   # [batch, kv, kv_heads, d]
    v = v_cache.view(-1, num_kv_heads, head_dim)[group.kv_index]
    k, v = k.transpose(1, 2), v.transpose(1, 2)                      # [batch, kv_heads, kv, d]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [batch, kv_heads, g*q, kv]
    scores = scores.view(batch, num_kv_heads, g, max_q, -1)
    scores.masked_fill_(~group.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(batch, num_kv_heads, g * max_q, -1)
    o = torch.matmul(probs, v).view(batch, num_kv_heads, g, max_q, head_dim)
    o = o.permute(0, 3, 1, 2, 4).reshape(batch * max_q, num_heads, head_dim)
    out[group.out_rows] = o[group.valid]
