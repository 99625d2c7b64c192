"""Write new tokens' keys and values into the paged KV cache.

Layout: `k_cache`/`v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, so a
token's slot `block_id * block_size + offset` addresses one `[num_kv_heads, head_dim]` row of the
cache viewed as `[num_blocks * block_size, num_kv_heads, head_dim]`; the kernel never needs to
split a slot into block and offset. One program copies one token (all its kv heads) for both K
and V. Slot -1 marks padded rows (CUDA-graph batches padded to a captured size): skipped.
"""

import torch
import triton
import triton.language as tl

from kvflow.kernels._common import (
    INDEX_DTYPES,
    block_dim,
    check_device,
    check_dtype,
    check_kv_cache,
    check_last_dim_contiguous,
    check_shape,
)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: slot * row_size overflows int32 once the cache passes 2**31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # Plain copies, cast only if the cache dtype differs from the activations'.
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy key/value `[num_tokens, num_kv_heads, head_dim]` into the caches at `slot_mapping`, in place.

    key/value may be row-strided views (e.g. slices of a fused qkv output) as long as the last
    dim is packed. Rows whose slot is negative are skipped.
    """
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    check_device(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_dim(num_kv_heads), BLOCK_D=block_dim(head_dim),
    )


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: one token at a time, skipping negative slots. In place, like `store_kv`."""
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        k_cache[block_id, offset] = key[token]
        v_cache[block_id, offset] = value[token]
