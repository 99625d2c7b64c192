"""Linear layers already shaped for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. Each parameter carries a
`weight_loader(param, source, shard_id)` that reads only this rank's slice of the checkpoint.

How a layer holds and multiplies its weight is its `LinearMethod`, given when the model is
built (layers/ops.py chooses it): plain `F.linear`; on CPU `OneDnnLinear`, which packs the
weight once after loading (`finish_loading`) into oneDNN's blocked layout, the one torch's own
CPU compiler uses: a matmul then skips reordering the weight on each call, measured 25-40%
faster here for every batch size; or, with quantization="int8", `Int8Linear` (W8A8).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.workers.hardware import cpu_flags
from kvflow.workers.layers.parallel import TPGroup, full, narrow

logger = logging.getLogger("kvflow.worker")


class LinearMethod:
    """Plain torch: the weight as loaded, `F.linear`."""
    name = "torch"

    def prepare(self, weight: torch.Tensor, input_scale: torch.Tensor | None = None) -> Any:
        """The weight in the form `apply` reads (then the plain copy may be freed), or None
        when `apply` reads the plain weight. `input_scale`: SmoothQuant's scale per input
        feature (workers/smoothing.py), which the prepared weight must fold in (W * s)."""
        return None

    def apply(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b."""
        return F.linear(x, weight, bias)

    def gemv_rows(self, prepared: Any) -> int:
        """Up to how many rows of x `apply` multiplies this weight on the gemv kernel
        (kernels/cpu_gemv.c; 0: never). The fused decode path takes steps that large."""
        return 0


