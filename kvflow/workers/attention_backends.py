"""Attention backends: one interface, four implementations (DESIGN.md §3).

A backend owns
- its KV cache layout (`cache_shape`, per layer, for K and for V alike),
- its per-step metadata, built from the per-request view the model runner computes for every
  backend (`SeqSpan`: first packed row, q_len, context_len, block ids), split into decodes
  (q_len 1) and prefills (the rest),
- storing the step's K/V (`store_kv`) and attending (`attend`).

- `torch`: plain torch, the reference and the CPU fallback (kvflow/kernels/torch_attention.py);
  head-major cache `[num_kv_heads, num_blocks * block_size, head_dim]`.
- `cpu`: the torch layout, with kvflow's C kernels (kvflow/kernels/cpu_ops.c) for the KV store
  and for the attention of every query row, decodes and prefills alike. CPU, float32/bfloat16.
- `triton`: kvflow's Triton kernels (kvflow/kernels: store_kv, paged decode with split-K, paged
  varlen prefill); cache `[num_blocks, block_size, num_kv_heads, head_dim]`. CUDA, or CPU under
  `TRITON_INTERPRET=1` (slow, for tests).
- `flash_attn`: flash-attn's paged API (`flash_attn_with_kvcache` for decodes,
  `flash_attn_varlen_func` with a block table for prefills) on the triton layout; the KV store
  is kvflow's Triton kernel. CUDA only, block_size a multiple of 256, float16 or bfloat16.

`auto` (resolved by the worker, see `resolve_backend`): flash_attn when it imports on CUDA and the
block size and dtype fit, else triton on CUDA; on CPU cpu when the C kernels build and the dtype
is float32/bfloat16, else torch.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvflow.config import FLASH_ATTN_BLOCK_SIZE
from kvflow.kernels.torch_attention import (TorchAttnGroup, TorchPrefill, cache_shape,
                                            group_attention, prefill_attention, store_kv)
from kvflow.workers.layers.attention import AttentionMetadata

# (first packed row, q_len, context_len, block_ids) of one scheduled request
SeqSpan = tuple[int, int, int, np.ndarray]


def block_tables(spans: list[SeqSpan], block_size: int) -> np.ndarray:
    """[batch, max_blocks] int32; past a request's last block: 0 (any valid block id)."""
    num_blocks = [-(-ctx // block_size) for _, _, ctx, _ in spans]
    table = np.zeros((len(spans), max(num_blocks)), dtype=np.int32)
    for i, (n, (_, _, _, blocks)) in enumerate(zip(num_blocks, spans)):
        table[i, :n] = blocks[:n]
    return table


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`; on CUDA through pinned memory, without waiting
    (the caching host allocator keeps the pinned block alive until the copy is done)."""
    tensor = torch.from_numpy(array)
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
                 device: torch.device) -> None:
        self.block_size = block_size
        self.kv_shape = (num_kv_heads, head_dim)     # per rank
        self.dtype = dtype
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


# --- torch ---------------------------------------------------------------------------------

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
                             self._prefills(prefills))

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

    def _prefills(self, spans: list[SeqSpan]) -> list[TorchPrefill]:
        """Per request: its blocks, and a mask when a cached prefix shifts the causal diagonal
        (SDPA's is_causal aligns top-left)."""
        seqs = []
        for row, q_len, ctx, blocks in spans:
            mask = None
            if q_len != ctx:
                mask = self._tensor(np.arange(ctx)[None, :]
                                    <= np.arange(ctx - q_len, ctx)[:, None])
            seqs.append(TorchPrefill(row, q_len, ctx,
                                     self._tensor(np.asarray(blocks[:-(-ctx // self.block_size)],
                                                             dtype=np.int64)), mask))
        return seqs

    # Moved verbatim from ModelRunner._group.
    def _group(self, members: list[tuple[int, int, int, np.ndarray]]) -> TorchAttnGroup:
        """Padded gather indices and the causal mask for requests of one group."""
        bs = self.block_size
        max_q = max(m[1] for m in members)
        max_blocks = -(-max(m[2] for m in members) // bs)
        max_kv = max_blocks * bs
        q_index = np.zeros((len(members), max_q), dtype=np.int64)
        block_index = np.zeros((len(members), max_blocks), dtype=np.int64)
        q_valid = np.zeros((len(members), max_q), dtype=bool)
        mask = np.zeros((len(members), max_q, max_kv), dtype=bool)
        kv_pos = np.arange(max_kv)
        for i, (row, q_len, ctx, blocks) in enumerate(members):
            q_index[i, :q_len] = np.arange(row, row + q_len)
            q_valid[i, :q_len] = True
            num_blocks = -(-ctx // bs)
            block_index[i, :num_blocks] = blocks[:num_blocks]
            q_pos = np.arange(ctx - q_len, ctx)
            mask[i, :q_len] = kv_pos[None, :] <= q_pos[:, None]
            mask[i, q_len:, 0] = True     # padded query rows see one slot: no NaN rows
        valid = q_valid.ravel()
        bias = np.where(mask, 0.0, -np.inf).astype(np.float32)[:, :, None, :]
        num_kv_heads, head_dim = self.kv_shape
        buf_shape = (num_kv_heads, block_index.size, bs * head_dim)
        return TorchAttnGroup(
            len(members), max_q, max_kv, self._tensor(q_index.ravel()),
            self._tensor(block_index.ravel()), self._tensor(bias), self._tensor(valid),
            self._tensor(q_index.ravel()[valid]),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device))


# --- cpu: the torch layout, every query row by a compiled C kernel -------------------------

@dataclass(frozen=True)
class CpuMetadata(AttentionMetadata):
    block_tables: torch.Tensor      # [num_requests, max_blocks] int32
    table_rows: torch.Tensor        # [num_rows] int32: each query row's request
    context_lens: torch.Tensor      # [num_rows] int32: the keys each row sees, its own included
    q_rows: torch.Tensor            # [num_rows] int64: each row's packed row


class CpuBackend(AttentionBackend):
    """The torch backend's cache layout; kvflow/kernels/cpu_ops.c does the rest: it stores the
    new K/V rows (a memcpy a row instead of index_copy_), and attends for every query row,
    decode or prefill, in one call per layer, reading the paged cache in place (no block
    gathers, no bmm or SDPA calls). A prefill of n tokens after c cached ones is n rows with
    contexts c+1 .. c+n: causal attention, cached prefix included. float32 and bfloat16."""
    name = "cpu"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(block_size, num_kv_heads, head_dim, dtype, device)
        from kvflow.kernels.cpu_ops import paged_attention, store_kv
        self._kernel, self._store = paged_attention, store_kv

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return cache_shape(num_blocks, self.block_size, *self.kv_shape)

    def build_metadata(self, slot_mapping: np.ndarray, decodes: list[SeqSpan],
                       prefills: list[SeqSpan]) -> CpuMetadata:
        spans = decodes + prefills
        first_row, q_lens, contexts = (np.fromiter((span[i] for span in spans), np.int64,
                                                   len(spans)) for i in range(3))
        table_rows = np.repeat(np.arange(len(spans), dtype=np.int32), q_lens)
        # Offset of each row inside its request's new tokens: 0 .. q_len - 1.
        offsets = np.arange(len(table_rows)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        context_lens = contexts[table_rows] - q_lens[table_rows] + 1 + offsets
        return CpuMetadata(self._tensor(slot_mapping),
                           torch.from_numpy(block_tables(spans, self.block_size)),
                           torch.from_numpy(table_rows),
                           torch.from_numpy(context_lens.astype(np.int32)),
                           torch.from_numpy(first_row[table_rows] + offsets))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, CpuMetadata), type(meta)
        q = q.contiguous()
        out = torch.empty_like(q)
        self._kernel(q, k_cache, v_cache, meta.block_tables, meta.table_rows,
                     meta.context_lens, meta.q_rows, self.block_size, scale, out)
        return out


def cpu_kernels_usable(dtype: torch.dtype) -> str | None:
    """None when the cpu backend can run `dtype` here, else why not."""
    from kvflow.kernels import cpu_ops
    if dtype not in cpu_ops.DTYPES:
        return f"dtype {dtype} (the kernels have float32 and bfloat16)"
    if cpu_ops.library() is None:
        return f"the kernels did not build: {cpu_ops.build_error()}"
    return None


# --- paged layout: triton and flash_attn ---------------------------------------------------

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
        first = spans[0][0]
        starts = np.asarray([row for row, _, _, _ in spans])
        q_lens = np.asarray([q_len for _, q_len, _, _ in spans])
        offsets = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        if np.array_equal(starts - first, offsets):
            return slice(first, first + int(q_lens.sum()))
        return self._tensor(np.concatenate([np.arange(r, r + n) for r, n in zip(starts, q_lens)]))

    def _decode_part(self, spans: list[SeqSpan]) -> DecodePart | None:
        if not spans:
            return None
        context_lens = np.asarray([ctx for _, _, ctx, _ in spans], dtype=np.int32)
        return DecodePart(self._rows(spans), self._tensor(block_tables(spans, self.block_size)),
                          self._tensor(context_lens))

    def _prefill_part(self, spans: list[SeqSpan]) -> PrefillPart | None:
        if not spans:
            return None
        q_lens = np.asarray([q_len for _, q_len, _, _ in spans], dtype=np.int32)
        context_lens = np.asarray([ctx for _, _, ctx, _ in spans], dtype=np.int32)
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


BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend,
    "flash_attn": FlashAttnBackend}


# --- choosing one --------------------------------------------------------------------------

def flash_attn_importable() -> bool:
    try:
        flash_attn = importlib.import_module("flash_attn")
    except (ImportError, OSError):                   # absent, or built for another torch/CUDA
        return False
    return hasattr(flash_attn, "flash_attn_with_kvcache")


def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except (ImportError, OSError):
        return False
    return True


def resolve_backend(requested: str, device: torch.device, block_size: int,
                    dtype: torch.dtype) -> str:
    """The backend to run: `auto` decided, an explicit choice checked (ValueError if unusable)."""
    on_cuda = device.type == "cuda"
    fits_flash = (block_size % FLASH_ATTN_BLOCK_SIZE == 0
                  and dtype in (torch.float16, torch.bfloat16))
    if requested == "auto":
        if on_cuda and fits_flash and flash_attn_importable():
            return "flash_attn"
        if on_cuda:
            return "triton" if triton_importable() else "torch"
        return "cpu" if cpu_kernels_usable(dtype) is None else "torch"
    if requested == "cpu":
        if on_cuda:
            raise ValueError(f"attention_backend='cpu' runs on CPU, but the device is {device}")
        why = cpu_kernels_usable(dtype)
        if why is not None:
            raise ValueError(f"attention_backend='cpu' cannot run: {why}; use 'torch'")
    if requested == "flash_attn" and not (on_cuda and fits_flash and flash_attn_importable()):
        raise ValueError(f"attention_backend='flash_attn' needs CUDA (device is {device}), "
                         f"block_size % {FLASH_ATTN_BLOCK_SIZE} == 0 (block_size={block_size}), "
                         f"dtype float16 or bfloat16 (dtype is {dtype}) and an importable "
                         f"flash_attn package")
    if requested == "triton" and not on_cuda and not _triton_interpreting():
        raise ValueError(f"attention_backend='triton' on {device} needs TRITON_INTERPRET=1 "
                         f"(Triton's interpreter: slow, for tests); use CUDA or 'torch'")
    if requested == "triton" and not triton_importable():
        raise ValueError("attention_backend='triton' needs the triton package")
    return requested


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def make_backend(name: str, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    return BACKENDS[name](block_size, num_kv_heads, head_dim, dtype, device)
