from typing import Any

import pytest
import torch

from kvflow.kernels.kv_store import store_kv, store_kv_ref

# A store is a copy: anything but bit-exact is a bug.
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=0.0, rtol=0.0),
    torch.float16: dict(atol=0.0, rtol=0.0),
    torch.bfloat16: dict(atol=0.0, rtol=0.0),
}
NUM_BLOCKS, BLOCK_SIZE = 6, 16


def _caches(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _check(
    key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
) -> None:
    k_cache, v_cache = _caches(num_kv_heads, head_dim, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    store_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(v_cache, v_ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(device: str, dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    num_kv_heads, head_dim = 3, 64
    # Scattered slots across shuffled blocks, plus -1 rows (padded CUDA-graph entries) to skip.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:9].tolist() + [-1, -1]
    slot_mapping = torch.tensor(slots, dtype=slot_dtype, device=device)
    key = torch.randn(len(slots), num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, device=device).to(dtype)
    _check(key, value, slot_mapping, num_kv_heads, head_dim, dtype, device)


def test_store_kv_skips_padded_rows(device: str) -> None:
    # The caches sit one row into a larger buffer, so a slot -1 written by mistake lands in the
    # guard row in front of them instead of outside any allocation.
    num_rows, row = NUM_BLOCKS * BLOCK_SIZE, 16
    k_buffer = torch.randn((num_rows + 1) * row, device=device)
    k_cache = k_buffer[row:].view(NUM_BLOCKS, BLOCK_SIZE, 1, 16)
    v_cache = torch.randn_like(k_cache)
    before = k_buffer.clone()
    key = torch.full((2, 1, 16), 7.0, device=device)
    store_kv(key, key, k_cache, v_cache, torch.tensor([-1, 5], device=device))
    assert torch.equal(k_cache[0, 5], key[1])
    k_cache[0, 5] = before[row:].view_as(k_cache)[0, 5]
    assert torch.equal(k_buffer, before)  # nothing else written, guard row included


def test_store_kv_strided_views_and_odd_head_dim(device: str) -> None:
    # key/value as slices of a fused qkv output; head_dim 40 exercises the masked tile edge.
    num_kv_heads, head_dim = 2, 40
    qkv = torch.randn(5, 4 + 2 * num_kv_heads, head_dim, device=device)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slot_mapping = torch.tensor([17, 0, 95, 40, 41], device=device)
    _check(key, value, slot_mapping, num_kv_heads, head_dim, torch.float32, device)


def test_store_kv_empty_and_bad_arguments(device: str) -> None:
    k_cache, v_cache = _caches(2, 16, torch.float32, device)
    empty = torch.empty(0, 2, 16, device=device)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.long, device=device))
    key = torch.randn(3, 2, 16, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, k_cache, v_cache, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, k_cache, v_cache, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="key"):
        store_kv(key[..., :8], key, k_cache, v_cache, torch.zeros(3, dtype=torch.long, device=device))
