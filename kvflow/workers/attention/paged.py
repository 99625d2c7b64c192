"""The paged layout `[num_blocks, block_size, num_kv_heads, head_dim]` (block tables, the
Triton KV store) and its `triton` backend (kvflow's Triton kernels); the `flash_attn` backend
(flash_backend.py) shares the layout."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.workers.attention.base import (AttentionBackend, AttentionMetadata, SeqSpan,
                                           block_tables)


Rows = slice | torch.Tensor     # a request group's packed query rows: a range, or gather indices


@dataclass(frozen=True)
class DecodePart:
    rows: Rows
    block_tables: torch.Tensor     # [batch, max_blocks] int32
    context_lens: torch.Tensor     # [batch] int32, the new token included


@dataclass(frozen=True)
class PrefillPart:
    rows: Rows
    block_tables: torch.Tensor     # [batch, max_blocks] int32
    context_lens: torch.Tensor     # [batch] int32
    cu_seqlens_q: torch.Tensor     # [batch + 1] int32, offsets into the part's rows
    cu_seqlens_k: torch.Tensor     # [batch + 1] int32, cumulative context lengths
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class PagedMetadata(AttentionMetadata):
    num_tokens: int = 0
    decode: DecodePart | None = None
    prefill: PrefillPart | None = None


class PagedBackend(AttentionBackend):
    """Cache `[num_blocks, block_size, num_kv_heads, head_dim]`, block tables, the Triton KV
    store (slot -1 skipped: padded CUDA-graph rows). Subclasses supply the two attentions."""
    supports_cuda_graphs = True

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(block_size, num_kv_heads, head_dim, dtype, device)
        from kvflow.kernels.kv_store import store_kv as triton_store_kv
        self._store = triton_store_kv

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size) + self.kv_shape

    def build_metadata(self, slot_mapping: np.ndarray, decodes: list[SeqSpan],
                       prefills: list[SeqSpan]) -> PagedMetadata:
        return PagedMetadata(self._tensor(slot_mapping), len(slot_mapping),
                             self._decode_part(decodes), self._prefill_part(prefills))

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> PagedMetadata:
        """Metadata of a decode-only batch over given (static, CUDA-graph) device buffers."""
        batch = slot_mapping.shape[0]
        return PagedMetadata(slot_mapping, batch,
                             DecodePart(slice(0, batch), block_tables, context_lens))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata), type(meta)
        decode, prefill = meta.decode, meta.prefill
        if prefill is None and decode is not None and _covers(decode.rows, meta.num_tokens):
            return self.decode(q, k_cache, v_cache, decode, scale)
        if decode is None and prefill is not None and _covers(prefill.rows, meta.num_tokens):
            return self.prefill(q, k_cache, v_cache, prefill, scale)
        out = torch.empty_like(q)                    # [num_tokens, num_heads, head_dim]
        if decode is not None:
            out[decode.rows] = self.decode(q[decode.rows], k_cache, v_cache, decode, scale)
        if prefill is not None:
            out[prefill.rows] = self.prefill(q[prefill.rows], k_cache, v_cache, prefill, scale)
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               part: DecodePart, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                part: PrefillPart, scale: float) -> torch.Tensor:
        raise NotImplementedError

    # --- metadata from the runner's per-request spans --------------------------------------

    def _rows(self, spans: list[SeqSpan]) -> Rows:
        """The spans' packed rows: a slice when they are adjacent and in order (the usual case:
        the scheduler runs decodes first), else gather indices."""
        first = spans[0].first_row
        starts = np.asarray([span.first_row for span in spans])
        q_lens = np.asarray([span.num_query_tokens for span in spans])
        offsets = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        if np.array_equal(starts - first, offsets):
            return slice(first, first + int(q_lens.sum()))
        return self._tensor(np.concatenate([np.arange(r, r + n) for r, n in zip(starts, q_lens)]))

    def _decode_part(self, spans: list[SeqSpan]) -> DecodePart | None:
        if not spans:
            return None
        context_lens = np.asarray([span.context_len for span in spans], dtype=np.int32)
        return DecodePart(self._rows(spans), self._tensor(block_tables(spans, self.block_size)),
                          self._tensor(context_lens))

    def _prefill_part(self, spans: list[SeqSpan]) -> PrefillPart | None:
        if not spans:
            return None
        q_lens = np.asarray([span.num_query_tokens for span in spans], dtype=np.int32)
        context_lens = np.asarray([span.context_len for span in spans], dtype=np.int32)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(context_lens)]).astype(np.int32)
        return PrefillPart(self._rows(spans), self._tensor(block_tables(spans, self.block_size)),
                           self._tensor(context_lens), self._tensor(cu_q), self._tensor(cu_k),
                           int(q_lens.max()), int(context_lens.max()))


def _covers(rows: Rows, num_tokens: int) -> bool:
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == num_tokens


class TritonBackend(PagedBackend):
    name = "triton"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(block_size, num_kv_heads, head_dim, dtype, device)
        from kvflow.kernels.decode_attention import paged_decode_attention
        from kvflow.kernels.prefill_attention import paged_prefill_attention
        self._decode, self._prefill = paged_decode_attention, paged_prefill_attention

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               part: DecodePart, scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, part.block_tables, part.context_lens, scale)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                part: PrefillPart, scale: float) -> torch.Tensor:
        return self._prefill(q, k_cache, v_cache, part.cu_seqlens_q, part.context_lens,
                             part.block_tables, scale, part.max_seqlen_q)
