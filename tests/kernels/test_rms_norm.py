from typing import Any

import pytest
import torch

from kvflow.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

# Kernel and reference round at the same points; what is left is float32 noise in the statistics
# and, under the interpreter, bf16 truncation instead of round-to-nearest (one ulp, 2**-7).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
EPS = 1e-6


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# 96: not a power of two; 3-d: a per-head norm (Qwen3's q_norm / k_norm).
@pytest.mark.parametrize("shape", [(5, 96), (1, 64), (3, 4, 32)])
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, weight = _inputs(shape, dtype, device)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(device: str, dtype: torch.dtype) -> None:
    x, weight = _inputs((7, 80), dtype, device)
    residual = torch.randn(7, 80, device=device).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    out_ref, new_residual_ref = fused_add_rms_norm_ref(x, residual, weight, EPS)
    torch.testing.assert_close(new_residual, new_residual_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(out, out_ref, **TOLERANCES[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


def test_rms_norm_strided_rows_and_empty(device: str) -> None:
    base = torch.randn(6, 128, device=device)
    x = base[:, :64]  # row stride 128, last dim packed
    weight = torch.randn(64, device=device)
    torch.testing.assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS),
                               **TOLERANCES[torch.float32])
    assert rms_norm(torch.empty(0, 64, device=device), weight, EPS).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:32], EPS)
