"""The `torch` backend: plain torch (kvflow/kernels/torch_attention.py), the reference and the
CPU fallback; head-major cache `[num_kv_heads, num_blocks * block_size, head_dim]`."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.kernels.torch_attention import (TorchAttnGroup, TorchPrefill, cache_shape,
                                            group_attention, prefill_attention, store_kv)
from kvflow.workers.attention.base import AttentionBackend, AttentionMetadata, SeqSpan


@dataclass(frozen=True)
class TorchMetadata(AttentionMetadata):
    decodes: TorchAttnGroup | None = None
    prefills: list[TorchPrefill] = field(default_factory=list)


class TorchBackend(AttentionBackend):
    name = "torch"
    _store = staticmethod(store_kv)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return cache_shape(num_blocks, self.block_size, *self.kv_shape)

    def build_metadata(self, slot_mapping: np.ndarray, decodes: list[SeqSpan],
                       prefills: list[SeqSpan]) -> TorchMetadata:
        return TorchMetadata(self._tensor(slot_mapping),
                             self._group(decodes) if decodes else None,
                             self.prefill_metadata(prefills))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, TorchMetadata), type(meta)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.decodes is not None:
            group_attention(q, k_cache, v_cache, meta.decodes, scale, out)
        for seq in meta.prefills:
            prefill_attention(q, k_cache, v_cache, seq, self.block_size, scale, out)
        return out

    def prefill_metadata(self, spans: list[SeqSpan]) -> list[TorchPrefill]:
        """Per request: its blocks, and a mask when a cached prefix shifts the causal diagonal
        (SDPA's is_causal aligns top-left)."""
        seqs = []
        for span in spans:
            q_len, ctx = span.num_query_tokens, span.context_len
            mask = None
            if q_len != ctx:
                mask = self._tensor(np.arange(ctx)[None, :]
                                    <= np.arange(ctx - q_len, ctx)[:, None])
            blocks = span.block_ids[:-(-ctx // self.block_size)]
            seqs.append(TorchPrefill(span.first_row, q_len, ctx,
                                     self._tensor(np.asarray(blocks, dtype=np.int64)), mask))
        return seqs

    def _group(self, members: list[SeqSpan]) -> TorchAttnGroup:
        """Padded gather indices and the causal mask for requests of one group."""
        block_size = self.block_size
        max_q = max(m.num_query_tokens for m in members)
        max_blocks = -(-max(m.context_len for m in members) // block_size)
        max_kv = max_blocks * block_size
        q_index = np.zeros((len(members), max_q), dtype=np.int64)
        block_index = np.zeros((len(members), max_blocks), dtype=np.int64)
        q_valid = np.zeros((len(members), max_q), dtype=bool)
        mask = np.zeros((len(members), max_q, max_kv), dtype=bool)
        kv_pos = np.arange(max_kv)
        for i, m in enumerate(members):
            row, q_len, ctx = m.first_row, m.num_query_tokens, m.context_len
            q_index[i, :q_len] = np.arange(row, row + q_len)
            q_valid[i, :q_len] = True
            num_blocks = -(-ctx // block_size)
            block_index[i, :num_blocks] = m.block_ids[:num_blocks]
            q_pos = np.arange(ctx - q_len, ctx)
            mask[i, :q_len] = kv_pos[None, :] <= q_pos[:, None]
            mask[i, q_len:, 0] = True     # padded query rows see one slot: no NaN rows
        valid = q_valid.ravel()
        bias = np.where(mask, 0.0, -np.inf).astype(np.float32)[:, :, None, :]
        num_kv_heads, head_dim = self.kv_shape
        buf_shape = (num_kv_heads, block_index.size, block_size * head_dim)
        return TorchAttnGroup(
            len(members), max_q, max_kv, self._tensor(q_index.ravel()),
            self._tensor(block_index.ravel()), self._tensor(bias), self._tensor(valid),
            self._tensor(q_index.ravel()[valid]),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device))
