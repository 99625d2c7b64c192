"""CPU kernels in C (cpu_ops.c), loaded with ctypes: paged attention (decodes and prefills),
the KV store, RMSNorm (alone or after the residual add), SiLU-and-mul, rotary, the sampler's row argmax and the int8 linears'
per-token quantization and output scaling; the decode-shaped linears (cpu_gemv.c), a decode
step's layers in one call (cpu_decode.c) and the int8 GEMM of CPUs without AMX-INT8
(cpu_gemm_i8.c, `i8_gemm`). Each has a torch reference it is tested against
(the torch attention backend and store; layers/norm.py, layers/activation.py,
layers/rotary.py; torch.argmax; layers/linear.py's quantize_rows_ref and scale_rows_ref).

Why C: on CPU a decode step of a small model is hundreds of small torch calls; the attention
alone was block gathers plus six tiny bmm calls per layer, and a prefill's SDPA call per
request ran at half the speed of the paged kernel. These kernels do each job in one
pass over memory, at one call per layer.

The library is compiled once per machine with the system C compiler (`$CC`, else `cc`) into
`<KVFLOW_CACHE>/kernels/`, named by a hash of its source, the flags, the compiler and the CPU, so
a changed source or another CPU gets its own build. No compiler, or a failed build: `library()`
returns None with the reason in `build_error()`, and everything stays on pure torch.

Threads: the library is linked with -fopenmp and loaded after torch, so its `libgomp.so.1` is
the one torch already loaded, and it runs on torch's OpenMP pool (`torch.set_num_threads`).
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.config import cache_dir

logger = logging.getLogger("kvflow.kernels")

# One library from these sources: cpu_ops.c (attention, elementwise ops, argmax,
# quantization), cpu_gemv.c (decode-shaped linears), cpu_decode.c (a decode step's layers
# in one call, workers/fused_decode.py) and cpu_gemm_i8.c (the int8 GEMM of CPUs without
# VNNI).
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_ops.c", "cpu_gemv.c",
                                                         "cpu_decode.c", "cpu_gemm_i8.c")]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked apart, without -ffast-math: with it, GCC links crtfastmath.o into the library, whose
# constructor turns on flush-to-zero and denormals-are-zero in the thread that loads it. That
# changed torch's float math in that thread and not in the OpenMP threads started before, so
# results depended on which thread ran a task (2 threads: a 6e-3 logprob jitter between runs).
LINK_FLAGS = ["-shared", "-fopenmp"]
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

_lock = threading.Lock()
_state: dict[str, object] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None when it cannot be built.
    $KVFLOW_KERNEL_ISA (an ISA_FLAGS key) builds it for less than this CPU has."""
    with _lock:
        if "lib" not in _state:
            try:
                isa = os.environ.get("KVFLOW_KERNEL_ISA", "native")
                if isa not in ISA_FLAGS:
                    raise RuntimeError(f"KVFLOW_KERNEL_ISA={isa!r} is not one of "
                                       f"{list(ISA_FLAGS)}")
                _state["lib"] = _load(_build(ISA_FLAGS[isa]))
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _state["lib"], _state["error"] = None, f"{type(exc).__name__}: {exc}"
                logger.warning("CPU kernels unavailable (%s); using pure torch",
                               _state["error"])
        lib = _state["lib"]
        return lib if isinstance(lib, ctypes.CDLL) else None


def build_error() -> str | None:
    """Why `library()` returned None (None when it has not failed)."""
    error = _state.get("error")
    return error if isinstance(error, str) else None


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


# Builds for less than this CPU has, so that every machine can test (and time) the code that
# CPUs without AVX512-BF16, or without AVX-512 at all, run: -march=native minus those (and
# minus AMX, which no such CPU has; the AVX2 build also minus AVX-VNNI, which AVX2-only
# servers such as AMD's before Zen 4 lack). The AVX-512 build is a Cascade Lake Xeon's:
# AVX-512 F, CD, BW, DQ, VL and VNNI, without the later AVX-512 extensions, GFNI, VAES or
# VPCLMULQDQ (GCC may use them in code it vectorizes itself; AVX512-FP16 is left to
# -march=native, as the GCC 11 these builds need does not know it).
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
ISA_FLAGS = {"native": (),
             "avx512": ("-mno-avx512bf16", "-mno-avx512vbmi", "-mno-avx512vbmi2",
                        "-mno-avx512ifma", "-mno-avx512bitalg", "-mno-avx512vpopcntdq",
                        "-mno-avx512vp2intersect", "-mno-gfni", "-mno-vaes", "-mno-vpclmulqdq",
                        "-mno-avxvnni", *_NO_AMX),
             "avx2": ("-mno-avx512f", "-mno-avxvnni", *_NO_AMX)}


