"""Kernel tests run on CUDA when present, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before any module decorates a kernel with @triton.jit, so it is set
here, at conftest import time, ahead of the test modules that import kvflow.kernels.
"""

import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)  # every test draws the same inputs, run alone or in the suite


@pytest.fixture
def device() -> str:
    return DEVICE


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    context_lens: torch.Tensor  # [batch] int32


def make_paged_kv(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str, seed: int = 0,
) -> PagedKV:
    """A random cache whose blocks are handed out in shuffled order, with spare blocks full of
    noise (never attended) and block-table padding that points at other requests' blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_req, default=0) + 1  # one padding column past the longest request
    # Padding: arbitrary (but in-range) ids; a kernel that reads past a context gets wrong data.
    block_tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
    start = 0
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return PagedKV(
        k_cache.to(device), v_cache.to(device),
        block_tables.to(torch.int32).to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory fixture: `paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, device)`."""
    return make_paged_kv
