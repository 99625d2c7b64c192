import pytest
import torch

from kvflow.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

# One rounding of the output (the interpreter truncates bf16, so up to 2**-7 relative) plus
# float32 accumulation-order noise.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
BLOCK_SIZE = 16
# (q_len, context_len): no new tokens; a lone first token; one new token after a prefix (decode
# through the prefill path); a full prefill spanning two row blocks; chunks after a block-aligned
# and an unaligned prefix.
REQUESTS = [(0, 5), (1, 1), (1, 40), (37, 37), (10, 26), (5, 21)]


def _cu_seqlens(q_lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)


def _run(paged_kv, device, dtype, num_heads, num_kv_heads, head_dim, requests=REQUESTS, max_seqlen_q=None):
    q_lens = [q_len for q_len, _ in requests]
    kv = paged_kv([ctx for _, ctx in requests], BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    cu_seqlens_q = _cu_seqlens(q_lens, device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    args = (q, kv.k_cache, kv.v_cache, cu_seqlens_q, kv.context_lens, kv.block_tables, scale)
    out = paged_prefill_attention(*args, max_seqlen_q=max_seqlen_q)
    ref = paged_prefill_attention_ref(*args)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_prefill_matches_reference(paged_kv, device, dtype, num_heads, num_kv_heads):
    _run(paged_kv, device, dtype, num_heads, num_kv_heads, 32)


def test_prefill_head_dim_128_with_explicit_max_seqlen(paged_kv, device):
    _run(paged_kv, device, torch.bfloat16, 3, 1, 128, requests=[(33, 40), (2, 2)], max_seqlen_q=33)


def test_prefill_all_requests_empty(paged_kv, device):
    _run(paged_kv, device, torch.float32, 2, 1, 32, requests=[(0, 3), (0, 0)])


def test_prefill_first_token_attends_only_itself(paged_kv, device):
    # Causality check independent of the reference: with no prefix, token 0 sees only v[0].
    kv = paged_kv([12], BLOCK_SIZE, 1, 32, torch.float32, device)
    q = torch.randn(12, 2, 32, device=device)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, _cu_seqlens([12], device),
                                  kv.context_lens, kv.block_tables, 0.5)
    v0 = kv.v_cache[kv.block_tables[0, 0].long(), 0, 0]  # [head_dim]
    torch.testing.assert_close(out[0], v0.expand(2, 32), **TOLERANCES[torch.float32])


def test_prefill_strided_q(paged_kv, device):
    kv = paged_kv([9, 30], BLOCK_SIZE, 2, 32, torch.float32, device)
    qkv = torch.randn(9 + 4, 4 + 2 * 2, 32, device=device)
    q = qkv[:, :4]  # rows strided like a slice of a fused qkv projection
    args = (q, kv.k_cache, kv.v_cache, _cu_seqlens([9, 4], device), kv.context_lens, kv.block_tables, 0.3)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args),
                               **TOLERANCES[torch.float32])


def test_prefill_rejects_bad_arguments(paged_kv, device):
    kv = paged_kv([4], BLOCK_SIZE, 2, 32, torch.float32, device)
    q = torch.randn(4, 4, 32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, _cu_seqlens([4], device).long(),
                                kv.context_lens, kv.block_tables, 1.0)
    with pytest.raises(ValueError, match="q"):
        paged_prefill_attention(q[..., :16], kv.k_cache, kv.v_cache, _cu_seqlens([4], device),
                                kv.context_lens, kv.block_tables, 1.0)