def load_isa(isa: str) -> ctypes.CDLL:
    """The library built for this CPU less what `isa` leaves out (ISA_FLAGS); for tests and
    benchmarks (set it as `_state["lib"]`)."""
    return _load(_build(ISA_FLAGS[isa]))


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile (or find the cached build of) the library; extra_flags: e.g. ISA_FLAGS'."""
    flags = FLAGS + list(extra_flags)
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} not on PATH (set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    sources = [path.read_bytes() for path in SOURCES]
    key = hashlib.blake2b(b"\0".join([*sources, " ".join(flags + LINK_FLAGS).encode(),
                                      version.encode(),
                                      _cpu_id().encode()]), digest_size=8).hexdigest()
    cache = Path(cache_dir())
    target = cache / "kernels" / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        commands = [[compiler, *flags, "-c", str(source), "-o", obj]
                    for source, obj in zip(SOURCES, objects)]
        commands.append([compiler, *LINK_FLAGS, "-o", str(built), *objects, "-lm"])
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)            # atomic: concurrent builders race harmlessly
    logger.info("built the CPU kernels: %s", target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_attention": (ctypes.c_int, [ptr] * 4 + [i64] + [ptr] * 3 + [i64] * 8
                            + [f32, ptr]),
        "rms_norm": (None, [ptr, i64, ptr, i64, i64, f32, ptr]),
        "add_rms_norm": (None, [ptr, i64, ptr, ptr, i64, i64, f32, ptr]),
        "silu_and_mul": (None, [ptr, i64, i64, i64, ptr]),
        "rotary": (None, [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr]),
        "argmax": (None, [ptr, i64, i64, i64, ptr]),
        "quantize_rows": (None, [ptr, i64, i64, i64, ptr, ptr]),
        "scale_rows": (None, [ptr, i64, i64, ptr, ptr, ptr]),
    }
    for op, (restype, argtypes) in signatures.items():
        for suffix in DTYPES.values():
            fn = getattr(lib, f"{op}_{suffix}")
            fn.restype, fn.argtypes = restype, argtypes
    # float32 queries and a bfloat16 cache; either dtype's queries and an int8 cache
    for name in ("paged_attention_f32_kv_bf16", "paged_attention_kv_i8_f32",
                 "paged_attention_kv_i8_bf16"):
        mixed = getattr(lib, name)
        mixed.restype, mixed.argtypes = signatures["paged_attention"]
    store_argtypes: list[Any] = [ptr, i64, i64, ptr, i64, i64, i64, i64, ptr]
    for name in ("store_kv", "store_kv_f32_to_bf16", "store_kv_i8_f32", "store_kv_i8_bf16"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, store_argtypes
    i32 = ctypes.c_int
    gemv_argtypes: list[Any] = [ptr, i32, i64, i64, ptr, i32, ptr, ptr, ptr, i64, i64, ptr, i32,
                                i64]
    lib.gemv.restype, lib.gemv.argtypes = ctypes.c_int, gemv_argtypes
    lib.gemv_amx_rows.restype, lib.gemv_amx_rows.argtypes = ctypes.c_int, []
    lib.gemv_panel_width.restype, lib.gemv_panel_width.argtypes = ctypes.c_int, []
    lib.pack_panels.restype, lib.pack_panels.argtypes = None, [ptr, i64, i64, ptr]
    lib.pack_i8_panels.restype, lib.pack_i8_panels.argtypes = ctypes.c_int, [ptr, i64, i64, ptr]
    lib.pack_pairs.restype, lib.pack_pairs.argtypes = ctypes.c_int, [ptr, i64, i64, ptr]
    lib.gemv_pairs_available.restype, lib.gemv_pairs_available.argtypes = ctypes.c_int, []
    lib.gemv_pairs12_rows.restype, lib.gemv_pairs12_rows.argtypes = ctypes.c_int, []
    lib.gemv_panels12_rows.restype, lib.gemv_panels12_rows.argtypes = ctypes.c_int, []
    lib.panels12_bytes.restype, lib.panels12_bytes.argtypes = i64, [ptr, i64, i64]
    lib.pack_panels12.restype, lib.pack_panels12.argtypes = None, [ptr, i64, i64, ptr]
    lib.pairs12_bytes.restype, lib.pairs12_bytes.argtypes = i64, [ptr, i64, i64]
    lib.pack_pairs12.restype, lib.pack_pairs12.argtypes = None, [ptr, i64, i64, ptr]
    lib.i8_gemm_available.restype, lib.i8_gemm_available.argtypes = ctypes.c_int, []
    lib.i8_gemm_weight_levels.restype, lib.i8_gemm_weight_levels.argtypes = ctypes.c_int, []
    lib.i8_gemm_packed_bytes.restype, lib.i8_gemm_packed_bytes.argtypes = i64, [i64, i64]
    lib.i8_gemm_pack.restype, lib.i8_gemm_pack.argtypes = ctypes.c_int, [ptr, i64, i64, ptr, ptr]
    lib.i8_gemm.restype = ctypes.c_int
    lib.i8_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i32]
    lib.attention_work_items.restype = i64
    lib.attention_work_items.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    lib.sample_rows_f32.restype = ctypes.c_int
    sample_argtypes: list[Any] = [ptr, i64, i64, i64] + [ptr] * 6
    lib.sample_rows_f32.argtypes = sample_argtypes
    lib.penalize_rows_f32.restype = ctypes.c_int
    penalize_argtypes: list[Any] = [ptr, i64, i64, i64] + [ptr] * 7
    lib.penalize_rows_f32.argtypes = penalize_argtypes
    lib.logprobs_rows_f32.restype = None
    logprobs_argtypes: list[Any] = [ptr, i64, i64, i64, ptr, i64] + [ptr] * 4
    lib.logprobs_rows_f32.argtypes = logprobs_argtypes
    lib.set_tile_dot.restype, lib.set_tile_dot.argtypes = ctypes.c_int, [ctypes.c_int]
    lib.set_tile_dot(int(tile_dot_pays()))
    return lib


