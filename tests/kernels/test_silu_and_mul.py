from typing import Any

import pytest
import torch

from kvflow.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

# The kernel rounds where HF does; left over is float32 sigmoid noise and, under the interpreter,
# bf16 truncation instead of round-to-nearest (one ulp, 2**-7).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,d", [(5, 96), (1, 1100), (0, 64)])  # 1100: two column tiles
def test_silu_and_mul_matches_reference(device: str, dtype: torch.dtype, num_tokens: int, d: int) -> None:
    x = (2 * torch.randn(num_tokens, 2 * d, device=device)).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, d) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOLERANCES[dtype])


def test_silu_and_mul_strided_rows_and_bad_shape(device: str) -> None:
    base = torch.randn(4, 200, device=device)
    x = base[:, :128]  # row stride 200
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(torch.randn(3, 7, device=device))
