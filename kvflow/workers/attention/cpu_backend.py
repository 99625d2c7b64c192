"""The `cpu` backend: the torch layout, with kvflow's C kernels (kvflow/kernels/cpu_ops.c) for
the KV store and the attention of every query row, decodes and prefills alike."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.kernels.torch_attention import TorchPrefill, cache_shape, prefill_attention
from kvflow.workers.attention.base import (AttentionBackend, AttentionMetadata, SeqSpan,
                                           block_tables)
from kvflow.workers.attention.torch_backend import TorchBackend
from kvflow.workers.hardware import cpu_flags

# bfloat16 prompts (prefill chunks) of at least this many tokens go to torch's SDPA on CPUs
# with AMX: its bfloat16 matmuls run on AMX there, and one 2048-token prompt's attention took
# 0.39x the kernel's tiles (0.63x at 512, 0.83x at 128; benchmarks/cpu_kernels.py). Where
# MKL's bfloat16 GEMM was held to plain AVX-512 SDPA took 1.1-1.7x the tiles, and float32
# SDPA takes 1.0-1.7x everywhere measured: elsewhere every row stays in the kernel.
SDPA_MIN_ROWS = 256


@dataclass(frozen=True)
class CpuMetadata(AttentionMetadata):
    block_tables: torch.Tensor      # [num_requests, max_blocks] int32
    table_rows: torch.Tensor        # [num_rows] int32: each query row's request
    context_lens: torch.Tensor      # [num_rows] int32: the keys each row sees, its own included
    q_rows: torch.Tensor            # [num_rows] int64: each row's packed row
    sdpa_prefills: list[TorchPrefill] = field(default_factory=list)   # long bf16 prompts (AMX)


class CpuBackend(AttentionBackend):
    """The torch backend's cache layout; kvflow/kernels/cpu_ops.c does the rest: it stores the
    new K/V rows (a memcpy a row instead of index_copy_), and attends for every query row,
    decode or prefill, in one call per layer, reading the paged cache in place (no block
    gathers, no bmm or SDPA calls). A prefill of n tokens after c cached ones is n rows with
    contexts c+1 .. c+n: causal attention, cached prefix included; the kernel takes such runs
    in flash-style tiles. float32 and bfloat16. On CPUs with AMX, bfloat16 prompts of
    SDPA_MIN_ROWS tokens or more go to torch's SDPA instead (the torch backend's prefill). The
    cache is asked for 2 MB pages (workers/huge_pages.py). The one backend whose cache
    may be bfloat16 under float32 arithmetic, or int8 under either (kv_dtype; the kernels round
    or quantize K/V when storing and widen them when reading; an int8 row is head_dim values
    and their float32 scale, so cache_shape's last dimension is head_dim + 4)."""
    name = "cpu"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(block_size, num_kv_heads, head_dim, dtype, device, kv_dtype)
        from kvflow.kernels.cpu_ops import KV_I8_EXTRA, paged_attention, store_kv
        self._kernel, self._store = paged_attention, store_kv
        # An int8 cache's rows carry their scale (cpu_ops.c KV_EXTRA); only the kernel reads it.
        self._extra = KV_I8_EXTRA if self.kv_dtype == torch.int8 else 0
        self.sdpa_min_rows = (SDPA_MIN_ROWS if dtype == torch.bfloat16 and not self._extra
                              and "amx_bf16" in cpu_flags() else 0)
        self._torch = TorchBackend(block_size, num_kv_heads, head_dim, dtype, device)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        num_kv_heads, head_dim = self.kv_shape
        return cache_shape(num_blocks, self.block_size, num_kv_heads, head_dim + self._extra)

    def build_metadata(self, slot_mapping: np.ndarray, decodes: list[SeqSpan],
                       prefills: list[SeqSpan]) -> CpuMetadata:
        sdpa = [s for s in prefills if self.sdpa_min_rows
                and s.num_query_tokens >= self.sdpa_min_rows]
        if sdpa:
            prefills = [s for s in prefills if s.num_query_tokens < self.sdpa_min_rows]
        spans = decodes + prefills
        if not prefills and not sdpa:   # decodes alone: one row each, table row = entry
            # numpy, then torch.from_numpy: right after a decode step's weight stream (cold
            # caches) torch.tensor and torch.arange each cost more than this whole branch.
            n = len(decodes)
            rows = np.empty((3, n), dtype=np.int64)   # table row, context, q row
            for i, span in enumerate(decodes):
                rows[0, i], rows[1, i], rows[2, i] = i, span.context_len, span.first_row
            small = rows[:2].astype(np.int32)
            tables = (block_tables(decodes, self.block_size) if n
                      else np.zeros((1, 1), dtype=np.int32))
            return CpuMetadata(self._tensor(slot_mapping), torch.from_numpy(tables),
                               torch.from_numpy(small[0]), torch.from_numpy(small[1]),
                               torch.from_numpy(rows[2]), [])
        first_row = np.fromiter((span.first_row for span in spans), np.int64, len(spans))
        q_lens = np.fromiter((span.num_query_tokens for span in spans), np.int64, len(spans))
        contexts = np.fromiter((span.context_len for span in spans), np.int64, len(spans))
        table_rows = np.repeat(np.arange(len(spans), dtype=np.int32), q_lens)
        # Offset of each row inside its request's new tokens: 0 .. q_len - 1.
        offsets = np.arange(len(table_rows)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        context_lens = contexts[table_rows] - q_lens[table_rows] + 1 + offsets
        tables = (block_tables(spans, self.block_size) if spans
                  else np.zeros((1, 1), dtype=np.int32))
        return CpuMetadata(self._tensor(slot_mapping), torch.from_numpy(tables),
                           torch.from_numpy(table_rows),
                           torch.from_numpy(context_lens.astype(np.int32)),
                           torch.from_numpy(first_row[table_rows] + offsets),
                           self._torch.prefill_metadata(sdpa))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, CpuMetadata), type(meta)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.q_rows.numel():
            self._kernel(q, k_cache, v_cache, meta.block_tables, meta.table_rows,
                         meta.context_lens, meta.q_rows, self.block_size, scale, out)
        for seq in meta.sdpa_prefills:
            prefill_attention(q, k_cache, v_cache, seq, self.block_size, scale, out)
        return out


def cpu_kernels_usable(dtype: torch.dtype) -> str | None:
    """None when the cpu backend can run `dtype` here, else why not."""
    from kvflow.kernels import cpu_ops
    if dtype not in cpu_ops.DTYPES:
        return f"dtype {dtype} (the kernels have float32 and bfloat16)"
    if cpu_ops.library() is None:
        return f"the kernels did not build: {cpu_ops.build_error()}"
    return None
