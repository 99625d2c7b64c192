"""Sampling on rank 0: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Requests with min_tokens, logit_bias or penalties first get their logits processed
(logits_processors.py, on a float32 copy); greedy rows then take the argmax of those; a batch
without them skips this entirely. Masks follow HF's warper order (temperature, top-k, top-p,
min-p). A token is drawn by inverse CDF: one uniform U per row, the first token whose
cumulative probability exceeds U (an exact draw from `probs`); a seeded request draws its U
from a generator seeded by (seed, output position), so its tokens do not depend on what else
is in the batch, nor on preemption. Everything runs
on the logits' device (on CUDA: CUDA generators, so seeded draws differ from the CPU's, but are
as reproducible). On CPU with the C kernels the masks and the draw are one call
(`cpu_ops.sample`, kernels/cpu_ops.c): the same rules from the same uniforms, by thresholds
instead of sorts, 5-20x faster than these torch ops there (tests/test_sampler.py checks it
picks the torch path's tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvflow.sampling_params import SamplingParams
from kvflow.workers.logits_processors import Penalize, apply_logits_processors


@dataclass(frozen=True)
class SamplingBatch:
    params: list[SamplingParams]
    output_positions: list[int]        # index of the token being sampled in each output
    # Each row's prompt + output token ids so far (the runner's own lists, not copies), of
    # which the last output_positions[i] are outputs; read only for params.processes_logits.
    token_ids: Sequence[list[int]] = ()
    # Structured outputs: these rows may only sample the tokens their grammars allow; the
    # others get -inf from `mask_bias` ([len(masked_rows), vocab] float32 of 0 and -inf,
    # from the grammars' bitmasks, kvflow/core/grammar.py).
    masked_rows: Sequence[int] = ()
    mask_bias: torch.Tensor | None = None


# Top-p rows without top-k first look only at their TOP_P_WINDOW largest logits (a partial
# sort); a row whose nucleus does not close inside them is done again over the whole vocabulary.
TOP_P_WINDOW = 1024
# Rows are masked and drawn a chunk at a time, so that the float64 [rows, vocab] work tensors
# of a large batch are not all alive at once (a GPU's profile step, 256 rows of a 151936-token
# vocabulary, peaked 0.7 GiB higher without it, taken from the KV cache). Rows are
# independent: the chunks give the same values as one pass.
CHUNK_ELEMENTS = 1 << 23


def _chunk_rows(vocab: int) -> int:
    """Rows a chunk: CHUNK_ELEMENTS logits, at least one row."""
    return max(1, CHUNK_ELEMENTS // vocab)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude; the survivors keep their
    values. logits: [batch, vocab] float32; top_k [batch] (<= 0: off), top_p [batch] (1: off),
    min_p [batch] (0: off).

    Only candidates are sorted: top-k's k largest logits, and for top-p without top-k the
    TOP_P_WINDOW largest, whose probabilities (over the whole row's sum) nearly always reach
    top_p; a row where they do not is done again over the whole vocabulary. min-p keeps a
    token whose probability is at least min_p times the top one's, i.e. whose logit is at
    least the top logit + log(min_p): no sort. (A full sort of the default model's 49152
    logits took ~9 ms a row on a 2-core CPU, more than half a decode step.)"""
    out = logits
    rows = ((top_p < 1) | (top_k > 0)).nonzero().flatten()
    if rows.numel():
        vocab = logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        limited = top_k[rows] > 0
        width = max(int(k[rows][limited].max()) if bool(limited.any()) else 0,
                    0 if bool(limited.all()) else TOP_P_WINDOW)
        out = logits.clone()
        step = _chunk_rows(vocab)
        for chunk in (rows[i:i + step] for i in range(0, rows.numel(), step)):
            short = _top_k_top_p(out, logits, chunk, top_k, k, top_p, min(width, vocab))
            if short.numel():                        # nucleus wider than the window: again
                _top_k_top_p(out, logits, short, top_k, k, top_p, vocab)
    if bool((min_p > 0).any()):      # min-p last: the top logit is the same before and after
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(1)
        out = out.masked_fill(logits < floor, float("-inf"))
    return out