class OneDnnLinear(LinearMethod):
    """The weight packed in oneDNN's blocked layout (CPU, float32/bfloat16)."""
    name = "onednn"

    def prepare(self, weight: torch.Tensor, input_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(smoothed(weight, input_scale), 64)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")

    @classmethod
    def works(cls, dtype: torch.dtype) -> bool:
        """Whether this torch can pack weights for `dtype` and gets F.linear's result."""
        mkldnn = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available()
                and dtype in (torch.float32, torch.bfloat16)
                and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise")):
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        method = cls()
        try:
            got = method.apply(x, w, method.prepare(w))
        except RuntimeError as exc:                  # built without oneDNN's kernels, etc.
            logger.info("CPU weight packing unavailable: %s", exc)
            return False
        return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


class GemvWeight(NamedTuple):
    """A weight as GemvLinear holds it."""
    packed: Any                     # `inner`'s form of it (None: `inner` reads `plain`, or
                                    # none, as the panels' layouts take every product)
    plain: torch.Tensor             # [out, in]: the gemv kernel's copy, in `layout`
    layout: str = "rows"            # row-major; "amx": tiles (kernels/cpu_ops.pack_amx);
                                    # "panels": bfloat16 panels (cpu_ops.pack_panels);
                                    # "pairs": bfloat16 pair panels (cpu_ops.pack_pairs)
    one_row: torch.Tensor | None = None  # the same weight in 12 bits, lossless, which
                                    # products of up to one_row_rows rows read instead:
    one_row_layout: str = ""        # "panels12" (cpu_ops.pack_panels12) beside "panels",
                                    # "pairs12" (pack_pairs12) beside "pairs" and "amx"
    one_row_rows: int = 0           # beside "panels", GemvLinear.panels12_rows; beside
                                    # "pairs", pairs12_rows (the engine's: cpu_ops.
                                    # panels12_rows(), pairs12_rows()); beside "amx", 1


def _twelve_bit(rows: int, layout: str) -> str:
    return (f" (one row: 12-bit {layout})" if rows == 1 else
            f" (<= {rows} rows: 12-bit {layout})")


class GemvLinear(LinearMethod):
    """Decode-shaped products (at most `max_rows` rows of x) on kvflow's gemv kernel
    (kernels/cpu_gemv.c), which streams the row-major weight once at close to the memory's
    read speed; larger ones on `inner` (oneDNN's packed weight, or F.linear). The row-major
    weight is the loaded one, kept beside `inner`'s copy.

    With `pack_amx` (bfloat16 on CPUs with AMX, kernels/cpu_ops.py), each weight it can take
    is held in the tile unit's layout instead, and products of up to `amx_rows` rows go to
    the kernel's AMX path: at 5..32 rows a decode step's linears streamed their weights
    faster there than in oneDNN's GEMM (benchmarks/cpu_kernels.py --gemv). With
    `pack_pairs12` too (these CPUs have AVX512-BF16), one-row products read a second copy in
    12-bit pair panels instead (below): on an Intel Xeon with AMX, 2 threads, that kernel read
    a decode step's weights at the plain read's speed, and one request's step through the
    tiles took ~1.8x as long as through 12-bit panels on the same CPU (docs/design.md).

    With `stream_dtype` bfloat16 under float32 weights (whose values are bfloat16 already:
    loader.round_weights), the kernel's copy is bfloat16, widened in registers: the same
    values at half the bytes a decode step reads. With `pack_panels` that copy is held in
    the kernel's panels (outer products, no horizontal sums) where the output count allows,
    and, unless `gemm_copy`, the panels take every product, prefill too, and `inner` keeps no
    copy (`packed` None): 2 bytes a parameter (3.5 with the 12-bit copy below) where
    oneDNN's float32 copy adds 4. With `gemm_copy` it keeps one, and products of more than
    `copy_rows` rows run there (layers/ops.py keep_copy decides; the two compared:
    docs/design.md, "oneDNN's copy for prompts"). Elsewhere (a weight whose outputs are not
    whole panels) the bfloat16 copy is row-major and `inner` keeps its float32 copy.
    With `pack_panels12` too, products of up to `panels12_rows` rows (a single request's
    decode step, or a few requests': cpu_ops.panels12_rows, 3 on AVX2 and 4 on AVX-512)
    read a second copy, the same panels in 12 bits a weight (lossless: each weight's sign
    and exponent byte an index into a table of 16 per 1024 weights): 76% of the bytes, the
    same results bit for bit; one row is a stream of the weights, so its linears ran
    1.2-1.35x faster (benchmarks/cpu_kernels.py --gemv), and a few rows still are (the
    kernel's comment, cpu_gemv.c P12_ROWS). More rows keep the bfloat16 panels, where the
    decoding costs more than the bytes it saves. The copy adds 0.76x the bfloat16 panels'
    memory (the engine always passes pack_panels12). With `one_row_copy` False no
    12-bit copy of any layout is made (cpu_one_row_copy, which the worker decides at load:
    layers/ops.py keep_copy).

    With `pack_pairs` (bfloat16 arithmetic on CPUs with AVX512-BF16 but no AMX), the
    kernel's copy is held in pair panels instead (cpu_ops.pack_pairs: bfloat16 dot
    products, no horizontal sums), which likewise take every product unless `gemm_copy`: on
    an AMD EPYC Zen 5 a decode step's linears streamed 1.3-1.7x faster than row-major at one
    row and 1.1-1.5x faster than oneDNN's bfloat16 GEMM at 8-64 rows (benchmarks/
    cpu_kernels.py --gemv). With `pack_pairs12` too, products of up to `pairs12_rows` rows
    (cpu_ops.pairs12_rows: a few, where a step is still a read of the weights) read a
    second copy of the pair panels in 12 bits a weight (cpu_ops.pack_pairs12: the same bits,
    76% of the bytes; layers/ops.py one_row_pairs12)."""

    def __init__(self, gemv: Callable[..., torch.Tensor], inner: LinearMethod,
                 max_rows: int,
                 pack_amx: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 amx_rows: int = 0, stream_dtype: torch.dtype | None = None,
                 pack_panels: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 pack_panels12: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 pack_pairs: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 pack_pairs12: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 pairs12_rows: int = 1, gemm_copy: bool | None = None, copy_rows: int = 64,
                 one_row_copy: bool | None = None, panels12_rows: int = 1) -> None:
        self.gemv = gemv
        self.gemm_copy = gemm_copy           # None: not decided yet (the worker's, at load)
        self.one_row_copy = one_row_copy     # False: no 12-bit copies (the worker's, at load)
        self.copy_rows = copy_rows
        self.inner = inner
        self.max_rows = max_rows
        self.pack_amx = pack_amx if amx_rows else None
        self.amx_rows = amx_rows if pack_amx is not None else 0
        self.stream_dtype = stream_dtype
        self.pack_panels = pack_panels if stream_dtype is not None else None
        self.pack_panels12 = (pack_panels12 if self.pack_panels is not None and panels12_rows
                              else None)     # 0 rows: the build has no 12-bit panels
        self.panels12_rows = panels12_rows if self.pack_panels12 is not None else 0
        self.pack_pairs = pack_pairs if stream_dtype is None else None
        self.pack_pairs12 = (pack_pairs12 if self.pack_pairs is not None
                             or self.pack_amx is not None else None)
        self.pairs12_rows = pairs12_rows if self.pack_pairs12 is not None else 0

    @property
    def name(self) -> str:                   # type: ignore[override]
        """What runs, for the logs: read when asked, as the copies are decided at load."""
        stream = self.stream_dtype
        copies = self.one_row_copy is not False
        streams = "" if stream is None else f", {str(stream).removeprefix('torch.')} weights"
        rows = "every row count" if not self.gemm_copy else f"<= {self.copy_rows} rows"
        if self.pack_panels is not None:
            streams += f" in panels, {rows}"
            if self.pack_panels12 is not None and copies:
                streams += _twelve_bit(self.panels12_rows, "panels")
        if self.pack_pairs is not None:
            streams += f"; bfloat16 pair panels, {rows}"
            if self.pack_pairs12 is not None and copies:
                streams += _twelve_bit(self.pairs12_rows, "pair panels")
        inner = self.inner.name
        if self.amx_rows:
            one_row = ("; one row: 12-bit pair panels" if self.pack_pairs12 is not None and copies
                       else "")
            return (f"gemv (<= {self.max_rows} rows; AMX <= {self.amx_rows}{one_row}) "
                    f"+ {inner}")
        return f"gemv (<= {self.max_rows} rows{streams}) + {inner}"

    def prepare(self, weight: torch.Tensor, input_scale: torch.Tensor | None = None
                ) -> GemvWeight:
        weight = smoothed(weight, input_scale)
        paneled = self._panels(weight)
        if paneled is not None:
            # `inner`'s copy only where asked (gemm_copy): else the panels take every product
            return (paneled._replace(packed=self.inner.prepare(weight)) if self.gemm_copy
                    else paneled)
        packed = self.inner.prepare(weight)
        # Only beside `inner`'s own copy: an `inner` that reads the plain weight needs it.
        tiles = (self.pack_amx(weight) if self.pack_amx is not None and packed is not None
                 else None)
        if tiles is not None:
            return GemvWeight(packed, tiles, "amx", self._copy(self.pack_pairs12, weight),
                              "pairs12", 1)
        stream = self.stream_dtype
        if packed is not None and stream is not None and stream != weight.dtype:
            return GemvWeight(packed, weight.to(stream).contiguous())
        return GemvWeight(packed, weight.contiguous())

    def _panels(self, weight: torch.Tensor) -> GemvWeight | None:
        """The weight in pair panels or bfloat16 panels (with their 12-bit copy), where this
        method holds them and the output count fills whole panels."""
        if self.pack_pairs is not None:
            pairs = self.pack_pairs(weight)
            if pairs is not None:
                return GemvWeight(None, pairs, "pairs", self._copy(self.pack_pairs12, weight),
                                  "pairs12", self.pairs12_rows)
        if self.pack_panels is not None and self.stream_dtype != weight.dtype:
            narrow = weight.to(self.stream_dtype).contiguous()
            panels = self.pack_panels(narrow)
            if panels is not None:
                return GemvWeight(None, panels, "panels", self._copy(self.pack_panels12, narrow),
                                  "panels12", self.panels12_rows)
        return None

    def _copy(self, pack: Callable[[torch.Tensor], torch.Tensor | None] | None,
              weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's 12-bit copy for products of one to a few rows, unless there is none
        to make."""
        return None if pack is None or self.one_row_copy is False else pack(weight)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if prepared is None:                     # before finish_loading
            return F.linear(x, weight, bias)
        if x.numel() <= self.gemv_rows(prepared) * x.shape[-1]:
            b = None if bias is None else bias.float()
            rows = x.numel() // x.shape[-1]
            if prepared.one_row is not None and rows <= prepared.one_row_rows:
                return self.gemv(x, prepared.one_row, None, b, layout=prepared.one_row_layout)
            return self.gemv(x, prepared.plain, None, b, layout=prepared.layout)
        return self.inner.apply(x, prepared.plain, prepared.packed, bias)

    def gemv_rows(self, prepared: Any) -> int:
        if prepared is None:
            return 0
        if prepared.layout in ("panels", "pairs"):
            return EVERY_ROW if prepared.packed is None else self.copy_rows
        return self.amx_rows if prepared.layout == "amx" else self.max_rows

    @property
    def makes_one_row_copies(self) -> bool:
        """Whether 12-bit copies would be made (then one_row_copy decides whether they are)."""
        return self.pack_panels12 is not None or self.pack_pairs12 is not None

    @property
    def holds_panels(self) -> bool:
        """Whether weights whose outputs fill whole panels are held in panels or pair panels
        (then gemm_copy decides whether `inner` keeps a copy of them too)."""
        return self.pack_panels is not None or self.pack_pairs is not None


# gemv_rows of weights the kernel takes whatever the rows (panels, pair panels).
EVERY_ROW = 1 << 30


def smoothed(weight: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    return weight if input_scale is None else weight.float() * input_scale


class GemvOperands(NamedTuple):
    """What the gemv kernel reads of a prepared weight: (x * in_scale) W^T * scales."""
    weight: torch.Tensor                 # [out, in] in `layout` (model dtype, or int8)
    scales: torch.Tensor | None          # int8: float32 per output row
    in_scale: torch.Tensor | None        # float32 per input feature (int8 with SmoothQuant)
    layout: str = "rows"                 # row-major, or GemvWeight.layout's other layouts
    one_row: torch.Tensor | None = None  # GemvWeight.one_row: 12-bit panels or pair panels,
    one_row_layout: str = ""             # read by products of up to one_row_rows rows
    one_row_rows: int = 0


def gemv_operands(prepared: Any) -> GemvOperands | None:
    """The gemv kernel's operands of a prepared weight (kernels/cpu_gemv.c; the fused decode
    path, workers/fused_decode.py), or None when it keeps none."""
    if isinstance(prepared, GemvWeight):
        return GemvOperands(prepared.plain, None, None, prepared.layout, prepared.one_row,
                            prepared.one_row_layout, prepared.one_row_rows)
    if isinstance(prepared, Int8Weight) and prepared.rows is not None:
        return GemvOperands(prepared.rows, prepared.row_scales, prepared.in_scale,
                            prepared.layout)
    return None


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) int8 quantization, the reference of the C kernel
    (kernels/cpu_ops.py quantize_rows): uint8 with zero point 128, float32 scale per row
    (max|x| / 127, 1 for a zero row), x ~ (q - 128) * scale."""
    x = x.reshape(-1, x.shape[-1]).float()
    peak = x.abs().amax(dim=1)
    scales = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    q = torch.round(x * (1.0 / scales).unsqueeze(1)) + 128.0
    return q.to(torch.uint8), scales


def gemm_weight_levels(flags: frozenset[str]) -> int:
    """The int8 GEMM's weight range, |q| <= this: 127 (8 bits) where the CPU multiplies
    u8 x s8 into 32 bits (VNNI, AMX-INT8); else 63 (7 bits, oneDNN's own advice): without
    them x86 sums pairs of u8 x s8 products into saturating 16 bits (vpmaddubsw), which 8-bit
    activations times 8-bit weights overflow (measured on oneDNN's AVX2 path) and 8-bit
    activations times 7-bit weights never do (2 x 255 x 63 < 32768). 7-bit weights keep
    more of float32's tokens than 7-bit activations (benchmarks/int8_quality.py)."""
    return 127 if not flags or flags & {"avx512_vnni", "avx_vnni", "amx_int8"} else 63


VNNI_GEMV_ROWS = 32
VNNI_OWN_GEMM_ROWS = 8


def int8_gemv_rows(flags: frozenset[str], rows: int, own_gemm: bool = False) -> int:
    """Up to how many rows int8 products run W8A16 on the gemv kernel: `rows` (the float
    layers' limit) where the CPU has AMX-INT8 or AVX-VNNI only, whose oneDNN u8 x s8 GEMM is
    the faster from there on, or where kvflow's own W7A8 GEMM runs (`own_gemm`:
    kernels/cpu_gemm_i8.c, CPUs without VNNI); 8 where kvflow's GEMM runs W8A8 with
    AVX512-VNNI, 32 where only oneDNN's would there (below); 48 where only oneDNN's W7A8
    GEMM would run without VNNI.
    Measured (all of a decode step's linears, 2 threads), the gemv kernel against oneDNN: as
    an AVX2 CPU, with the kernel before its integer sums, 0.37x oneDNN's W7A8 GEMM's time at
    8 rows, 0.56x at 16, 0.89x at 32 and 1.4x at 64; with the integer sums and VNNI, against
    oneDNN's W8A8: 0.6x at 4 rows, 0.75x at 8, 1.05-1.13x at 16, 1.35-1.65x at 32. With two
    input pairs a step (cpu_gemv.c), on an AVX2 AMD EPYC (Zen 3), against W7A8: 0.52x at 16
    rows, 0.77-0.79x at 32, 0.98x at 48, 1.03-1.10x at 64. Against kvflow's GEMM (same CPU,
    the 32-request workload in one process, decode steps of 5-8 / 9-16 tokens, two pairs):
    17.6/14.7 and 39.0/30.8 ms a step with the GEMM past 4 rows, 19.0/16.6 and 43.9/43.4
    with it past 16.
    With AVX512-VNNI but no AMX-INT8 (AMD EPYC Zen 4/5, Intel Cascade Lake to Ice Lake),
    kvflow's GEMM runs 8-bit weights (VNNI_OWN_GEMM_ROWS: up to 8 rows the gemv kernel was
    as fast, and W8A16 keeps more of float's tokens; AMD EPYC Zen 5, the 32-request workload
    in one process, steps of 1-8 tokens 5.1-5.2 -> 4.8 ms a step, 2 alternating runs each).
    Without it there (kernels built without AVX512-VNNI): up to VNNI_GEMV_ROWS, so that decode
    steps of up to 32 tokens run fused, W8A16, where past 4 rows they ran unfused on
    oneDNN's W8A8 (Zen 5, same workload: 639 -> 731 output tok/s). AVX-VNNI alone (AVX2
    CPUs) counts as no VNNI here: not measured there."""
    vnni = "avx512_vnni" in flags and "amx_int8" not in flags
    if own_gemm:
        return max(rows, VNNI_OWN_GEMM_ROWS) if vnni else rows
    if vnni:
        return max(rows, VNNI_GEMV_ROWS)
    wide = gemm_weight_levels(flags) == 127
    return rows if wide else max(rows, 48)


def scale_rows_ref(y: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The int8 GEMM's float32 output times each row's token scale, plus the float32 bias,
    rounded once to `dtype` (reference of kernels/cpu_ops.py scale_rows)."""
    y = y * scales.unsqueeze(1)
    return (y if bias is None else y + bias).to(dtype)


def quantize_weight(weight: torch.Tensor, levels: int = 127
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per output channel (row), symmetric: W ~ q * scale[:, None], |q| <= levels."""
    w = weight.float()
    peak = w.abs().amax(dim=1)
    scales = torch.where(peak > 0, peak / float(levels), torch.ones_like(peak))
    q = torch.round(w / scales.unsqueeze(1)).clamp(-levels, levels).to(torch.int8)
    return q, scales


class Int8Weight(NamedTuple):
    # The GEMM's weights (smoothed): int8 in oneDNN's layout (qlinear_prepack), or where
    # `own_gemm`, packed for Int8Linear's `gemm` (cpu_ops.I8Gemm; 7-bit without VNNI).
    packed: Any
    scales: torch.Tensor            # float32 [out_features]
    zero_points: torch.Tensor       # int64 zeros [out_features] (symmetric)
    # The gemv kernel's (decode, W8A16): the weight before SmoothQuant, int8 per row, and
    # SmoothQuant's input scale, applied to x instead. Smoothing moves activation outliers
    # into the weights, which helps W8A8 and hurts int8 weights under fine x (measured: 16
    # of 64 greedy tokens tracked HF float32 with the smoothed weights, 47 without).
    rows: torch.Tensor | None = None          # int8 [out, in], in `layout`
    row_scales: torch.Tensor | None = None    # float32 [out]
    in_scale: torch.Tensor | None = None      # float32 [in], or None
    layout: str = "rows"                      # row-major, or "panels" (cpu_ops.pack_i8_panels)
    own_gemm: bool = False


class Int8Linear(LinearMethod):
    """int8 weights per output channel on CPU, two ways:
    - decode-shaped products (at most `max_rows` rows, with the `gemv` kernel: 4, 8 with
      AVX512-VNNI but no AMX, more where only oneDNN's GEMM runs, `int8_gemv_rows`):
      W8A16, x rounded per row to 15-bit integers (2^-15 of its largest value) and
      multiplied with the int8 rows in exact integer sums (kernels/cpu_gemv.c), at the
      memory's read speed;
    - larger ones: W8A8, activations quantized per token at run time to 8 bits
      (`quantize_rows`: the C kernel, or `quantize_rows_ref`), multiplied by oneDNN's u8 x s8
      int8 GEMM (VNNI, AMX where the CPU has them) into float32; each output row is then
      scaled by its token's scale (`scale_rows`, which also adds the bias and rounds once to
      the model dtype). Where the CPU lacks VNNI and AMX-INT8 the GEMM's weights are 7-bit
      (`gemm_weight_levels`: W7A8), and `gemm` (with `gemm_pack`: kernels/cpu_gemm_i8.c, the
      same integer sums, scaled in the same order) takes oneDNN's place: 1.1-1.3x its speed
      at prefill shapes, ~2x at 32 rows. With AVX512-VNNI but no AMX-INT8 it does too, with
      8-bit weights (`gemm_levels`): 1.1x oneDNN's speed at prefill shapes, 1.3x at 32 rows.
    Same results as the float layer within int8 rounding (tests/test_int8.py). Until
    `finish_loading` it multiplies by the float weight (the SmoothQuant calibration pass runs
    then)."""
    name = "int8"

    def __init__(self, quantize_rows: Callable[[torch.Tensor],
                                               tuple[torch.Tensor, torch.Tensor]]
                 = quantize_rows_ref,
                 scale_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                       torch.dtype], torch.Tensor] = scale_rows_ref,
                 gemv: Callable[..., torch.Tensor] | None = None, max_rows: int = 0,
                 weight_levels: int | None = None,
                 pack_panels: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 gemm: Callable[..., torch.Tensor] | None = None,
                 gemm_pack: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                 gemm_levels: int = 63) -> None:
        self.quantize_rows = quantize_rows
        self.pack_panels = pack_panels
        self.scale_rows = scale_rows
        self.weight_levels = (gemm_weight_levels(cpu_flags()) if weight_levels is None
                              else weight_levels)
        # kvflow's GEMM takes weights up to gemm_levels (cpu_ops.i8_gemm_weight_levels: 7 bits
        # on AVX2, whose 16-bit pair sums 8-bit ones saturate; 8 with AVX512-VNNI).
        self.gemm, self.gemm_pack = ((gemm, gemm_pack) if self.weight_levels <= gemm_levels
                                     else (None, None))
        self.gemv = gemv
        self.max_rows = max_rows if gemv is not None else 0
        bits = 8 if self.weight_levels == 127 else 7
        self.name = (f"int8 (W8A16 <= {max_rows} rows, W{bits}A8 above)" if self.max_rows
                     else f"int8 (W{bits}A8)")

    def prepare(self, weight: torch.Tensor, input_scale: torch.Tensor | None = None
                ) -> Int8Weight:
        q, scales = quantize_weight(smoothed(weight, input_scale), self.weight_levels)
        rows = row_scales = in_scale = None
        layout = "rows"
        if self.max_rows:                        # the gemv kernel's: 8 bits, unsmoothed
            rows, row_scales = ((q, scales) if input_scale is None and self.weight_levels == 127
                                else quantize_weight(weight))
            in_scale = None if input_scale is None else input_scale.float().contiguous()
            panels = self.pack_panels(rows) if self.pack_panels is not None else None
            if panels is not None:               # same results, streamed as one run a panel
                rows, layout = panels, "panels"
        own = self.gemm_pack(q, scales) if self.gemm_pack is not None else None
        return Int8Weight(torch.ops.onednn.qlinear_prepack(q, None) if own is None else own,
                          scales, torch.zeros(q.shape[0], dtype=torch.int64), rows, row_scales,
                          in_scale, layout, own is not None)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if prepared is None:                     # before finish_loading: the float weight
            return F.linear(x, weight, bias)
        if x.numel() <= self.gemv_rows(prepared) * x.shape[-1]:
            assert self.gemv is not None
            return self.gemv(x, prepared.rows, prepared.row_scales,
                             None if bias is None else bias.float(),
                             in_scale=prepared.in_scale, layout=prepared.layout)
        shape = x.shape
        q, x_scales = self.quantize_rows(x)              # 8 bits, zero point 128
        if prepared.own_gemm:
            assert self.gemm is not None
            y = self.gemm(q, x_scales, prepared.packed, None if bias is None else bias.float(),
                          x.dtype)
            return y.view(shape[:-1] + (y.shape[-1],))
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, prepared.packed, prepared.scales,
                                               prepared.zero_points, None, 1.0, 0,
                                               torch.float32, "none", [None], "")
        y = self.scale_rows(y, x_scales, None if bias is None else bias.float(), x.dtype)
        return y.view(shape[:-1] + (y.shape[-1],))

    def gemv_rows(self, prepared: Any) -> int:
        return self.max_rows if prepared is not None and prepared.rows is not None else 0

    @classmethod
    def works(cls) -> str | None:
        """None when this torch's oneDNN int8 GEMM runs here; else why not."""
        if not (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.onednn, "qlinear_pointwise")):
            return "this torch has no oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise)"
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 64, generator=gen), torch.randn(5, 64, generator=gen)
        method = cls()
        try:
            got = method.apply(x, w, method.prepare(w))
        except RuntimeError as exc:
            return f"oneDNN's int8 linear failed: {exc}"
        ref = F.linear(x, w)
        if not torch.allclose(got, ref, rtol=0.05, atol=0.05 * float(ref.abs().max())):
            return "oneDNN's int8 linear gave wrong results on this CPU"
        return None


