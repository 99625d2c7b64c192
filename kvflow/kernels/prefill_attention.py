"""Paged causal attention for prefill (and chunked prefill / prefix-cache hits): many new query
tokens per request, packed varlen, against the request's whole paged KV.

Request b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of q `[num_tokens, num_heads, head_dim]`.
Its KV holds `context_lens[b]` positions, the new tokens last (already written to the cache, after
any cached prefix or earlier chunks). New token i therefore sits at position
`context_lens[b] - q_len + i` and attends to every KV position <= its own:
    out[t, h] = softmax(scale * q[t, h] @ K_b[:pos+1]^T) @ V_b[:pos+1]     (kv head h // group)
Caches are `[num_blocks, block_size, num_kv_heads, head_dim]`; block_tables `[batch, max_blocks]`.

One program computes BLOCK_M query rows of one request and one query head, flash-attention style
(online softmax in float32, KV streamed in BLOCK_N tiles, stopping at the tile's last query
position). Reading KV through the block table makes prefix-cached and chunked prefill the same
case as a plain prefill. Operands are upcast to float32 (see `dot_precision` in _common.py).
"""

import math

import torch
import triton
import triton.language as tl

from kvflow.kernels._common import (
    FLOAT_DTYPES,
    block_dim,
    check_contiguous,
    check_device,
    check_dtype,
    check_kv_cache,
    check_last_dim_contiguous,
    check_shape,
    dot_precision,
)
from kvflow.kernels._paged import kv_tile_offsets, online_softmax_update

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # KV positions per tile


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    m_block = tl.program_id(0)
    batch_idx = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + batch_idx)
    q_len = tl.load(cu_seqlens_q_ptr + batch_idx + 1) - q_start
    # The grid is sized for the longest request; shorter ones have spare row blocks.
    if m_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + batch_idx)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the request
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_md = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len - q_len + offs_m  # [BLOCK_M] absolute position of each query
    rows = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of the packed q
    q_offs = rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_md, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + batch_idx.to(tl.int64) * stride_bt
    # Causal: nothing past the last query position of this row block is ever attended to.
    kv_end = tl.minimum(context_len, context_len - q_len + (m_block + 1) * BLOCK_M)
    for tile_start in range(0, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] KV positions
        mask_n = offs_n < kv_end
        kv_offs = kv_tile_offsets(block_table_ptr, offs_n, mask_n, kv_head, offs_d,
                                  BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        mask_nd = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        causal = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(causal, s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    out_offs = (rows[:, None] * NUM_HEADS + head) * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


def _check_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q: expected [num_tokens, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} not a multiple of num_kv_heads {num_kv_heads}")
    check_dtype("q", q, FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    batch = context_lens.shape[0]
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    check_contiguous("cu_seqlens_q", cu_seqlens_q)
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_contiguous("context_lens", context_lens)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_last_dim_contiguous("block_tables", block_tables)
    check_device(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention over paged KV; returns `[num_tokens, num_heads, head_dim]` in q's dtype.

    `max_seqlen_q` (longest q_len in the batch) sizes the grid; pass it when the host knows it,
    otherwise it is read from `cu_seqlens_q`, which synchronizes with the device.
    """
    _check_args(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    if num_tokens == 0 or max_seqlen_q == 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_dim(head_dim, 16),
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: per request, gather its KV, repeat kv heads, float32 softmax under a causal
    mask offset by the cached prefix length."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(context_lens.shape[0]):
        q_start, q_end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        context_len = int(context_lens[b])
        if q_end == q_start:
            continue
        positions = torch.arange(context_len, device=q.device)
        block_ids = block_tables[b, positions // block_size].long()
        k = k_cache[block_ids, positions % block_size].float()  # [context_len, num_kv_heads, head_dim]
        v = v_cache[block_ids, positions % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [context_len, num_heads, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q_pos = torch.arange(context_len - (q_end - q_start), context_len, device=q.device)
        scores = torch.einsum("thd,nhd->htn", q[q_start:q_end].float(), k) * scale
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q_start:q_end] = torch.einsum("htn,nhd->thd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)
