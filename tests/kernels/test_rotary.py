from typing import Any

import pytest
import torch

from kvflow.kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache

# float32 math on both sides; one output rounding (bf16 truncated under the interpreter).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
MAX_POSITION = 128


def _check(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype,
) -> None:
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert q_out is q and k_out is k  # in place
    torch.testing.assert_close(q, q_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_rotary_matches_reference(
    device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
) -> None:
    head_dim, num_tokens = 64, 7
    cache = build_cos_sin_cache(MAX_POSITION, head_dim, 10000.0, device=device)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    _check(q, k, positions, cache, dtype)


def test_rotary_partial_on_fused_qkv_views(device: str) -> None:
    # Partial rotary (32 of 48 dims) on q/k views into one qkv buffer; v must stay untouched.
    num_tokens, head_dim = 5, 48
    qkv = torch.randn(num_tokens, 3 + 1 + 1, head_dim, device=device)
    v_before = qkv[:, 4].clone()
    q, k = qkv[:, :3], qkv[:, 3:4]
    positions = torch.tensor([0, 1, 77, 5, 5], dtype=torch.int32, device=device)
    cache = build_cos_sin_cache(MAX_POSITION, 32, 500.0, device=device)
    _check(q, k, positions, cache, torch.float32)
    assert torch.equal(qkv[:, 4], v_before)


def test_rotary_position_zero_is_identity(device: str) -> None:
    q = torch.randn(2, 2, 16, device=device)
    k = torch.randn(2, 1, 16, device=device)
    q0, k0 = q.clone(), k.clone()
    cache = build_cos_sin_cache(4, 16, 10000.0, device=device)
    apply_rotary(q, k, torch.zeros(2, dtype=torch.long, device=device), cache)
    torch.testing.assert_close(q, q0, **TOLERANCES[torch.float32])
    torch.testing.assert_close(k, k0, **TOLERANCES[torch.float32])


def test_rotary_rejects_bad_cache(device: str) -> None:
    q, k = torch.randn(2, 2, 16, device=device), torch.randn(2, 1, 16, device=device)
    positions = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(q, k, positions, torch.randn(4, 32, device=device))