def prepare_weight(method: LinearMethod, weight: nn.Parameter,
                   input_scale: torch.Tensor | None, free_plain_weight: bool) -> Any:
    """What `method.apply` reads, from the loaded weight (times `input_scale` when SmoothQuant
    set one); the plain weight is freed when the method has its own copy and nothing else
    shares it."""
    data = weight.data
    prepared = method.prepare(data, input_scale)
    if prepared is not None and free_plain_weight:
        weight.data = data.new_empty(0)
    return prepared


class PreparedLinear(nn.Module):
    """A weight multiplied by its `LinearMethod`; `finish_loading` prepares it once."""
    weight: nn.Parameter
    prepared: Any = None
    # Per input feature: the weight is prepared as W * input_scale, its input having been
    # divided by the same upstream (SmoothQuant, workers/smoothing.py).
    input_scale: torch.Tensor | None = None

    def __init__(self, method: LinearMethod) -> None:
        super().__init__()
        self.method = method

    def finish_loading(self) -> None:
        self.prepared = prepare_weight(self.method, self.weight, self.input_scale,
                                       free_plain_weight=True)


class ColumnParallelLinear(PreparedLinear):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 method: LinearMethod) -> None:
        super().__init__(method)
        self.tp = tp
        self.out_per_rank = tp.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features),
                                   requires_grad=False)
        self.weight.weight_loader = self.load_shard  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.load_shard  # type: ignore[attr-defined]

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        n = self.out_per_rank
        param.data.copy_(narrow(source, 0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.prepared, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup,
                 method: LinearMethod) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp, method)

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        assert isinstance(shard_id, int), shard_id
        n = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, n).copy_(narrow(source, 0, self.tp.rank * n, n))


def heads_per_rank(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this rank. When tp_size > num_kv_heads each KV
    head is replicated on tp_size / num_kv_heads ranks."""
    heads = tp.shard(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        return heads, kv_heads, tp.rank * kv_heads
    if tp.size % num_kv_heads == 0:
        return heads, 1, tp.rank // (tp.size // num_kv_heads)
    raise ValueError(f"tensor_parallel_size={tp.size} cannot split "
                     f"num_key_value_heads={num_kv_heads}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads split across ranks (`heads_per_rank`)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup, method: LinearMethod) -> None:
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads, self.kv_head_start = heads_per_rank(
            num_heads, num_kv_heads, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out * tp.size, bias, tp, method)

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_head_start * d
        param.data.narrow(0, offset, size).copy_(narrow(source, 0, start, size))


class RowParallelLinear(PreparedLinear):
    """y = x W^T + b with W's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 method: LinearMethod) -> None:
        super().__init__(method)
        self.tp = tp
        self.in_per_rank = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank),
                                   requires_grad=False)
        self.weight.weight_loader = self.load_shard  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = load_full  # type: ignore[attr-defined]

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        n = self.in_per_rank
        param.data.copy_(narrow(source, 1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.method.apply(x, self.weight, self.prepared))
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias


def load_full(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
    """Replicated parameters (norms, biases after a reduction): every rank reads all of it."""
    tensor = full(source)
    assert param.shape == tensor.shape, (param.shape, tensor.shape)
    param.data.copy_(tensor)