def tile_dot_pays() -> bool:
    """Whether the bfloat16 prefill tiles compute their scores and P V by vdpbf16ps (P rounded
    to bfloat16; cpu_ops.c tile_scores_dot, tile_pv_dot): on AMD CPUs with AVX512-BF16 (Zen
    4, 5), whose vdpbf16ps issues at the rate of float32 FMAs; Intel's issue it at half that
    rate (their AMX CPUs send long bfloat16 prompts to SDPA)."""
    from kvflow.workers.hardware import cpu_flags, cpu_vendor
    return "avx512_bf16" in cpu_flags() and cpu_vendor() == "AuthenticAMD"


def set_tile_dot(on: bool) -> bool:
    """Turn the bfloat16 tiles' vdpbf16ps path on or off (tests, benchmarks; not while a
    kernel runs); whether this build has it."""
    lib = library()
    assert lib is not None, build_error()
    return bool(lib.set_tile_dot(int(on)))


def _fn(op: str, dtype: torch.dtype) -> Any:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {build_error()}")
    if dtype not in DTYPES:
        raise TypeError(f"the CPU kernels take float32 or bfloat16, not {dtype}")
    return getattr(lib, f"{op}_{DTYPES[dtype]}")


def _rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """x as rows of n contiguous elements a fixed stride apart (a copy only when it must)."""
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < n):
        rows = rows.contiguous()
    return rows, rows.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.py's rms_norm over the last dim."""
    n = x.shape[-1]
    rows, stride = _rows(x, n)
    out = torch.empty(x.shape, dtype=x.dtype)
    assert weight.dtype == x.dtype and weight.is_contiguous()
    _fn("rms_norm", x.dtype)(rows.data_ptr(), stride, weight.data_ptr(), rows.shape[0], n,
                             eps, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/norm.py's add_rms_norm: (rms_norm(residual + x), residual + x); the sum is
    written into `residual` (contiguous, the layer's own running sum) and returned."""
    n = x.shape[-1]
    rows, stride = _rows(x, n)
    assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    assert weight.dtype == x.dtype and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn("add_rms_norm", x.dtype)(rows.data_ptr(), stride, residual.data_ptr(),
                                 weight.data_ptr(), rows.shape[0], n, eps, out.data_ptr())
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """models/llama.py's silu_and_mul: silu(first half) * second half of the last dim."""
    n = x.shape[-1] // 2
    rows, stride = _rows(x, 2 * n)
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
    _fn("silu_and_mul", x.dtype)(rows.data_ptr(), stride, rows.shape[0], n, out.data_ptr())
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """torch_attention.store_kv: key/value [num_tokens, num_kv_heads, head_dim] (strided
    tokens and heads are fine) into the head-major caches at `slot_mapping` (int64); float32
    rows into a bfloat16 cache are rounded as torch rounds; into an int8 cache
    ([heads, slots, head_dim + KV_I8_EXTRA]) quantized per row (`quantize_kv_rows`)."""
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    lib = library()
    assert lib is not None, build_error()
    for src, cache in ((key, k_cache), (value, v_cache)):
        assert src.shape[0] == slot_mapping.shape[0]
        assert (src.dtype == cache.dtype or (src.dtype, cache.dtype) == KV_BF16
                or (src.dtype in DTYPES and cache.dtype == torch.int8))
        if src.stride(2) != 1:
            src = src.contiguous()
        size = src.element_size()
        heads, num_slots, head_dim = cache_rows(cache)
        assert src.shape[1:] == (heads, head_dim)
        store, row = ((getattr(lib, f"store_kv_i8_{DTYPES[src.dtype]}"), head_dim)
                      if cache.dtype == torch.int8
                      else (lib.store_kv_f32_to_bf16, head_dim) if src.dtype != cache.dtype
                      else (lib.store_kv, head_dim * size))
        if store(src.data_ptr(), src.stride(0) * size, src.stride(1) * size,
                 slot_mapping.data_ptr(), src.shape[0], heads, row, num_slots,
                 cache.data_ptr()):
            raise IndexError(f"a slot of slot_mapping is outside the cache's {num_slots} "
                             f"slots: {slot_mapping.tolist()}")


def sample(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
           top_p: Sequence[float], min_p: Sequence[float], u: torch.Tensor) -> torch.Tensor:
    """One token a row of float32 logits [rows, vocab]: logits / temperature, masked by top-k
    (<= 0: off), top-p (1: off) and min-p (0: off) as sampler.apply_top_k_top_p_min_p does,
    then the first token whose running probability passes u (float64, [rows], in [0, 1)):
    Sampler._draw's rules, without sorting the row (cpu_ops.c, sample_rows_f32)."""
    rows, stride = _rows(logits, logits.shape[-1])
    n = rows.shape[0]
    assert rows.dtype == torch.float32 and u.dtype == torch.float64 and u.shape == (n,)
    assert len(temperature) == len(top_k) == len(top_p) == len(min_p) == n
    f32, i64 = ctypes.c_float * n, ctypes.c_int64 * n
    u = u.contiguous()
    out = torch.empty(n, dtype=torch.int64)
    lib = library()
    assert lib is not None, build_error()
    if lib.sample_rows_f32(rows.data_ptr(), stride, n, rows.shape[1], f32(*temperature),
                           i64(*top_k), f32(*top_p), f32(*min_p), u.data_ptr(),
                           out.data_ptr()):
        raise MemoryError("the CPU sampler could not allocate its scratch memory")
    return out


def penalize(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[Sequence[int]],
             num_outputs: Sequence[int], repetition: Sequence[float],
             frequency: Sequence[float], presence: Sequence[float]) -> None:
    """The repetition, frequency and presence penalties, in place on float32 logits
    [batch, vocab], for the listed rows: row rows[j] with token history token_ids[j] (prompt +
    output, its last num_outputs[j] the output) and those penalties
    (logits_processors.apply_penalties' rules, cpu_ops.c penalize_rows_f32)."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1
    n = len(rows)
    lengths = np.fromiter((len(t) for t in token_ids), np.int64, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, int(offsets[-1]))
    index = np.asarray(rows, dtype=np.int64)
    outputs = np.asarray(num_outputs, dtype=np.int64)
    f32 = ctypes.c_float * n
    lib = library()
    assert lib is not None, build_error()
    if lib.penalize_rows_f32(logits.data_ptr(), logits.stride(0), logits.shape[1], n,
                             index.ctypes.data, ids.ctypes.data, offsets.ctypes.data,
                             outputs.ctypes.data, f32(*repetition), f32(*frequency),
                             f32(*presence)):
        raise MemoryError("the CPU penalties could not allocate their scratch memory")


def logprobs(logits: torch.Tensor, top_n: Sequence[int], chosen: Sequence[int]
             ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per row of float32 logits [rows, vocab]: the log-softmax at token chosen[r], and the
    top_n[r] (0..vocab) largest tokens' (id, log-softmax), largest first (cpu_ops.c,
    logprobs_rows_f32: Sampler._logprobs' values without a row-wide log_softmax)."""
    rows, stride = _rows(logits, logits.shape[-1])
    n, vocab = rows.shape
    assert rows.dtype == torch.float32 and len(top_n) == len(chosen) == n
    assert all(0 <= t < vocab for t in chosen)
    width = max(max(top_n, default=0), 1)
    i64 = ctypes.c_int64 * n
    chosen_lp = (ctypes.c_float * n)()
    values = np.zeros((n, width), dtype=np.float32)
    ids = np.zeros((n, width), dtype=np.int64)
    lib = library()
    assert lib is not None, build_error()
    lib.logprobs_rows_f32(rows.data_ptr(), stride, n, vocab, i64(*top_n), width, i64(*chosen),
                          chosen_lp, values.ctypes.data, ids.ctypes.data)
    tops = [list(zip(ids[r, :k].tolist(), values[r, :k].tolist()))
            for r, k in enumerate(min(k, vocab) for k in top_n)]
    return list(chosen_lp), tops


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for NaN-free x (the first index of the max), as int64."""
    n = x.shape[-1]
    rows, stride = _rows(x, n)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    _fn("argmax", x.dtype)(rows.data_ptr(), stride, rows.shape[0], n, out.data_ptr())
    return out


GEMV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# (activations, KV cache) dtypes that differ and that the kernels take: float32 arithmetic
# with a bfloat16 KV cache.
KV_BF16 = (torch.float32, torch.bfloat16)
# An int8 cache row: head_dim int8 values, then their float32 scale (cpu_ops.c KV_EXTRA).
KV_I8_EXTRA = 4


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """What store_kv writes into an int8 cache, in torch (the reference): x [..., head_dim]
    float32 or bfloat16 -> int8 rows [..., head_dim + 4]: with scale = amax * (1 / 127) (all
    in float32), the values q = x * (1 / scale) rounded to nearest even, then the scale's 4
    bytes (a row of zeros: all zero)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) * torch.tensor(1.0 / 127.0,
                                                                dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny               # a row of ~0: zeros (cpu_ops.c)
    inv = torch.where(scale >= tiny, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def cache_rows(cache: torch.Tensor) -> tuple[int, int, int]:
    """A head-major cache's (heads, slots, head_dim): an int8 cache's rows are longer."""
    heads, num_slots, row = cache.shape
    return heads, num_slots, row - (KV_I8_EXTRA if cache.dtype == torch.int8 else 0)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows [..., head_dim + 4] as float32 values [..., head_dim]."""
    scale = rows[..., -KV_I8_EXTRA:].contiguous().view(torch.float32)
    return rows[..., :-KV_I8_EXTRA].float() * scale


# cpu_gemv.c's codes for weights in a layout of its own (else the dtype's, GEMV_TYPES):
# bfloat16 in the tile unit's layout (pack_amx), or in panels (pack_panels; int8:
# pack_i8_panels; 12 bits a weight: pack_panels12), or in pair panels (pack_pairs; 12 bits a
# weight: pack_pairs12).
GEMV_LAYOUTS = {"amx": 3, "panels": 4, "panels12": 6, "pairs": 7, "pairs12": 8}
TWELVE_BIT = ("panels12", "pairs12")           # uint8 [N, bytes / N] layouts
I8_PANELS = 5


def gemv_type(weight: torch.Tensor, layout: str = "rows") -> int:
    """cpu_gemv.c's code for a weight: its dtype's when row-major ("rows"), else its layout's."""
    if layout == "panels" and weight.dtype == torch.int8:
        return I8_PANELS
    if layout in TWELVE_BIT:
        return GEMV_LAYOUTS[layout]
    return GEMV_TYPES[weight.dtype] if layout == "rows" else GEMV_LAYOUTS[layout]


def pack_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in the layout cpu_gemv.c's AMX path reads (`gemv(..., layout="amx")`),
    or None where that path cannot take it (no AMX here, not bfloat16, N % 16 or K % 32 not
    0). Per 16 outputs and 32 inputs, one 1 KB tile: [input pair][output][2]. Shape [N, K]
    kept, so the same checks and sizes hold."""
    n, k = weight.shape
    if gemv_amx_rows() == 0 or weight.dtype != torch.bfloat16 or n % 16 or k % 32:
        return None
    tiles = weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    return tiles.contiguous().view(n, k)


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in the panels cpu_gemv.c multiplies under float32 arithmetic
    (`gemv(..., layout="panels")`, faster than row-major from about 8 rows of x), or None
    where it cannot (no vector path in this build, not bfloat16, N not a multiple of the
    panel width: 16 outputs on AVX2, 32 on AVX-512). Shape [N, K] kept."""
    lib = library()
    width = 0 if lib is None else int(lib.gemv_panel_width())
    n, k = weight.shape
    if lib is None or width == 0 or weight.dtype != torch.bfloat16 or n % width:
        return None
    weight = weight.contiguous()
    out = torch.empty_like(weight)
    lib.pack_panels(weight.data_ptr(), n, k, out.data_ptr())
    return out


def pack_panels12(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in cpu_gemv.c's 12-bit panels (`gemv(..., layout="panels12")`):
    the bfloat16 panels with each weight's high byte (sign, exponent) kept as a 4-bit index
    into its group's table of 16, every bit kept, 76% of the bytes; the same results as
    `pack_panels`' bit for bit. None where it cannot (as pack_panels; also K odd). A uint8
    tensor [N, bytes / N] (rounded up): its first dimension is the weight's outputs."""
    lib = library()
    if lib is None or int(lib.gemv_panel_width()) == 0 or weight.dtype != torch.bfloat16:
        return None
    return _pack12(lib.panels12_bytes, lib.pack_panels12, weight)


def pack_pairs12(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in cpu_gemv.c's 12-bit pair panels (`gemv(...,
    layout="pairs12")`, up to `pairs12_rows()` rows of x, bfloat16): pack_panels12's groups
    and tables, each pair of inputs decoded into the pair panels' words, so the same results
    as `pack_pairs`' bit for bit at 76% of the bytes. None where it cannot (as pack_pairs); a
    uint8 tensor as pack_panels12's."""
    if not pairs_available() or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    lib = library()
    assert lib is not None                       # pairs_available() loaded it
    return _pack12(lib.pairs12_bytes, lib.pack_pairs12, weight)


def _pack12(size: Callable[..., int], pack: Callable[..., None], weight: torch.Tensor
            ) -> torch.Tensor | None:
    n, k = weight.shape
    weight = weight.contiguous()
    nbytes = int(size(weight.data_ptr(), n, k))
    if nbytes == 0:
        return None
    out = torch.zeros(n, -(-nbytes // n), dtype=torch.uint8)
    pack(weight.data_ptr(), n, k, out.data_ptr())
    return out


def pack_i8_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """An int8 weight [N, K] (row-major, the gemv kernel's W8A16 rows) in the int8 panels
    cpu_gemv.c streams as one run per panel (`gemv(..., layout="panels")`; the same results
    as the row-major layout, read faster), or None where it cannot (no vector path in this
    build, N not a multiple of the panel width, K odd). Shape [N, K] kept."""
    lib = library()
    width = 0 if lib is None else int(lib.gemv_panel_width())
    n, k = weight.shape
    if lib is None or width == 0 or weight.dtype != torch.int8 or n % width or k % 2:
        return None
    weight = weight.contiguous()
    out = torch.empty_like(weight)
    if lib.pack_i8_panels(weight.data_ptr(), n, k, out.data_ptr()):
        return None
    return out


class I8Gemm(NamedTuple):
    """int8 weights (7-bit on AVX2, 8-bit with AVX512-VNNI) packed for `i8_gemm`
    (cpu_gemm_i8.c), from [n, k]."""
    packed: torch.Tensor          # int8, the kernel's panels
    comp: torch.Tensor            # int32 [n padded to 16]: 128 x each row's sum
    scales: torch.Tensor          # float32 [n padded to 16]: W ~ q * scale per row
    n: int
    k: int


def pad16(v: torch.Tensor) -> torch.Tensor:
    """A vector in float32, zero-padded to a multiple of 16 (whole panels of `i8_gemm`)."""
    return F.pad(v.float(), (0, -v.numel() % 16)).contiguous()


def i8_gemm_available() -> bool:
    """Whether this build has `i8_gemm` (x86 with AVX2)."""
    lib = library()
    return lib is not None and bool(lib.i8_gemm_available())


def i8_gemm_weight_levels() -> int:
    """The weight range `i8_gemm` takes, |q| <= this: 127 on builds with AVX512-VNNI, 63 on
    AVX2 (7-bit: its 16-bit pair sums), 0 without the kernel."""
    lib = library()
    return 0 if lib is None else int(lib.i8_gemm_weight_levels())


def i8_gemm_pack(q: torch.Tensor, scales: torch.Tensor) -> I8Gemm | None:
    """int8 weights [n, k] with |q| <= i8_gemm_weight_levels() and their row scales, packed
    for `i8_gemm`; None where this build has no such kernel (no AVX2) or the weights do not
    fit it (8-bit weights on AVX2, -128 anywhere)."""
    lib = library()
    levels = i8_gemm_weight_levels()
    if (lib is None or q.dtype != torch.int8 or q.dim() != 2 or q.numel() == 0
            or int(q.min()) < -levels or int(q.max()) > levels):  # (abs(-128) is -128)
        return None
    n, k = q.shape
    q = q.contiguous()
    packed = torch.empty(int(lib.i8_gemm_packed_bytes(n, k)), dtype=torch.int8)
    comp = torch.zeros(n + -n % 16, dtype=torch.int32)
    if lib.i8_gemm_pack(q.data_ptr(), n, k, packed.data_ptr(), comp.data_ptr()):
        return None
    return I8Gemm(packed, comp, pad16(scales), n, k)


def i8_gemm(q: torch.Tensor, x_scales: torch.Tensor, weight: I8Gemm,
            bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Int8Linear's W7A8 (AVX2) or W8A8 (AVX512-VNNI) product (cpu_gemm_i8.c): q [rows, k]
    uint8 with zero point 128 and x_scales [rows] (`quantize_rows`) times `weight`, plus the bias
    (float32 [n] or None), in `dtype`: the exact integer sums, scaled as `scale_rows` scales
    oneDNN's output."""
    lib = library()
    assert lib is not None, build_error()
    rows, k = q.shape
    assert k == weight.k and q.dtype == torch.uint8 and q.stride(1) == 1
    assert x_scales.dtype == torch.float32 and x_scales.is_contiguous()
    assert dtype in DTYPES
    out = torch.empty(rows, weight.n, dtype=dtype)
    pad_bias = None if bias is None else pad16(bias)
    code = lib.i8_gemm(q.data_ptr(), q.stride(0), rows, k, weight.packed.data_ptr(),
                       weight.comp.data_ptr(), weight.n, weight.scales.data_ptr(),
                       x_scales.data_ptr(), None if pad_bias is None else pad_bias.data_ptr(),
                       out.data_ptr(), weight.n, int(dtype == torch.bfloat16))
    if code:
        raise RuntimeError("i8_gemm cannot run in this build (no AVX2)")
    return out


GEMV_BLOCK_BYTES = 1 << 20
GEMV_BLOCK_MIN_ROWS = 64


def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         in_scale: torch.Tensor | None = None, layout: str = "rows") -> torch.Tensor:
    """(x * in_scale) W^T (+ bias), streaming W once (cpu_gemv.c): decode-shaped products
    (a few rows of x), and on the panel layouts (panels, pairs) any number of rows, prefill
    too (GemvLinear), in blocks of GEMV_BLOCK_BYTES of x.
    x [..., K] float32 or bfloat16; W [N, K] contiguous float32, bfloat16 or int8 (then
    `scales` [N] float32: W ~ int8 * scale per row), or packed by `pack_amx` (bfloat16,
    layout="amx", x bfloat16), `pack_panels` or `pack_i8_panels` (layout="panels"),
    `pack_pairs` (layout="pairs", x bfloat16), `pack_panels12` (layout="panels12": uint8
    [N, ...]) or `pack_pairs12` (layout="pairs12", as panels12, up to `pairs12_rows()`
    rows of x bfloat16); in_scale [K] float32 or None; bias [N] float32 or None. Out:
    [..., N] in out_dtype (x's)."""
    k = x.shape[-1]
    rows, stride = _rows(x, k)
    n = weight.shape[0]
    if layout in TWELVE_BIT:
        assert weight.is_contiguous() and weight.dtype == torch.uint8 and scales is None
    else:
        assert weight.is_contiguous() and weight.shape == (n, k) and weight.dtype in GEMV_TYPES
    assert (scales is not None) == (weight.dtype == torch.int8)
    assert scales is None or (scales.dtype == torch.float32 and scales.is_contiguous())
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    assert in_scale is None or (in_scale.dtype == torch.float32 and in_scale.shape == (k,)
                                and in_scale.is_contiguous())
    assert x.dtype in DTYPES
    out_dtype = out_dtype or x.dtype
    out = torch.empty(rows.shape[0], n, dtype=out_dtype)
    lib = library()
    assert lib is not None, build_error()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    # In blocks of GEMV_BLOCK_BYTES of x (as given): the kernel reads every row of x once per
    # panel of W (W itself once), so x must stay in the caches (7B shapes, 2048 rows: 0.89x
    # oneDNN's speed in one call, 0.98-1.0x in blocks of 64-512 rows).
    block = max(GEMV_BLOCK_MIN_ROWS, GEMV_BLOCK_BYTES // max(1, k * x.element_size()))
    code = 0
    for first in range(0, max(rows.shape[0], 1), block):
        count = min(block, rows.shape[0] - first)
        code = lib.gemv(rows.data_ptr() + first * stride * x.element_size(),
                        GEMV_TYPES[x.dtype], stride, count, weight.data_ptr(),
                        gemv_type(weight, layout), ptr(scales), ptr(in_scale), ptr(bias), n, k,
                        out.data_ptr() + first * n * out.element_size(),
                        GEMV_TYPES[out_dtype], n)
        if code:
            break
    if code == 1:
        raise MemoryError("gemv could not allocate its scratch memory")
    if code:
        raise RuntimeError(f"gemv: the {layout} layout's path cannot run these operands here")
    return out.view(x.shape[:-1] + (n,))


def pack_pairs(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in the pair panels cpu_gemv.c multiplies with bfloat16 dot
    products (`gemv(..., layout="pairs")`, x bfloat16), or None where it cannot (a build
    without AVX512-BF16, not bfloat16, N not a multiple of 32 or K odd). Shape [N, K] kept."""
    if not pairs_available() or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % 32 or k % 2:
        return None
    lib = library()
    assert lib is not None                       # pairs_available() loaded it
    weight = weight.contiguous()
    out = torch.empty_like(weight)
    return out if lib.pack_pairs(weight.data_ptr(), n, k, out.data_ptr()) == 0 else None


def pairs_available() -> bool:
    """Whether this build has the bfloat16 pair panels (`pack_pairs`: AVX512-BF16)."""
    lib = library()
    return lib is not None and bool(lib.gemv_pairs_available())


def panels12_rows() -> int:
    """Up to how many rows of x `gemv` decodes the 12-bit panels (`pack_panels12`) in
    registers, once for all the rows (more decode each panel into a buffer first, slower
    than the bfloat16 panels); 0 where this build has none."""
    lib = library()
    return int(lib.gemv_panels12_rows()) if lib is not None else 0


def pairs12_rows() -> int:
    """Up to how many rows of x `gemv` multiplies the 12-bit pair panels (`pack_pairs12`),
    0 where this build has none."""
    lib = library()
    return int(lib.gemv_pairs12_rows()) if lib is not None else 0


def gemv_amx_rows() -> int:
    """Up to how many rows of x `gemv` multiplies bfloat16 weights on the CPU's AMX tile unit
    (cpu_gemv.c, `amx_linear`): 32 where the library was built with AMX and Linux granted the
    process its tile state, else 0."""
    lib = library()
    return 0 if lib is None else int(lib.gemv_amx_rows())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 quantization for Int8Linear (layers/linear.py): uint8 rows with zero point
    128 and float32 scales [rows], x ~ (q - 128) * scale; `quantize_rows_ref` is the reference."""
    n = x.shape[-1]
    rows, stride = _rows(x, n)
    q = torch.empty(rows.shape, dtype=torch.uint8)
    scales = torch.empty(rows.shape[0], dtype=torch.float32)
    _fn("quantize_rows", x.dtype)(rows.data_ptr(), stride, rows.shape[0], n, q.data_ptr(),
                                  scales.data_ptr())
    return q, scales


def scale_rows(y: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """Int8Linear's output: float32 rows y [rows, n] times scales [rows], plus the float32
    bias, rounded once to `dtype`; `scale_rows_ref` (layers/linear.py) is the reference."""
    assert y.dtype == scales.dtype == torch.float32 and y.is_contiguous() and y.dim() == 2
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    out = y if dtype == torch.float32 else torch.empty(y.shape, dtype=dtype)
    _fn("scale_rows", dtype)(y.data_ptr(), y.shape[0], y.shape[1], scales.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/rotary.py's apply_rotary; q, k: [num_tokens, heads, head_dim] (strided rows ok).
    Positions must lie inside the tables (the config caps max_model_len)."""
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    assert cos_table.dtype == sin_table.dtype == torch.float32
    assert cos_table.is_contiguous() and sin_table.is_contiguous()
    return _rotate(positions, q, cos_table, sin_table), _rotate(positions, k, cos_table,
                                                                sin_table)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos_table: torch.Tensor,
            sin_table: torch.Tensor) -> torch.Tensor:
    num_tokens, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn("rotary", x.dtype)(x.data_ptr(), x.stride(0), positions.data_ptr(),
                           cos_table.data_ptr(), sin_table.data_ptr(), num_tokens, heads, d,
                           out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, table_rows: torch.Tensor,
                    context_lens: torch.Tensor, q_rows: torch.Tensor, block_size: int,
                    scale: float, out: torch.Tensor) -> None:
    """Each entry i: query row q_rows[i] attends to the first context_lens[i] keys of the
    block table row table_rows[i] (its own key included, already in the cache). A decode is
    one entry; a prefill of n tokens after c cached ones is n entries on one table row with
    contexts c+1 .. c+n, i.e. causal attention.

    q, out: [num_rows, num_heads, head_dim] contiguous; only the rows named in q_rows are
    written. Caches: [num_kv_heads, num_slots, head_dim] (head-major, slot = block id *
    block_size + offset), of q's dtype, bfloat16 under float32 q, or int8 under either
    ([..., head_dim + KV_I8_EXTRA]: each row's values, then its scale). block_tables:
    [num_tables, max_blocks] int32, every entry a block id (pad with 0); table_rows,
    context_lens: [num_entries] int32; q_rows: [num_entries] int64.
    """
    tensors = (q, k_cache, v_cache, block_tables, table_rows, context_lens, q_rows, out)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    assert q.dtype in DTYPES and out.dtype == q.dtype and k_cache.dtype == v_cache.dtype
    assert (k_cache.dtype == q.dtype or (q.dtype, k_cache.dtype) == KV_BF16
            or k_cache.dtype == torch.int8)
    assert block_tables.dtype == table_rows.dtype == context_lens.dtype == torch.int32
    assert q_rows.dtype == torch.int64 and out.shape == q.shape
    max_blocks = block_tables.shape[1]
    num_kv_heads, num_slots, head_dim = cache_rows(k_cache)
    num_heads = q.shape[1]
    num_entries = q_rows.shape[0]
    assert q.shape[2] == head_dim and context_lens.shape == table_rows.shape == (num_entries,)
    kernel = (_fn("paged_attention", q.dtype) if k_cache.dtype == q.dtype
              else _fn("paged_attention_kv_i8", q.dtype) if k_cache.dtype == torch.int8
              else _fn("paged_attention_f32_kv", k_cache.dtype))     # ..._f32_kv_bf16
    status = kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[0], table_rows.data_ptr(), context_lens.data_ptr(),
        q_rows.data_ptr(), q.shape[0], num_entries, max_blocks, num_heads, num_kv_heads,
        head_dim, block_size, num_slots, scale, out.data_ptr())
    if status == 1:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}, at most 16 query heads per KV head")
    if status == 3:
        raise IndexError("paged_attention: a table row, query row, context length or block "
                         "id lies outside its tensor")
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")


def attention_work_items(table_rows: torch.Tensor, context_lens: torch.Tensor,
                         q_rows: torch.Tensor, head_dim: int) -> list[tuple[int, int]]:
    """How `paged_attention` splits these entries: (first entry, rows) per item. A prefill
    run of at least 16 consecutive rows goes in tiles of up to 32 rows (flash-style), any
    other entry alone (row by row). For tests."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {build_error()}")
    n = q_rows.shape[0]
    items = torch.empty(2 * n, dtype=torch.int64)
    count = lib.attention_work_items(table_rows.data_ptr(), context_lens.data_ptr(),
                                     q_rows.data_ptr(), n, head_dim, items.data_ptr())
    return [(int(a), int(b)) for a, b in items[:2 * count].view(-1, 2).tolist()]
