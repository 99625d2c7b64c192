"""The `flash_attn` backend: flash-attn's paged API (`flash_attn_with_kvcache` for decodes,
`flash_attn_varlen_func` with a block table for prefills) on the paged layout (paged.py), whose
KV store is kvflow's Triton kernel. CUDA only, block_size a multiple of 256, float16 or
bfloat16."""
from __future__ import annotations

import importlib

import torch

from kvflow.config import FLASH_ATTN_BLOCK_SIZE
from kvflow.workers.attention.paged import DecodePart, PagedBackend, PrefillPart


class FlashAttnBackend(PagedBackend):
    name = "flash_attn"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(block_size, num_kv_heads, head_dim, dtype, device)
        assert block_size % FLASH_ATTN_BLOCK_SIZE == 0, block_size
        flash_attn = importlib.import_module("flash_attn")
        self._with_kvcache = flash_attn.flash_attn_with_kvcache
        self._varlen = flash_attn.flash_attn_varlen_func

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               part: DecodePart, scale: float) -> torch.Tensor:
        # q as [batch, seqlen_q=1, num_heads, head_dim]; the cache already holds the new K/V.
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                 cache_seqlens=part.context_lens, block_table=part.block_tables,
                                 softmax_scale=scale, causal=True)
        return out.squeeze(1)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                part: PrefillPart, scale: float) -> torch.Tensor:
        # Causal masks align bottom-right: new token i of a request sees context - q_len + i.
        return self._varlen(q, k_cache, v_cache, part.cu_seqlens_q, part.cu_seqlens_k,
                            part.max_seqlen_q, part.max_seqlen_k, softmax_scale=scale,
                            causal=True, block_table=part.block_tables)
