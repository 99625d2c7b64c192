"""RMSNorm and fused residual-add + RMSNorm, with HF Llama/Qwen rounding.

    rms_norm(x)             = weight * (x * rsqrt(mean(x^2) + eps))       statistics in float32
    fused_add_rms_norm(x,r) = (rms_norm(x + r), x + r)

x `[..., hidden]`; one program normalizes one row (the whole hidden dim fits one tile, up to the
8k-16k hidden sizes of current models). The kernel rounds where HF rounds: the normalized value is
cast to x's dtype before the weight multiply, and `x + r` is rounded to x's dtype before it is
normalized (it is also the new residual stream). The results then match HF up to the rounding of
the float32 statistics, which keeps greedy outputs comparable with transformers. Outputs are new
tensors.
"""

import torch
import triton
import triton.language as tl

from kvflow.kernels._common import (
    FLOAT_DTYPES,
    block_dim,
    check_device,
    check_dtype,
    check_shape,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, eps,
    stride_x, stride_r,
    HIDDEN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x_rounded = (x + r).to(new_residual_ptr.dtype.element_ty)  # HF adds in the model dtype
        tl.store(new_residual_ptr + row * HIDDEN + offs, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF: .to(input_dtype) first
    tl.store(out_ptr + row * HIDDEN + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """View `[..., hidden]` as `[rows, hidden]` with a packed last dim (copies only if it must)."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("weight", weight, (hidden,))
    check_device(x, weight, *([] if residual is None else [residual]))
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    x_rows = _as_rows(x, hidden)  # [num_rows, hidden]
    r_rows = x_rows if residual is None else _as_rows(residual, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(out)
    if x_rows.shape[0] > 0:
        block = block_dim(hidden)
        _rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, r_rows, weight, out, out if new_residual is None else new_residual, eps,
            x_rows.stride(0), r_rows.stride(0),
            HIDDEN=hidden, ADD_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x `[..., hidden]`; returns a new tensor in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors in x's dtype."""
    check_shape("residual", residual, tuple(x.shape))
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: transformers' LlamaRMSNorm.forward, verbatim in substance."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the decoder layer's `residual + hidden_states` in the model dtype, then RMSNorm."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
