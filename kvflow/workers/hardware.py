"""What the CPU does natively, and the compute dtype that follows from it.

torch runs bfloat16 matmuls at full speed only where the CPU has AVX512-BF16 or AMX (measured
here: ~420 GFLOP/s on a Zen 4 with AVX512-BF16, 47 on a Cascade Lake without, where float32
reaches 172); float16 without AVX512-FP16 falls back to scalar code. So on CPU `dtype="auto"`
is bfloat16 where it is native and float32 elsewhere, whatever the checkpoint says; on CUDA it
is the checkpoint's dtype. An explicit dtype always wins.

Where "auto" gives float32 on CPU, the weights are still bfloat16 (`DtypeChoice.weights`): their
values are rounded to bfloat16 once at load (most checkpoints are bfloat16 already, so nothing
changes for them), every product is float32 arithmetic on those values, and the decode-shaped
products stream a bfloat16 copy, widened in registers (layers/linear.py GemvLinear). A decode
step is a read of the weights, so one user's token costs half the bytes of float32's, while
prompts keep float32's fast GEMM: float32 is right for compute-bound batches and wrong for
one user on such a CPU. `dtype="float32"` keeps the weights exactly as loaded.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from kvflow.config import DTYPES

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int8: "int8"}


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first value of each /proc/cpuinfo field (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


# Run as a CPU with fewer extensions would (benchmarks, e.g. an AVX2-only server on an AVX-512
# machine): the flags kvflow decides by, from this variable (space-separated) instead of
# /proc/cpuinfo. With KVFLOW_KERNEL_ISA (kernels/cpu_ops.py), ONEDNN_MAX_CPU_ISA,
# MKL_ENABLE_INSTRUCTIONS and ATEN_CPU_CAPABILITY the whole engine runs that CPU's code
# (benchmarks/cpu_peers.py --isa).
FLAGS_OVERRIDE = "KVFLOW_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """The CPU's ISA flags (or $KVFLOW_CPU_FLAGS)."""
    return frozenset(os.environ.get(FLAGS_OVERRIDE, _cpuinfo().get("flags", "")).split())


def cpu_model() -> str:
    return _cpuinfo().get("model name", "unknown CPU")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: "AuthenticAMD", "GenuineIntel", ... ("" where none)."""
    return _cpuinfo().get("vendor_id", "")


def native_bf16() -> bool:
    if FLAGS_OVERRIDE in os.environ:
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    reason: str                     # for the log
    slow: bool = False              # an explicit choice this CPU runs as scalar code
    weights: torch.dtype | None = None   # the weights' values and stream, if not `dtype`'s


def resolve_dtype(requested: str, device: torch.device, hf_config: dict) -> DtypeChoice:
    """The compute dtype and why."""
    checkpoint = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    if requested != "auto":
        dtype = getattr(torch, requested)
        if (device.type == "cpu" and dtype == torch.float16
                and "avx512_fp16" not in cpu_flags()):
            return DtypeChoice(dtype, "float16 as asked, but this CPU has no AVX512-FP16: torch "
                               "runs it as scalar code; float32 or bfloat16 would be much "
                               "faster", slow=True)
        return DtypeChoice(dtype, f"{requested} as asked")
    if device.type != "cpu":
        if checkpoint not in DTYPES:
            raise ValueError(f"dtype='auto': the checkpoint's dtype {checkpoint!r} is not one of "
                             f"{DTYPES}; pass dtype explicitly")
        return DtypeChoice(getattr(torch, checkpoint), f"auto: the checkpoint's {checkpoint}")
    if native_bf16():
        return DtypeChoice(torch.bfloat16, "auto: bfloat16, native on this CPU (AVX512-BF16 or "
                                           f"AMX); the checkpoint says {checkpoint}")
    return DtypeChoice(torch.float32, "auto: float32 arithmetic on bfloat16 weights, as this CPU "
                                      "has neither AVX512-BF16 nor AMX (bfloat16 arithmetic "
                                      "would be emulated); the checkpoint says "
                                      f"{checkpoint}", weights=torch.bfloat16)
