"""Which backend runs: `auto` decided by device, block size, dtype and what imports; an
explicit choice checked."""
from __future__ import annotations

import importlib
import os

import torch

from kvflow.config import FLASH_ATTN_BLOCK_SIZE
from kvflow.workers.attention.base import AttentionBackend
from kvflow.workers.attention.cpu_backend import CpuBackend, cpu_kernels_usable
from kvflow.workers.attention.flash_backend import FlashAttnBackend
from kvflow.workers.attention.paged import TritonBackend
from kvflow.workers.attention.torch_backend import TorchBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend,
    "flash_attn": FlashAttnBackend}


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
                 dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """`kv_dtype`: the cache's, if not `dtype` (bfloat16 under float32, or int8 under either,
    which only the `cpu` backend reads: Worker._kv_dtype decides)."""
    if kv_dtype in (None, dtype):
        return BACKENDS[name](block_size, num_kv_heads, head_dim, dtype, device)
    assert name == "cpu", f"the {name!r} backend reads a cache of its arithmetic's dtype only"
    return CpuBackend(block_size, num_kv_heads, head_dim, dtype, device, kv_dtype)
