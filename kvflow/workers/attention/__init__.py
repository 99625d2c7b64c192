"""Attention backends (see base.py for the interface and the four implementations)."""
from kvflow.workers.attention.base import (AttentionBackend, AttentionMetadata, SeqSpan,
                                           block_tables, to_device)
from kvflow.workers.attention.cpu_backend import CpuBackend, cpu_kernels_usable
from kvflow.workers.attention.flash_backend import FlashAttnBackend
from kvflow.workers.attention.paged import PagedBackend, TritonBackend
from kvflow.workers.attention.selection import (flash_attn_importable, make_backend,
                                                resolve_backend, triton_importable)
from kvflow.workers.attention.torch_backend import TorchBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSpan", "block_tables", "to_device",
           "CpuBackend", "cpu_kernels_usable", "FlashAttnBackend", "PagedBackend",
           "TritonBackend", "TorchBackend", "flash_attn_importable", "make_backend",
           "resolve_backend", "triton_importable"]
