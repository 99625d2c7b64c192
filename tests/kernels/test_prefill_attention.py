from typing import Any, Callable

import pytest
import torch

from kvflow.kernels.decode_attention import paged_decode_attention
from kvflow.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

# One rounding of the output (the interpreter truncates bf16, so up to 2**-7 relative) plus
# float32 accumulation-order noise (and tf32 rounding of the probabilities on a GPU).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
BLOCK_SIZE = 16
# (q_len, context_len): no new tokens; a lone first token; one new token after a prefix (decode
# through the prefill path); a full prefill spanning two row blocks; chunks after a block-aligned
# and an unaligned prefix.
REQUESTS = [(0, 5), (1, 1), (1, 40), (37, 37), (10, 26), (5, 21)]
MakeKV = Callable[..., Any]  # the `paged_kv` fixture from conftest.py


def _cu_seqlens(q_lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)


def _run(
    paged_kv: MakeKV, device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
    head_dim: int, requests: list[tuple[int, int]] = REQUESTS, max_seqlen_q: int | None = None,
    block_size: int = BLOCK_SIZE,
) -> None:
    q_lens = [q_len for q_len, _ in requests]
    kv = paged_kv([ctx for _, ctx in requests], block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    args = (q, kv.k_cache, kv.v_cache, _cu_seqlens(q_lens, device), kv.context_lens, kv.block_tables, scale)
    out = paged_prefill_attention(*args, max_seqlen_q=max_seqlen_q)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratios 1, 3, 8
def test_prefill_matches_reference(
    paged_kv: MakeKV, device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
) -> None:
    _run(paged_kv, device, dtype, num_heads, num_kv_heads, 32)


def test_prefill_head_dim_128_with_explicit_max_seqlen(paged_kv: MakeKV, device: str) -> None:
    _run(paged_kv, device, torch.bfloat16, 3, 1, 128, requests=[(33, 40), (2, 2)], max_seqlen_q=33)


def test_prefill_blocks_larger_than_tiles(paged_kv: MakeKV, device: str) -> None:
    _run(paged_kv, device, torch.float16, 4, 2, 32, requests=[(20, 90), (3, 3)], block_size=64)


def test_prefill_all_requests_empty(paged_kv: MakeKV, device: str) -> None:
    _run(paged_kv, device, torch.float32, 2, 1, 32, requests=[(0, 3), (0, 0)])


def test_prefill_first_token_attends_only_itself(paged_kv: MakeKV, device: str) -> None:
    # Causality, independent of the reference: with no prefix, token 0 sees only v[0].
    kv = paged_kv([12], BLOCK_SIZE, 1, 32, torch.float32, device)
    q = torch.randn(12, 2, 32, device=device)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, _cu_seqlens([12], device),
                                  kv.context_lens, kv.block_tables, 0.5)
    v0 = kv.v_cache[kv.block_tables[0, 0].long(), 0, 0]  # [head_dim]
    torch.testing.assert_close(out[0], v0.expand(2, 32), **TOLERANCES[torch.float32])


def test_prefill_single_tokens_match_decode(paged_kv: MakeKV, device: str) -> None:
    # q_len 1 per request through the prefill kernel is exactly a decode step.
    kv = paged_kv([1, 30, 17], BLOCK_SIZE, 3, 32, torch.float32, device)
    q = torch.randn(3, 9, 32, device=device)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, _cu_seqlens([1, 1, 1], device),
                                  kv.context_lens, kv.block_tables, 0.25)
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25)
    torch.testing.assert_close(out, decode, **TOLERANCES[torch.float32])


def test_prefill_strided_q(paged_kv: MakeKV, device: str) -> None:
    kv = paged_kv([9, 30], BLOCK_SIZE, 2, 32, torch.float32, device)
    qkv = torch.randn(9 + 4, 4 + 2 * 2, 32, device=device)
    q = qkv[:, :4]  # rows strided like a slice of a fused qkv projection
    args = (q, kv.k_cache, kv.v_cache, _cu_seqlens([9, 4], device), kv.context_lens, kv.block_tables, 0.3)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args),
                               **TOLERANCES[torch.float32])


def test_prefill_reference_matches_sdpa(paged_kv: MakeKV, device: str) -> None:
    # The reference itself, against torch's causal SDPA for a request with no cached prefix.
    kv = paged_kv([21], BLOCK_SIZE, 1, 32, torch.float32, device)
    q = torch.randn(21, 2, 32, device=device)
    ref = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, _cu_seqlens([21], device),
                                      kv.context_lens, kv.block_tables, 0.3)
    k = kv.k_cache[kv.block_tables[0, :2].long()].reshape(-1, 1, 32)[:21]  # [21, 1, 32]
    v = kv.v_cache[kv.block_tables[0, :2].long()].reshape(-1, 1, 32)[:21]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).expand(2, -1, -1), v.transpose(0, 1).expand(2, -1, -1),
        is_causal=True, scale=0.3)  # [2, 21, 32]
    torch.testing.assert_close(ref, sdpa.transpose(0, 1), **TOLERANCES[torch.float32])


def test_prefill_rejects_bad_arguments(paged_kv: MakeKV, device: str) -> None:
    kv = paged_kv([4], BLOCK_SIZE, 2, 32, torch.float32, device)
    q = torch.randn(4, 4, 32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, _cu_seqlens([4], device).long(),
                                kv.context_lens, kv.block_tables, 1.0)
    with pytest.raises(ValueError, match="q"):
        paged_prefill_attention(q[..., :16], kv.k_cache, kv.v_cache, _cu_seqlens([4], device),
                                kv.context_lens, kv.block_tables, 1.0)
