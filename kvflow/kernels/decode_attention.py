"""Paged attention for decode: one new query token per request against its paged KV cache.

Computes, per request b and query head h (kv head `h // group`, the HF repeat_kv convention):
    out[b, h] = softmax(scale * q[b, h] @ K_b^T) @ V_b
over the first `context_lens[b]` cached positions (the query's own K/V are already stored).
Layout: q `[batch, num_heads, head_dim]`; caches `[num_blocks, block_size, num_kv_heads, head_dim]`;
block_tables `[batch, max_blocks]` int32.

One program serves one (request, kv head): it loads each K/V tile once for all `group` query heads
sharing that kv head, which is what makes GQA decode cheap (decode is bound by reading the cache).
The group's query heads form the M side of tl.dot, padded to 16 rows as tl.dot requires.

Split-K (flash-decoding): with few requests the grid above leaves most SMs idle, so the context is
cut into `num_splits` ranges, each program writes a partial result (normalized output and its
log-sum-exp), and a second kernel merges them. The split count is chosen on the host from shapes
only (never from context_lens values), so the launch stays valid under CUDA-graph capture.
"""

import functools
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

BLOCK_N = 32  # KV positions per tile
# Split-K sizing, from graph-replayed timings on an H200 (132 SMs; Qwen3-0.6B's 16/8 heads,
# head_dim 128, bf16; us for 1/2/4/8/16/64 splits):
#   batch 1, 512 positions:   18.5 11.2  7.9  6.0  5.4  6.9
#   batch 1, 4096 positions: 132.6 67.4 36.1 20.3 12.7  9.8
#   batch 4, 4096 positions: 184.5 94.5 51.8 33.7 26.2 31.5
#   batch 16, 2048:           97.3 60.1 44.5 46.1 49.5 69.5
#   batch 32, 2048:          111.7 80.6 82.6 86.2 93.1 133.8
#   batch 64, 1024:           79.1 82.1 87.9 94.0 107.1 180.6
# The fastest in every row: split while there are fewer than two (request, kv head) programs
# per SM, into the power of two that brings them to two per SM or more, down to one tile a split.
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = BLOCK_N
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_splits,
    stride_qb, stride_qh, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_idx = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + batch_idx)
    # Tile-aligned split ranges, so only the last tile of a split is partial.
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split_idx * split_len
    end = tl.minimum(start + split_len, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    group = NUM_HEADS // NUM_KV_HEADS  # query heads per kv head (constexpr)
    heads = kv_head * group + offs_g  # [BLOCK_G] query heads served by this kv head
    mask_gd = (offs_g[:, None] < group) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_G, BLOCK_D]
    q_offs = batch_idx.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_gd, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + batch_idx.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_offs = kv_tile_offsets(block_table_ptr, offs_n, mask_n, kv_head, offs_d,
                                  BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        mask_nd = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, PRECISION)

    # An empty context (or empty split) has l = 0 and acc = 0: output zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_G, BLOCK_D]
    row = batch_idx.to(tl.int64) * NUM_HEADS + heads  # [BLOCK_G] flat (request, head) index
    if SPLIT:
        part_row = row * num_splits + split_idx
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_gd)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_G], log2 units
        tl.store(part_lse_ptr + part_row, lse, mask=offs_g < group)
    else:
        out_offs = row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_s w_s * out_s / sum_s w_s with w_s = 2^(lse_s - max lse): exact softmax merge."""
    row = tl.program_id(0).to(tl.int64)  # flat (request, head) index
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights 0
    w = tl.exp2(lse - lse_max)  # [BLOCK_S]
    mask_sd = mask_s[:, None] & (offs_d[None, :] < HEAD_DIM)
    part_offs = (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    part = tl.load(part_out_ptr + part_offs, mask=mask_sd, other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    mask_d = offs_d < HEAD_DIM
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-K factor: 1 with PROGRAMS_PER_SM (request, kv head) programs per SM or more; else
    the power of two that reaches that many, bounded by MIN_SPLIT_TOKENS a split and MAX_SPLITS."""
    num_programs = batch * num_kv_heads
    target = PROGRAMS_PER_SM * num_sms
    if num_programs >= target or max_context < 2 * MIN_SPLIT_TOKENS:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(target, num_programs))
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _check_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q: expected [batch, num_heads, {head_dim}], got {tuple(q.shape)}")
    batch, num_heads, _ = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    check_dtype("q", q, FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_last_dim_contiguous("block_tables", block_tables)
    check_shape("context_lens", context_lens, (batch,))
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_contiguous("context_lens", context_lens)
    check_device(q, k_cache, v_cache, block_tables, context_lens)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged KV; returns `[batch, num_heads, head_dim]`
    in q's dtype. `num_splits=None` picks split-K automatically; 1 disables it; >1 forces it."""
    _check_args(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size  # an upper bound known without a sync
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    split = num_splits > 1
    # Partial results in float32 so the merge adds no rounding of its own.
    part_out = torch.empty(batch, num_heads, num_splits if split else 0, head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits if split else 0,
                           dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, SPLIT=split, PRECISION=dot_precision(q.dtype),
        BLOCK_G=block_dim(num_heads // num_kv_heads, 16), BLOCK_N=BLOCK_N,
        BLOCK_D=block_dim(head_dim, 16),
    )
    if split:
        _merge_splits_kernel[(batch * num_heads,)](
            part_out, part_lse, out, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=block_dim(num_splits), BLOCK_D=block_dim(head_dim),
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: per request, gather its KV positions, repeat kv heads, plain float32 softmax."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        context_len = int(context_lens[b])
        if context_len == 0:
            continue
        positions = torch.arange(context_len, device=q.device)
        block_ids = block_tables[b, positions // block_size].long()
        k = k_cache[block_ids, positions % block_size].float()  # [context_len, num_kv_heads, head_dim]
        v = v_cache[block_ids, positions % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [context_len, num_heads, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [num_heads, context_len]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)
