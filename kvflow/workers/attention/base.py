"""Attention backends: one interface (this module), four implementations, one module each
(docs/design.md).

A backend owns
- its KV cache layout (`cache_shape`, per layer, for K and for V alike),
- its per-step metadata, built from the per-request view the model runner computes for every
  backend (`SeqSpan`: first packed row, q_len, context_len, block ids), split into decodes
  (q_len 1) and prefills (the rest),
- storing the step's K/V (`store_kv`) and attending (`attend`).

- `torch` (torch_backend.py): plain torch, the reference and the CPU fallback
  (kvflow/kernels/torch_attention.py); head-major cache
  `[num_kv_heads, num_blocks * block_size, head_dim]`.
- `cpu` (cpu_backend.py): the torch layout, with kvflow's C kernels (kvflow/kernels/cpu_ops.c)
  for the KV store and for the attention of every query row, decodes and prefills alike. CPU,
  float32/bfloat16.
- `triton` (paged.py): kvflow's Triton kernels (kvflow/kernels: store_kv, paged decode with
  split-K, paged varlen prefill); cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
  CUDA, or CPU under `TRITON_INTERPRET=1` (slow, for tests).
- `flash_attn` (flash_backend.py): flash-attn's paged API (`flash_attn_with_kvcache` for
  decodes, `flash_attn_varlen_func` with a block table for prefills) on the triton layout; the
  KV store is kvflow's Triton kernel. CUDA only, block_size a multiple of 256, float16 or
  bfloat16.

`auto` (resolved by the worker, see `selection.resolve_backend`): flash_attn when it imports on
CUDA and the block size and dtype fit, else triton on CUDA; on CPU cpu when the C kernels build
and the dtype is float32/bfloat16, else torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What every backend needs; each backend's metadata subclasses it."""
    slot_mapping: torch.Tensor                  # [num_tokens] cache slot of each new token


class SeqSpan(NamedTuple):
    """One scheduled request as every backend sees it."""
    first_row: int                   # its first row in the step's packed tokens
    num_query_tokens: int            # tokens computed this step (1: a decode)
    context_len: int                 # keys its last query token sees, itself included
    block_ids: np.ndarray            # its block table


def block_tables(spans: list[SeqSpan], block_size: int) -> np.ndarray:
    """[batch, max_blocks] int32; past a request's last block: 0 (any valid block id)."""
    num_blocks = [-(-span.context_len // block_size) for span in spans]
    table = np.zeros((len(spans), max(num_blocks)), dtype=np.int32)
    for i, (n, span) in enumerate(zip(num_blocks, spans)):
        table[i, :n] = span.block_ids[:n]
    return table


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`; on CUDA through pinned memory, without waiting
    (the caching host allocator keeps the pinned block alive until the copy is done)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class AttentionBackend:
    name = "?"
    supports_cuda_graphs = False     # decode metadata from static buffers, shapes fixed
    # The KV store for this layout: (key, value, k_cache, v_cache, slot_mapping) -> None.
    _store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     None]

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        self.block_size = block_size
        self.kv_shape = (num_kv_heads, head_dim)     # per rank
        self.dtype = dtype                           # queries and outputs
        self.kv_dtype = kv_dtype or dtype            # the cache (bfloat16 under float32: cpu)
        self.device = device

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def build_metadata(self, slot_mapping: np.ndarray, decodes: list[SeqSpan],
                       prefills: list[SeqSpan]) -> AttentionMetadata:
        raise NotImplementedError

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the step's new K/V rows into the caches at meta.slot_mapping."""
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