def _top_k_top_p(out: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
                 top_k: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, width: int
                 ) -> torch.Tensor:
    """out[rows] = logits[rows] but -inf where top-k and top-p drop a token, looking at each
    row's `width` largest logits; returns the rows whose nucleus may reach past them (top-p
    without top-k, where those logits' probabilities sum below top_p)."""
    row_logits, top_k, k, top_p = logits[rows], top_k[rows], k[rows], top_p[rows]
    values, ids = row_logits.topk(width, dim=-1)                  # sorted, descending
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
    values = values.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))     # top-k
    # Probabilities (float64) over what top-k kept, or over the whole row without top-k.
    total = torch.where(top_k > 0, values.double().logsumexp(dim=-1),
                        row_logits.double().logsumexp(dim=-1))
    probs = (values.double() - total.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    # Drop a token when the tokens above it already reach top_p (the top one always stays).
    drop = ((cum - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    out[rows] = torch.full_like(row_logits, float("-inf")).scatter(
        -1, ids, values.masked_fill(drop, float("-inf")))
    short = (top_p < 1) & (top_k <= 0) & (cum[:, -1] < top_p) & (width < logits.shape[-1])
    return rows[short]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


# (logits [rows, vocab] float32, temperature, top_k, top_p, min_p (a value a row), u [rows]
# float64) -> ids: the masks and the draw of `Sampler._draw` in one call (cpu_ops.sample).
Draw = Callable[[torch.Tensor, Sequence[float], Sequence[int], Sequence[float],
                 Sequence[float], torch.Tensor], torch.Tensor]
# (logits [rows, vocab] float32, top n a row, the chosen id a row) -> (the chosen ids' logprobs,
# each row's top n (id, logprob), largest first): `Sampler._logprobs` (cpu_ops.logprobs).
TopLogprobs = Callable[[torch.Tensor, Sequence[int], Sequence[int]],
                       tuple[list[float], list[list[tuple[int, float]]]]]


class Sampler:
    def __init__(self, seed: int, device: torch.device = torch.device("cpu"),
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
                 eos_token_ids: Sequence[int] = (), draw: Draw | None = None,
                 penalize: Penalize | None = None,
                 top_logprobs: TopLogprobs | None = None) -> None:
        self.generator = torch.Generator(device).manual_seed(seed)
        self.argmax = argmax        # row argmax, first index of the max (the C one on CPU)
        self.eos_token_ids = tuple(eos_token_ids)      # masked while below min_tokens
        self.draw = draw            # masks + draw in one call (the C one on CPU), else torch
        self.penalize = penalize    # the penalties in one call (the C one on CPU), else torch
        self.top_logprobs = top_logprobs      # logprobs in one call (the C one on CPU)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[list[int], list[dict[int, float]] | None]:
        """logits: [batch, vocab], any float dtype -> sampled ids and (if any asked) logprob
        dicts. Greedy rows take the argmax of the logits as they are (a bf16 -> float32 cast
        is exact, so it cannot change it); draws and logprobs are computed in float32.
        Logprobs always come from the raw logits, processed or not."""
        params = batch.params
        scores = logits
        if any(p.processes_logits for p in params):
            scores = self._process(logits, batch)                   # float32 copy
        if batch.mask_bias is not None:
            scores = self._constrain(logits, scores, batch)         # float32 copy
        greedy = [p.greedy for p in params]
        if all(greedy):
            ids = self.argmax(scores).tolist()
        else:
            drawn = self._draw(scores.float(), batch).tolist()
            best = self.argmax(scores).tolist() if any(greedy) else drawn
            ids = [b if g else d for g, b, d in zip(greedy, best, drawn)]
        return ids, self._logprobs(logits, params, ids)

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A processed float32 copy of logits ([batch, vocab]); rows without settings keep
        their values exactly (a cast), so they sample as they would alone."""
        assert len(batch.token_ids) == len(batch.params), "processing needs the token ids"
        return apply_logits_processors(logits.to(torch.float32, copy=True), batch.params,
                                       batch.token_ids, batch.output_positions,
                                       self.eos_token_ids, self.penalize)

    @staticmethod
    def _constrain(logits: torch.Tensor, scores: torch.Tensor, batch: SamplingBatch
                   ) -> torch.Tensor:
        """Grammar masks: the constrained rows' forbidden tokens to -inf, after min_tokens,
        logit_bias and penalties (the other rows keep their values exactly). Should those
        have excluded every token the grammar allows (min_tokens while only EOS may come),
        the grammar wins: the row keeps its raw logits on the allowed tokens."""
        processed = scores is not logits
        if not processed:
            scores = logits.to(torch.float32, copy=True)
        bias = batch.mask_bias
        assert bias is not None
        rows = torch.tensor(list(batch.masked_rows), device=scores.device)
        scores.index_add_(0, rows, bias)
        if processed:
            dead = torch.isneginf(scores.index_select(0, rows)).all(dim=1)
            if bool(dead.any()):
                raw = logits.index_select(0, rows).float() + bias
                scores.index_copy_(0, rows[dead], raw[dead])
        return scores

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        device = logits.device
        # One uniform per row: the batch generator's, or a seeded request's own.
        u = torch.rand(len(params), generator=self.generator, device=device,
                       dtype=torch.float64)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device).manual_seed(
                    _mix(p.seed, batch.output_positions[i]))
                u[i] = torch.rand(1, generator=gen, device=device, dtype=torch.float64)[0]
        columns = ([p.temperature or 1.0 for p in params],
                   [min(p.top_k, logits.shape[-1]) for p in params],
                   [p.top_p for p in params], [p.min_p for p in params])
        if self.draw is not None:
            return self.draw(logits, *columns, u)
        temperature, top_k, top_p, min_p = (torch.tensor(c, device=device) for c in columns)
        logits = logits / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        # Inverse-CDF draw: one uniform per row against the running sum of its probabilities
        # (the first token whose cumulative probability exceeds it). One random number a row
        # instead of one per vocabulary entry: 32 rows x 49k vocab drew exponential noise in
        # 30 ms on CPU, this takes ~2 ms.
        # float64 sums: float32 could not tell tail probabilities below ~3e-8 apart.
        ids = torch.empty(len(params), dtype=torch.int64, device=device)
        vocab = logits.shape[-1]
        step = _chunk_rows(vocab)
        for i in range(0, len(params), step):
            cdf = logits[i:i + step].softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
            ur = (u[i:i + step] * cdf[:, -1]).unsqueeze(1)  # the sum is 1 within rounding
            ids[i:i + step] = torch.searchsorted(cdf, ur, right=True).squeeze(1)
        return ids.clamp_(max=vocab - 1)

    def _logprobs(self, logits: torch.Tensor, params: list[SamplingParams],
                  ids: list[int]) -> list[dict[int, float]] | None:
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return None
        if self.top_logprobs is not None:                                 # raw, unmasked
            chosen, tops = self.top_logprobs(logits.float(), [k or 0 for k in wanted], ids)
            return [{**dict(top), ids[i]: chosen[i]} for i, top in enumerate(tops)]
        logprobs = logits.float().log_softmax(dim=-1)                      # raw, unmasked
        top_values, top_ids = logprobs.topk(max(k or 0 for k in wanted) or 1, dim=-1)
        out = []
        for i, k in enumerate(wanted):
            entry = {} if k is None else dict(zip(top_ids[i, :k].tolist(),
                                                  top_values[i, :k].tolist()))
            entry[ids[i]] = float(logprobs[i, ids[i]])
            out.append(entry)
        return out


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position), different for every pair."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & (2**63 - 1)
