"""The implementations a model is built with, chosen once by the worker before the build.

The small elementwise ops (RMSNorm, alone or fused with the residual add before it,
SiLU-and-mul, rotary), the sampler's argmax and draw, and the way
linear layers hold their weights come in three sets; every layer receives the chosen set in its
constructor and keeps it, so the model that runs is the one `models/llama.py` builds:

- `torch`: plain torch ops, the reference (also the GPU path under enforce_eager).
- `compiled` (CUDA): each elementwise function through `torch.compile(dynamic=True)`, one
  compiled copy shared by every layer and batch size; it fuses the five to ten tiny kernels
  of each op into one or two, which is GPU time per step under CUDA graphs.
- `c` (CPU, with the `cpu` attention backend): kvflow's C kernels (kvflow/kernels/cpu_ops.c):
  one call each instead of five to ten small torch ops, most of these ops' cost on CPU.

On CPU, when this torch's oneDNN can, linear weights are packed once after loading into
oneDNN's blocked layout (`layers/linear.py`), whatever the elementwise set; with
quantization="int8" they are int8 instead (`Int8Linear`, W8A8).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvflow.workers.layers.activation import silu_and_mul
from kvflow.workers.hardware import cpu_flags
from kvflow.workers.layers import linear as linear_layers
from kvflow.workers.layers.linear import (GemvLinear, Int8Linear, LinearMethod, OneDnnLinear,
                                         int8_gemv_rows)
from kvflow.workers.layers.norm import add_rms_norm, rms_norm
from kvflow.workers.layers.rotary import apply_rotary
from kvflow.workers.logits_processors import Penalize
from kvflow.workers.sampler import Draw, TopLogprobs, torch_argmax

Tensor = torch.Tensor


@dataclass(frozen=True)
class Ops:
    name: str                                               # torch | compiled | c
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    apply_rotary: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    argmax: Callable[[Tensor], Tensor] = torch_argmax       # row argmax, first index of the max
    linear: LinearMethod = LinearMethod()                   # how linear layers hold weights
    sample: Draw | None = None         # the sampler's masks and draw in one call (Sampler._draw)
    penalize: Penalize | None = None   # the sampler's penalties in one call
    top_logprobs: TopLogprobs | None = None     # the sampler's logprobs in one call


TORCH_OPS = Ops("torch", rms_norm, add_rms_norm, silu_and_mul, apply_rotary)
# With the C ops, products of at most GEMV_MAX_ROWS rows run on kvflow's gemv kernel
# (kernels/cpu_gemv.c), which streams the weight at the memory's read speed there on every
# x86 it was measured on; larger ones on oneDNN (AMX or VNNI make it faster from two rows on
# where the CPU has them). Steps of at most FUSED_MAX_TOKENS tokens (decodes, drafts'
# verifications) run every layer in one C call (workers/fused_decode.py): the per-op
# overhead it removes outweighs a slower gemv up to there (benchmarks/cpu_kernels.py). Where
# every linear runs more rows on the gemv kernel (LinearMethod.gemv_rows), the fused path
# takes steps of that many tokens, up to FUSED_MAX_TOKENS_WIDE:
# - bfloat16 in AMX tiles (CPUs with AMX, `GemvLinear`): the kernel streams the tiles up to
#   32 rows (a 32-request decode step: 559.6 tok/s against 478.8 with the limit at 8,
#   in-process, the cpu_peers workload; one row reads their 12-bit pair-panel copy instead,
#   one_row_pairs12);
# - bfloat16 weights under float32 arithmetic (dtype="auto" without AVX512-BF16/AMX): the
#   kernel reads half the bytes of oneDNN's float32 copy: a decode step's linears (the
#   default model, 2 threads, AVX-512 and AVX2 builds) took 12-14 / 24-32 / 36-50 / 45-62 ms
#   at 4 / 16 / 24 / 32 rows against oneDNN's 23-37 / 34-47 / 41-57 / 47-64
#   (GEMV_MAX_ROWS_WIDENED; at 32 rows a tie, 3 runs); with the bfloat16 copy in the
#   kernel's panels (cpu_ops.pack_panels, where the shapes allow), up to
#   GEMV_MAX_ROWS_PANELS beside oneDNN's copy, every row count without it (keep_copy);
# - bfloat16 arithmetic without AMX (AVX512-BF16): the weights in pair panels
#   (cpu_ops.pack_pairs), faster than oneDNN's bfloat16 GEMM up to GEMV_MAX_ROWS_PANELS
#   rows (AMD EPYC Zen 5; the 32-request workload's decode steps of 9-32 rows then run
#   fused), every row count without oneDNN's copy, likewise;
# - int8 with AVX512-VNNI but no AMX: past 8 rows (layers/linear.py int8_gemv_rows) every
#   fused linear runs kvflow's W8A8 GEMM (kernels/cpu_gemm_i8.c), as the model's forward does;
# - int8 without VNNI: past GEMV_MAX_ROWS every fused linear runs kvflow's W7A8 GEMM
#   (kernels/cpu_gemm_i8.c), as the model's forward does (workers/fused_decode.py gemv_rows);
#   with oneDNN's GEMM only, up to 48 rows on the gemv kernel (layers/linear.py
#   int8_gemv_rows).
GEMV_MAX_ROWS = 4
GEMV_MAX_ROWS_WIDENED = 32
GEMV_MAX_ROWS_PANELS = 64
FUSED_MAX_TOKENS = 8
FUSED_MAX_TOKENS_WIDE = 32
# Products of one to a few rows (cpu_ops.panels12_rows, pairs12_rows; beside AMX tiles one)
# from a second copy of the bfloat16 panels in 12 bits a weight
# (cpu_ops.pack_panels12, lossless, 0.76x the bytes), wherever there are bfloat16 panels
# (float32 arithmetic on bfloat16 weights: CPUs without AVX512-BF16 or AMX), and of the pair
# panels or AMX tiles' weights where the CPU has AVX512-BF16 (one_row_pairs12); made unless
# cpu_one_row_copy says not (keep_copy). Their history and measurements: docs/design.md
# (the bfloat16 weights under float32 arithmetic; "Pair panels"; AMX).


def one_row_pairs12(flags: frozenset[str]) -> bool:
    """Whether products of one to a few rows (cpu_ops.pairs12_rows) read the 12-bit copy of
    the pair panels: wherever there are pair panels (AVX512-BF16); and, where AMX takes
    bfloat16 (no pair panels then), whether one-row products read a 12-bit pair-panel copy
    beside the tiles. On an AMD EPYC Zen 5 one request's TPOT in-process 6.6 -> 5.9-6.1 ms,
    through the server 5.55-6.6 -> 4.9-5.4; the 32-request workload, which reads the pair
    panels, alike within the VM's drift (docs/design.md, "Pair panels"). The copy adds 0.76x
    the pair panels' (or tiles') memory."""
    return "avx512_bf16" in flags


# Share of the RAM available at load that a copy the engine can do without may take under
# "auto": oneDNN's copy of the paneled weights (cpu_prefill_copy), the 12-bit copy for the
# decode steps of one to a few requests (cpu_one_row_copy).
COPY_SHARE = 1 / 8


def keep_copy(option: str, copy_bytes: int, available_bytes: int) -> bool:
    """Whether to keep a copy of the weights that only speeds a path up: `option` "on" or
    "off", or "auto": while the copy's `copy_bytes` are at most COPY_SHARE of
    `available_bytes`.
    - oneDNN's copy of the weights the gemv kernel holds in panels or pair panels
      (cpu_prefill_copy, GemvLinear.gemm_copy), for products of more than
      GEMV_MAX_ROWS_PANELS rows (prompts): 4 bytes a parameter under float32 arithmetic (the
      panels hold 2, their 12-bit copy 1.5), 2 under bfloat16; a few percent off a prompt's
      prefill (docs/design.md, "oneDNN's copy for prompts"; benchmarks/prefill_copy.py): so
      the default model (0.5 GB of float32 copy) keeps it, and a 7B model (28 GB) fits in
      half the memory without it.
    - the 12-bit copy the decode steps of one to a few requests read (cpu_one_row_copy,
      GemvLinear.one_row_copy): ~1.5 bytes a parameter; a tenth to a fifth off one request's
      TPOT (docs/design.md: the 12-bit panels, pair panels, beside AMX tiles).
    Each copy is weighed alone against the same share: both together may take a quarter."""
    if option != "auto":
        return option == "on"
    return copy_bytes <= available_bytes * COPY_SHARE


def pair_panels() -> bool:
    """Whether bfloat16 weights of the gemv kernel are held in pair panels here: the kernels'
    build has AVX512-BF16 and the CPU no AMX (whose tiles take bfloat16 instead)."""
    from kvflow.kernels import cpu_ops
    return cpu_ops.pairs_available() and cpu_ops.gemv_amx_rows() == 0


def compiled_ops() -> Ops:
    compile_ = lambda fn: torch.compile(fn, dynamic=True)  # noqa: E731
    return Ops("compiled", compile_(rms_norm), compile_(add_rms_norm), compile_(silu_and_mul),
               compile_(apply_rotary))


def choose_ops(device: torch.device, attention_backend: str, dtype: torch.dtype,
               enforce_eager: bool, quantization: str | None = None,
               weight_dtype: torch.dtype | None = None) -> Ops:
    """compiled on CUDA unless enforce_eager; C kernels on CPU with the `cpu` attention
    backend (its library is the one that built); else plain torch. On CPU the linear
    weights are packed for oneDNN where this torch can, or quantized with "int8"; the gemv
    kernel streams them in `weight_dtype` where it is not `dtype` (bfloat16 weights under
    float32 arithmetic: hardware.DtypeChoice.weights)."""
    if device.type == "cuda":
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} runs on CPU only, but the "
                             f"device is {device}")
        return TORCH_OPS if enforce_eager else compiled_ops()
    c_kernels = attention_backend == "cpu"
    if c_kernels:
        from kvflow.kernels import cpu_ops
    if quantization == "int8":
        why = Int8Linear.works()
        if why is not None:
            raise ValueError(f"quantization='int8' cannot run: {why}")
        linear: LinearMethod = Int8Linear()          # plain torch ops: oneDNN's GEMM only
        if c_kernels:
            flags = cpu_flags()
            # kvflow's int8 GEMM where the CPU has no AMX-INT8 (oneDNN's tiles are faster)
            # and the build's kernel takes this CPU's weights (8 bits need AVX512-VNNI)
            levels = 0 if "amx_int8" in flags else cpu_ops.i8_gemm_weight_levels()
            own = (cpu_ops.i8_gemm_available()       # (through the module: benchmarks patch it)
                   and linear_layers.gemm_weight_levels(flags) <= levels)
            linear = Int8Linear(cpu_ops.quantize_rows, cpu_ops.scale_rows, cpu_ops.gemv,
                                int8_gemv_rows(flags, GEMV_MAX_ROWS, own),
                                pack_panels=cpu_ops.pack_i8_panels, gemm=cpu_ops.i8_gemm,
                                gemm_pack=cpu_ops.i8_gemm_pack, gemm_levels=levels)
    else:
        linear = OneDnnLinear() if OneDnnLinear.works(dtype) else LinearMethod()
        if c_kernels:
            amx_rows = cpu_ops.gemv_amx_rows() if dtype == torch.bfloat16 else 0
            stream = weight_dtype if weight_dtype not in (None, dtype) else None
            linear = GemvLinear(cpu_ops.gemv, linear,
                                GEMV_MAX_ROWS if stream is None else GEMV_MAX_ROWS_WIDENED,
                                cpu_ops.pack_amx, amx_rows, stream, cpu_ops.pack_panels,
                                cpu_ops.pack_panels12,
                                cpu_ops.pack_pairs if dtype == torch.bfloat16 and pair_panels()
                                else None,
                                cpu_ops.pack_pairs12 if one_row_pairs12(cpu_flags()) else None,
                                cpu_ops.pairs12_rows(), copy_rows=GEMV_MAX_ROWS_PANELS,
                                panels12_rows=cpu_ops.panels12_rows())
    if c_kernels:
        return Ops("c", cpu_ops.rms_norm, cpu_ops.add_rms_norm, cpu_ops.silu_and_mul,
                   cpu_ops.apply_rotary, cpu_ops.argmax, linear, cpu_ops.sample,
                   cpu_ops.penalize, cpu_ops.logprobs)
    return Ops("torch", rms_norm, add_rms_norm, silu_and_mul, apply_rotary, linear=linear)
