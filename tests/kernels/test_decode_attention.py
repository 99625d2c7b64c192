from typing import Any, Callable

import pytest
import torch

from kvflow.kernels.decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

# Outputs are compared in the kernel's dtype: one rounding of the result is one ulp (bf16 2**-8
# relative, and the interpreter truncates instead of rounding, so up to 2**-7), plus float32
# accumulation-order noise (and tf32 rounding of the probabilities on a GPU).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
BLOCK_SIZE = 16
# Empty, single token, exactly one block, not multiples of the block size, several tiles.
CONTEXT_LENS = [0, 1, 16, 23, 70]
MakeKV = Callable[..., Any]  # the `paged_kv` fixture from conftest.py


def _run(
    paged_kv: MakeKV, device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
    head_dim: int, num_splits: int | None, context_lens: list[int] = CONTEXT_LENS,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    kv = paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(context_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOLERANCES[dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("num_splits", [1, 3])  # split-K off / forced on
def test_decode_matches_reference(
    paged_kv: MakeKV, device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, num_splits: int,
) -> None:
    _run(paged_kv, device, dtype, num_heads, num_kv_heads, 64, num_splits)


def test_decode_empty_context_gives_zeros(paged_kv: MakeKV, device: str) -> None:
    for num_splits in (1, 4):
        out = _run(paged_kv, device, torch.float32, 2, 1, 32, num_splits, context_lens=[0, 5])
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("head_dim", [128, 80])
def test_decode_head_dims(paged_kv: MakeKV, device: str, head_dim: int) -> None:
    # 128: the common size; 80: not a power of two, so the head_dim tile is masked.
    _run(paged_kv, device, torch.bfloat16, 8, 1, head_dim, 2, context_lens=[33, 9])


def test_decode_blocks_larger_than_tiles(paged_kv: MakeKV, device: str) -> None:
    # block_size 64 > the kernel's 32-position tile: several tiles read the same block.
    _run(paged_kv, device, torch.float16, 6, 2, 32, 2, context_lens=[100, 64, 3], block_size=64)


def test_decode_auto_splits(paged_kv: MakeKV, device: str) -> None:
    _run(paged_kv, device, torch.float16, 9, 3, 64, None)


def test_decode_more_splits_than_tiles(paged_kv: MakeKV, device: str) -> None:
    # Most splits are empty: the merge must ignore them.
    _run(paged_kv, device, torch.float32, 6, 3, 32, 8, context_lens=[3, 40])


def test_decode_strided_q(paged_kv: MakeKV, device: str) -> None:
    # q as a slice of a fused qkv projection output: rows strided, heads packed.
    kv = paged_kv([20, 7], BLOCK_SIZE, 2, 32, torch.float32, device)
    qkv = torch.randn(2, 6 + 2 * 2, 32, device=device)
    q = qkv[:, :6]
    assert not q.is_contiguous()
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2)
    out = paged_decode_attention(*args, num_splits=2)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOLERANCES[torch.float32])


def test_decode_reference_matches_sdpa(paged_kv: MakeKV, device: str) -> None:
    # The reference itself, against torch's SDPA on the same KV laid out contiguously.
    kv = paged_kv([37], BLOCK_SIZE, 2, 32, torch.float32, device)
    q = torch.randn(1, 6, 32, device=device)
    ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    k = kv.k_cache[kv.block_tables[0, :3].long()].reshape(-1, 2, 32)[:37]  # [37, 2, 32]
    v = kv.v_cache[kv.block_tables[0, :3].long()].reshape(-1, 2, 32)[:37]
    k = k.transpose(0, 1).repeat_interleave(3, 0)  # [6, 37, 32]
    v = v.transpose(0, 1).repeat_interleave(3, 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, scale=0.3)  # [6, 1, 32]
    torch.testing.assert_close(ref, sdpa.transpose(0, 1), **TOLERANCES[torch.float32])


def test_choose_num_splits() -> None:
    """The rows timed on an H200 (decode_attention.py's table) get their fastest split count."""
    def splits(batch: int, max_context: int, num_kv_heads: int = 8) -> int:
        return choose_num_splits(batch, num_kv_heads, max_context, num_sms=132)
    assert [splits(1, 512), splits(1, 4096), splits(4, 4096), splits(16, 2048), splits(32, 2048),
            splits(64, 1024)] == [16, 64, 16, 4, 2, 1]
    # Contexts under two tiles never split; long ones stop at MAX_SPLITS.
    assert splits(1, 63) == 1 and splits(1, 1 << 20, num_kv_heads=1) == MAX_SPLITS


def test_decode_rejects_bad_arguments(paged_kv: MakeKV, device: str) -> None:
    kv = paged_kv([5], BLOCK_SIZE, 2, 32, torch.float32, device)
    q = torch.randn(1, 4, 32, device=device)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens, 1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(q[:, :3], kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0)
    strided_cache = kv.k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, not contiguous
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, strided_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0, num_splits=0)
