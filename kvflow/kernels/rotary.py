"""Rotary position embedding, neox style (rotate-half, as in HF Llama/Qwen), applied in place.

For a head vector x and its token's position p, with half = rotary_dim // 2:
    x1, x2 = x[:half], x[half:rotary_dim]
    x[:half]           = x1 * cos[p] - x2 * sin[p]
    x[half:rotary_dim] = x2 * cos[p] + x1 * sin[p]
and x[rotary_dim:] is left alone (partial rotary). `cos_sin_cache` is `[max_position, rotary_dim]`:
cos in the first half of each row, sin in the second.

In place because q and k are usually views into the fused qkv projection output: rotating them
where they lie saves two allocations and copies per layer, and q/k keep their strides. One program
handles one token: it reads cos/sin once and rotates all q heads and all k heads. Math in float32.
"""

import torch
import triton
import triton.language as tl

from kvflow.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    block_dim,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
)


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate the first 2*HALF dims of `num_heads` heads starting at x_ptr; cos/sin: [BLOCK_HALF]."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_r[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    x1_ptrs = x_ptr + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(x1_ptrs, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x1_ptrs + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask_r = offs_r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, num_heads, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, num_kv_heads, HALF, BLOCK_HK, BLOCK_HALF)


def _check_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q, k: expected 3-d [num_tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k: expected [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}")
    check_shape("positions", positions, (num_tokens,))
    check_dtype("positions", positions, INDEX_DTYPES)
    if num_tokens > 1 and positions.stride(0) != 1:
        raise ValueError(f"positions must be contiguous, got stride {positions.stride()}")
    check_dtype("q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache: expected [max_position, even rotary_dim <= {head_dim}], "
                         f"got {tuple(cos_sin_cache.shape)}")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    check_device(q, k, positions, cos_sin_cache)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[num_tokens, num_heads, head_dim]` and k `[num_tokens, num_kv_heads, head_dim]` IN
    PLACE by their tokens' `positions` `[num_tokens]`; returns the same (q, k) for chaining."""
    _check_args(q, k, positions, cos_sin_cache)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_HQ=block_dim(num_heads), BLOCK_HK=block_dim(num_kv_heads),
        BLOCK_HALF=block_dim(half),
    )
    return q, k


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` on the rotary dims, float32; cos/sin [num_tokens, half]."""
    half = cos.shape[-1]
    x = x.float()
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: returns NEW rotated (q, k) in the input dtype; inputs are not modified."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [num_tokens, half] each
    return _rotate_ref(q, cos, sin).to(q.dtype), _rotate_ref(k, cos, sin).to(k.dtype)


def build_cos_sin_cache(
    max_position: int, rotary_dim: int, base: float, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Plain (unscaled) RoPE table `[max_position, rotary_dim]` in the layout apply_rotary reads."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)  # [max_position, rotary_dim]
