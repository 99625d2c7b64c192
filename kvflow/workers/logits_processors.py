"""What changes a request's logits before temperature and the masks, in vLLM's order:
min_tokens (EOS and stop token ids to -inf) and logit_bias, then the repetition (HF's, over
prompt + output), frequency and presence (OpenAI's, over the output) penalties.

Everything is per row, so a row's result never depends on the rest of the batch, and only the
rows whose params ask for it are touched. Penalties touch only the (row, token) pairs a row has
seen (torch.unique over row * vocab + id keys), never a Python loop or a [rows, vocab] count.
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, Sequence

import numpy as np
import torch

from kvflow.sampling_params import SamplingParams


# (logits, rows, their token histories, their output counts, repetition, frequency and
# presence penalties a row) -> None, in place: apply_penalties' rules (cpu_ops.penalize).
Penalize = Callable[[torch.Tensor, Sequence[int], Sequence[Sequence[int]], Sequence[int],
                     Sequence[float], Sequence[float], Sequence[float]], None]


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams],
                            token_ids: Sequence[list[int]], output_positions: list[int],
                            eos_token_ids: Sequence[int],
                            penalize: Penalize | None = None) -> torch.Tensor:
    """logits: [batch, vocab] float32, changed in place and returned. token_ids[i]: row i's
    prompt + output so far, of which the last output_positions[i] are outputs. `penalize`:
    the penalties in one call (the C one on CPU), else apply_penalties' torch ops."""
    _mask_and_bias(logits, params, output_positions, eos_token_ids)
    rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    if rows and penalize is not None:
        penalize(logits, rows, [token_ids[i] for i in rows], [output_positions[i] for i in rows],
                 [params[i].repetition_penalty for i in rows],
                 [params[i].frequency_penalty for i in rows],
                 [params[i].presence_penalty for i in rows])
    elif rows:
        index = torch.tensor(rows, device=logits.device)
        picked = logits.index_select(0, index)                      # [rows, vocab]
        apply_penalties(picked, [params[i] for i in rows], [token_ids[i] for i in rows],
                        [output_positions[i] for i in rows])
        logits.index_copy_(0, index, picked)
    return logits


def _has_penalty(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0)


def _mask_and_bias(logits: torch.Tensor, params: list[SamplingParams],
                   output_positions: list[int], eos_token_ids: Sequence[int]) -> None:
    """One accumulating index_put_ for both: adding -inf masks (a bias cannot undo it)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if output_positions[i] < p.min_tokens:
            # Out-of-vocabulary stop ids can never be sampled: nothing to mask.
            banned = {t for t in chain(eos_token_ids, p.stop_token_ids or ()) if 0 <= t < vocab}
            rows += [i] * len(banned)
            ids += banned
            values += [float("-inf")] * len(banned)
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device),
                          accumulate=True)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    token_ids: Sequence[list[int]], output_positions: list[int]) -> None:
    """logits: [rows, vocab] float32, in place; vLLM's penalties, touching only the (row,
    token) pairs a row has seen: O(tokens), not O(rows x vocab)."""
    keys, is_output = token_keys(token_ids, output_positions, logits.shape[-1], logits.device)
    flat = logits.view(-1)                                                 # [rows * vocab]
    vocab = logits.shape[-1]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.unique(keys)                                          # prompt + output
        penalty = _per_row([p.repetition_penalty for p in params], logits)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out_keys, counts = torch.unique(keys[is_output], return_counts=True)
        row = out_keys // vocab
        frequency = _per_row([p.frequency_penalty for p in params], logits)[row]
        presence = _per_row([p.presence_penalty for p in params], logits)[row]
        flat.index_add_(0, out_keys, -(frequency * counts + presence))


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)     # [rows]


def token_keys(token_ids: Sequence[list[int]], output_positions: list[int], vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of every row as row * vocab + id (for a bincount into [rows, vocab]), and
    whether it is an output token: the last output_positions[i] of token_ids[i] are."""
    lengths = torch.tensor([len(t) for t in token_ids])                        # [rows]
    total = int(lengths.sum())
    flat = torch.from_numpy(np.fromiter(chain.from_iterable(token_ids), np.int64, total))
    row = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)        # [total]
    # Distance of each token from the end of its row: the last n of a row are its outputs.
    from_end = lengths.cumsum(0)[row] - torch.arange(total) - 1               # [total]
    is_output = from_end < torch.tensor(output_positions)[row]                 # [total]
    return (row * vocab + flat).to(device), is_output.to(device)
