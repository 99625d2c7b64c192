"""SwiGLU activation of a fused gate/up projection: `silu(x[:, :d]) * x[:, d:]`.

x `[num_tokens, 2 * d]` is the output of the merged gate_up projection (gate first, as in vLLM's
MergedColumnParallelLinear); the result `[num_tokens, d]` is a new contiguous tensor. Fusing saves
reading x twice and writing the silu intermediate. Grid: (token, tile of d).

Rounding follows HF's `act_fn(gate) * up` in the model dtype: silu is evaluated in float32 and
rounded to x's dtype, then multiplied by `up` and rounded again.
"""

import torch
import triton
import triton.language as tl

from kvflow.kernels._common import (
    FLOAT_DTYPES,
    block_dim,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
)

MAX_BLOCK = 1024  # columns per program; wider rows get more programs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds here
    tl.store(out_ptr + token * D + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, 2 * d]` -> `silu(x[:, :d]) * x[:, d:]`, `[num_tokens, d]` in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x: expected [num_tokens, 2 * d], got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_device(x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(block_dim(d), MAX_BLOCK)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](x, out, x.stride(0), D=d, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: HF LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)` on the pre-split halves."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
