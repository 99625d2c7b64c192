"""Paged attention in plain torch: the CPU fallback and the reference for the other backends.

Prefills: one scaled_dot_product_attention call per request (torch's fused CPU kernel, causal,
grouped-query) over that request's K/V gathered from its blocks; measured 2.5x faster than a
padded batched group on a step of 15 prompts of 32..256 tokens, which padding made quadratic.

Decodes (one query row each) form one group: every request's query row and KV blocks are gathered
with flat index tensors built once per step and shared by every layer. Per KV head, q·kᵀ and
p·v are bmm calls on contiguous gathered tensors. For that the torch path keeps its cache head-major,
`[num_kv_heads, num_blocks * block_size, head_dim]` per layer (slot = block_id * block_size +
offset): one index_select of whole blocks per layer gathers every head's K contiguously, into
scratch buffers allocated once per step (fresh large allocations cost page faults on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TorchAttnGroup:
    batch: int
    max_q: int
    max_kv: int
    q_index: torch.Tensor       # [batch * max_q] packed query rows (padding -> row 0)
    block_index: torch.Tensor   # [batch * max_kv / block_size] block tables (padding -> 0)
    bias: torch.Tensor          # [batch, max_q, 1, max_kv] float32: 0 allowed, -inf masked
    valid: torch.Tensor         # [batch * max_q] True for real (not padded) query rows
    out_rows: torch.Tensor      # [num_valid] packed rows the valid outputs go to
    k_buf: torch.Tensor         # [num_kv_heads, batch * max_kv / block_size, block_size * d]
    v_buf: torch.Tensor         #   scratch for the gathered K and V, reused by every layer


@dataclass(frozen=True)
class TorchPrefill:
    start: int                   # first packed row
    q_len: int
    context_len: int             # cached prefix + q_len
    block_index: torch.Tensor    # [ceil(context_len / block_size)] block ids
    mask: torch.Tensor | None    # [q_len, context_len] bool, True = attend; None: plain causal


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks * block_size, head_dim)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the cache. key/value: [num_tokens, num_kv_heads, head_dim]."""
    k_cache.index_copy_(1, slot_mapping, key.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, value.transpose(0, 1))


def group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: TorchAttnGroup, scale: float, out: torch.Tensor) -> None:
    """Attention for one group; writes its rows of `out` ([num_tokens, num_heads, head_dim])."""
    b, max_q, max_kv = group.batch, group.max_q, group.max_kv
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[0]
    g = num_heads // num_kv_heads
    block_numel = group.k_buf.shape[-1]
    k_blocks = k_cache.view(num_kv_heads, -1, block_numel)  # [kv_heads, num_blocks, bs * d]
    v_blocks = v_cache.view(num_kv_heads, -1, block_numel)
    # Per head along dim 0: measured 4-5x faster than one index_select along dim 1.
    for h in range(num_kv_heads):
        torch.index_select(k_blocks[h], 0, group.block_index, out=group.k_buf[h])
        torch.index_select(v_blocks[h], 0, group.block_index, out=group.v_buf[h])
    k = group.k_buf.view(num_kv_heads, b, max_kv, head_dim)
    v = group.v_buf.view(num_kv_heads, b, max_kv, head_dim)
    qg = q.index_select(0, group.q_index).view(b, max_q, num_kv_heads, g, head_dim)
    heads = []
    for h in range(num_kv_heads):
        qh = qg[:, :, h].reshape(b, max_q * g, head_dim)
        scores = torch.bmm(qh, k[h].transpose(1, 2)).float()   # [b, max_q * g, max_kv]
        scores = scores.view(b, max_q, g, max_kv).mul_(scale).add_(group.bias)
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, max_q * g, max_kv)
        heads.append(torch.bmm(probs, v[h]).view(b, max_q, g, head_dim))
    o = torch.stack(heads, dim=2).view(b * max_q, num_heads, head_dim)
    out[group.out_rows] = o[group.valid]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seq: TorchPrefill, block_size: int, scale: float,
                      out: torch.Tensor) -> None:
    """One request's new rows attend to its whole context (the cache holds their K/V already)."""
    num_kv_heads, _, head_dim = k_cache.shape
    k_blocks = k_cache.view(num_kv_heads, -1, block_size * head_dim)
    v_blocks = v_cache.view(num_kv_heads, -1, block_size * head_dim)
    ctx = seq.context_len
    k = k_blocks.index_select(1, seq.block_index).view(1, num_kv_heads, -1, head_dim)[:, :, :ctx]
    v = v_blocks.index_select(1, seq.block_index).view(1, num_kv_heads, -1, head_dim)[:, :, :ctx]
    rows = slice(seq.start, seq.start + seq.q_len)
    qs = q[rows].transpose(0, 1).unsqueeze(0)                 # [1, heads, q_len, head_dim]
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seq.mask, scale=scale,
                                       is_causal=seq.mask is None, enable_gqa=True)
    out[rows] = o[0].transpose(0, 1)
