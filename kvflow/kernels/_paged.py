"""Triton helpers shared by the paged attention kernels (decode and prefill).

Both kernels walk a request's KV in tiles of BLOCK_N token positions. A tile may straddle cache
blocks, so each position is translated on its own: `block_tables[pos // BLOCK_SIZE]` gives the
block, `pos % BLOCK_SIZE` the row inside it. This keeps BLOCK_N independent of the cache block
size (16 on CPU, up to 256 for flash-attn compatibility) at the price of a gathered load.
"""

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(
    block_table_ptr, offs_n, mask_n, kv_head, offs_d,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Element offsets `[BLOCK_N, BLOCK_D]` of positions `offs_n` of one kv head in a contiguous
    `[num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]` cache; `block_table_ptr` is the request's row.
    """
    # Masked positions read block 0 (any valid block) and are masked again at the load.
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    slots = block_ids * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N]
    return (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One flash-attention step: fold scores `s` [M, N] (log2 units, -inf where masked) and values
    `v` [N, D] into the running row max `m_i` [M], denominator `l_i` [M] and output `acc` [M, D].
    All float32.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    # A row that has seen only masked scores keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)  # [M] rescales what was accumulated under the old max
    p = tl.exp2(s - m_shift[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc
