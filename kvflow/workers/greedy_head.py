"""Greedy tokens without reading the whole LM head (CPU, bfloat16 weights in the gemv
kernel's panels or pair panels): the exact argmax of the logits from an int8 copy of the LM
head plus a few exact rows.

At one request a decode step is a read of the weights, and the LM head (vocabulary x hidden)
is a fifth of them for the default model (49152 x 576: 42 MB a token in 12-bit panels, 56
in bfloat16 ones). A greedy row needs only the argmax. Here the logits are first computed
from an int8 copy (per-row scales; 28 MB, the W8A16 gemv kernel), each within a bound of its
exact value that holds for any input (Cauchy-Schwarz, with each row's quantization error
and the float32 sums' rounding: kernels/cpu_gemv.c `greedy_head`); every row whose upper
bound reaches the largest lower bound is then computed exactly as the bfloat16 panels
compute it (the same fma chain, so the same float32 value), and the first of the largest
wins, as the argmax of the full logits would. The token is the one the full LM head and the
sampler give, bit for bit (tests/test_greedy_head.py); only the bytes differ.

With bfloat16 arithmetic (the pair panels: `auto` on CPUs with AVX512-BF16 but no AMX) x
and the logits are bfloat16: the exact rows are summed as the pair panels sum them (one
vdpbf16ps lane each) and rounded to bfloat16, and a row is a candidate where its upper bound
rounds to at least what the largest lower bound rounds to, so a tie after rounding goes to
the first row, as the argmax of the bfloat16 logits gives it (`greedy_head_pairs`).

`GreedyHead.build(model, tp)` makes it where the LM head's decode products run on the
bfloat16 panels under float32 arithmetic (the `auto` dtype on CPUs without AVX512-BF16) or
on the pair panels (one rank), and for one-row steps where AMX tiles hold the LM head and
one row reads their 12-bit pair-panel copy; `takes(params, masked)` says whether a step's
rows are few enough and all plain greedy (no logprobs, penalties, logit bias, min_tokens or
grammar masks: those need every logit); the model runner then calls it instead of the LM
head and the sampler.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from kvflow.kernels import cpu_ops
from kvflow.workers.layers.linear import GemvWeight, quantize_weight
from kvflow.workers.layers.parallel import TPGroup

logger = logging.getLogger(__name__)

MAX_ROWS = 8          # a step of more rows shares the LM head's read among them: full logits
_CHUNK = 4096         # rows at a time while computing the bounds (float64 copies)


class GreedyHead:
    def __init__(self, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> None:
        """weight: the LM head's [N, K] (with one rank its rows are the vocabulary): float32
        holding bfloat16 values, as its bfloat16 panels hold them, or bfloat16 (pair panels:
        bfloat16 x and logits). max_rows: the most rows a step it takes may have (at most
        MAX_ROWS): those up to which the LM head's products are the panels' sums."""
        self.lib = cpu_ops.library()
        assert self.lib is not None, cpu_ops.build_error()
        assert 0 < max_rows <= MAX_ROWS, max_rows
        self.max_rows = max_rows
        self.weight = weight                     # the model's own tensor: no copy
        self.dtype = weight.dtype                # x's: float32, or bfloat16 (pair panels)
        exact = weight.to(torch.bfloat16).float()
        q, scales = quantize_weight(exact)
        self.scales = scales.contiguous()
        self.err, self.norm = _bounds(exact, q, self.scales)
        panels = cpu_ops.pack_i8_panels(q)
        self.q = panels if panels is not None else q.contiguous()
        self.q_type = cpu_ops.gemv_type(self.q, "panels" if panels is not None else "rows")
        self.last_candidates: list[int] = []     # rows computed exactly, per row (benchmarks)
        n = weight.shape[0]                      # scratch, kept (no allocation per step)
        self._approx = torch.empty(max_rows, n, dtype=torch.float32)
        self._cand = torch.empty(n, dtype=torch.int64)
        self._out = torch.empty(max_rows, dtype=torch.int64)
        self._counts = torch.empty(max_rows, dtype=torch.int64)
        fn = self.lib.greedy_head_pairs if self.dtype == torch.bfloat16 else self.lib.greedy_head
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 8]
        self._fn = fn

    @classmethod
    def build(cls, lm_head: Any, tp: TPGroup) -> GreedyHead | None:
        """The greedy head of this LM head, or None where its decode products are neither the
        bfloat16 panels under float32 arithmetic nor the pair panels (another kernel sums in
        another order), or its weight is gone (an untied head frees it once packed: only
        tied embeddings keep it, as the default model's). Beside AMX tiles, whose one-row
        products read 12-bit pair panels (GemvLinear), it takes steps of one row only."""
        prepared = getattr(lm_head, "prepared", None)
        if not isinstance(prepared, GemvWeight):
            return None
        # Rows whose products are the panels' or pair panels' sums: any number on those, the
        # 12-bit copy's beside AMX tiles (which sum in another order).
        rows, dtype = {"panels": (MAX_ROWS, torch.float32),
                       "pairs": (MAX_ROWS, torch.bfloat16),
                       "amx": (prepared.one_row_rows if prepared.one_row is not None else 0,
                               torch.bfloat16)}.get(prepared.layout, (0, None))
        if (tp.size != 1 or rows == 0 or lm_head.weight.dtype != dtype
                or lm_head.weight.dim() != 2 or lm_head.method.gemv_rows(prepared) < MAX_ROWS):
            return None
        head = cls(lm_head.weight.data, min(rows, MAX_ROWS))
        logger.info("greedy rows read an int8 copy of the LM head (%.0f MB) and compute "
                    "exactly only the rows that may win", head.q.numel() / 1e6)
        return head

    def takes(self, params: list[Any], masked: bool) -> bool:
        """Whether the step has at most max_rows rows, each plain greedy (nothing else needs
        the logits)."""
        return (0 < len(params) <= self.max_rows and not masked
                and all(p.greedy and p.logprobs is None and not p.processes_logits
                        for p in params))

    def __call__(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax token of each row of hidden [M, K] (the weight's dtype, M <= max_rows);
        None if a row holds an inf or a NaN (the full logits then decide, as they would)."""
        x = hidden.contiguous()
        if x.dtype != self.dtype or not 0 < x.shape[0] <= self.max_rows:  # its scratch's rows
            raise ValueError(f"greedy head: {x.shape[0]} rows of {x.dtype}, it takes 1 to "
                             f"{self.max_rows} of {self.dtype}")
        m, k = x.shape
        code = self._fn(x.data_ptr(), m, k, self.weight.shape[0], self.q.data_ptr(),
                        self.q_type, self.scales.data_ptr(), self.err.data_ptr(),
                        self.norm.data_ptr(), self.weight.data_ptr(), self._approx.data_ptr(),
                        self._cand.data_ptr(), self._out.data_ptr(), self._counts.data_ptr())
        if code == 3:
            return None
        if code == 1:
            raise MemoryError("greedy_head could not allocate its scratch memory")
        if code:
            raise RuntimeError("greedy_head: this build cannot run it (the int8 LM head copy, "
                               "or for bfloat16 pair panels AVX512-BF16)")
        self.last_candidates = self._counts[:m].tolist()
        return self._out[:m].tolist()


def _bounds(exact: torch.Tensor, q: torch.Tensor, scales: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, float32 rounded up: |W - scale q| and max(|W|, |scale q|) (2-norms, in
    float64)."""
    err = np.empty(exact.shape[0])
    norm = np.empty(exact.shape[0])
    for start in range(0, exact.shape[0], _CHUNK):
        w = exact[start:start + _CHUNK].double()
        approx = q[start:start + _CHUNK].double() * scales[start:start + _CHUNK, None].double()
        err[start:start + _CHUNK] = (w - approx).norm(dim=1).numpy()
        norm[start:start + _CHUNK] = torch.maximum(w.norm(dim=1), approx.norm(dim=1)).numpy()

    def up(values: np.ndarray) -> torch.Tensor:
        f = values.astype(np.float32)
        return torch.from_numpy(np.nextafter(f, np.float32(np.inf), dtype=np.float32)
                                * np.float32(1 + 1e-6))
    return up(err), up(norm)
