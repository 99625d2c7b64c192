"""Shared launcher helpers for kvflow's Triton kernels: argument checks and block-size math.

Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
how the test suite runs without a GPU). The checks raise ValueError with the offending value so
a bad call fails at the Python boundary, not as a silent out-of-bounds read inside a kernel.
"""

import os

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its Python interpreter instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device that Triton can run on."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} vs {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not in {dtypes}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Rows may be strided (views into a fused qkv buffer), but each row's last dim is packed."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, got strides {t.stride()}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the paged cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def block_dim(n: int, minimum: int = 1) -> int:
    """Power-of-two tile width covering n (tl.arange needs powers of two; tl.dot needs >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for operands upcast to float32 from `dtype`.

    The attention kernels upcast K/V/Q to float32 before tl.dot (Triton's interpreter cannot do
    bf16 arithmetic, and one code path is easier to trust). fp16/bf16 values are exactly
    representable in tf32, so "tf32" loses nothing for them and keeps tensor cores; genuine
    float32 inputs get "ieee" so the fp32 path stays an exact reference.
    """
    return "ieee" if dtype == torch.float32 else "tf32"
