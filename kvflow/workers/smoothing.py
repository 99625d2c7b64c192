"""SmoothQuant for the int8 (W8A8) linears: move the activations' outlier channels into the
weights before quantizing them.

A few input channels of some linears carry values 20-150x the median channel (measured on the
default model: the residual stream's "massive activation" channels, scaled by the RMSNorm
weights, and the last layers' MLP), so one int8 scale per token spends its range on them.
SmoothQuant (Xiao et al., 2023) divides input channel j by s_j = max|X_j|^a / max|W_j|^(1-a)
(a = 0.5) and multiplies the weight's column j by s_j: the product is unchanged, both sides
quantize better. The division is folded into whatever produced the input, so nothing is added
at run time:
- the RMSNorm before q/k/v, before gate/up and before the LM head: its weight / s;
- v_proj's rows for o_proj's input (one s per KV head and dim, shared by the query heads of a
  group, since they read the same V);
- up_proj's rows for down_proj's input (silu(gate) * up is linear in up).
max|X_j| comes from one float forward pass over a short built-in text when the model loads
(CALIBRATION_TEXT, tokenized with the model's tokenizer.json; random token ids without one).
On the default model it cuts int8's mean |logprob error| against float32 by a third (0.112 ->
0.074, teacher-forced top-1 agreement 0.900 -> 0.933; benchmarks/int8_quality.py).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import torch
from torch import nn

from kvflow.workers.attention import AttentionBackend, SeqSpan
from kvflow.workers.kv_cache import KVCache

ALPHA = 0.5
CALIBRATION_TEXT = (
    "The old lighthouse keeper climbed the stairs every evening at dusk. From the top he could "
    "see the harbour, the fishing boats coming home and, on clear days, the hills beyond the "
    "bay. Q: What is the boiling point of water at sea level? A: 100 degrees Celsius, or 212 "
    "degrees Fahrenheit.\n\ndef mean(values):\n    \"\"\"Return the arithmetic mean.\"\"\"\n"
    "    return sum(values) / len(values)\n\nprint(mean([3, 5, 8]))  # 5.333\n\n"
    "User: Can you summarise the causes of the French Revolution in two sentences?\n"
    "Assistant: Financial crisis, food shortages and resentment of aristocratic privilege "
    "combined with Enlightenment ideas about rights. When the Estates-General met in 1789, "
    "the Third Estate declared itself a National Assembly.\n1, 2, 3, 5, 8, 13, 21, 34, 55. "
    "Les enfants jouent dans le parc pendant que leurs parents discutent.")


class Smoothable(Protocol):
    """A linear that prepares its weight as W * input_scale (layers/linear.py)."""
    weight: nn.Parameter                     # [out, C]
    input_scale: torch.Tensor | None


class SmoothPair(NamedTuple):
    """A linear whose input the producer's rows [start, start + n) make: channel c of the
    input is producer row start + source[c] (source None: row start + c)."""
    consumer: Smoothable
    producer: torch.Tensor                   # a norm's weight [C] or a linear's [rows, in]
    producer_bias: torch.Tensor | None
    start: int
    source: torch.Tensor | None = None       # int64 [C]


def calibration_ids(model_path: str, vocab_size: int) -> list[int]:
    path = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(path).encode(CALIBRATION_TEXT).ids
    return torch.randint(0, vocab_size, (256,), generator=torch.Generator().manual_seed(0)
                         ).tolist()


@torch.inference_mode()
def prefill_logits(model: nn.Module, kv_cache: KVCache, token_ids: list[int]) -> torch.Tensor:
    """The logits at every position of one sequence, from one prefill on a temporary KV cache
    just big enough (freed after)."""
    backend: AttentionBackend = kv_cache.backend
    n, block_size = len(token_ids), backend.block_size
    blocks = np.arange(-(-n // block_size))
    positions = np.arange(n)
    kv_cache.allocate(len(blocks))
    try:
        meta = backend.build_metadata(blocks[positions // block_size] * block_size
                                      + positions % block_size, [],
                                      [SeqSpan(0, n, n, blocks)])
        device = backend.device
        hidden = model(torch.tensor(token_ids, device=device),
                       torch.tensor(positions, device=device), meta)
        return cast(Any, model).compute_logits(hidden)
    finally:
        kv_cache.allocate(0)


def input_absmax(model: nn.Module, kv_cache: KVCache, consumers: list[Smoothable],
                 token_ids: list[int]) -> dict[Smoothable, torch.Tensor]:
    """max |input| per channel of each consumer over one float prefill of `token_ids`."""
    found: dict[Smoothable, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple, _out: object) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        found[cast(Smoothable, module)] = x.abs().amax(dim=0)

    hooks = [cast(nn.Module, m).register_forward_hook(record) for m in consumers]
    try:
        prefill_logits(model, kv_cache, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return found


@torch.no_grad()
def smooth(pairs: list[SmoothPair], absmax: dict[Smoothable, torch.Tensor],
           alpha: float = ALPHA) -> None:
    """Fold each pair's s into its producer and set the consumer's input_scale to s."""
    for pair in pairs:
        act = absmax[pair.consumer].clamp(min=1e-5)
        weight = pair.consumer.weight.data.float().abs().amax(dim=0).clamp(min=1e-5)
        if pair.source is not None:          # one s per producer row, shared by its channels
            rows = int(pair.source.max()) + 1
            act = torch.zeros(rows).scatter_reduce(0, pair.source, act, "amax")
            weight = torch.zeros(rows).scatter_reduce(0, pair.source, weight, "amax")
        # Clamped: a channel quiet in calibration must not get a huge 1/s upstream. (Rounding s
        # to a power of two would make the fold exact in bfloat16, but measured worse:
        # mean |dlogprob| 0.0866 vs 0.0802 with bf16 activations, 0.0792 vs 0.0740 float32.)
        s_rows = (act ** alpha / weight ** (1 - alpha)).clamp(1e-2, 1e2)
        n = s_rows.shape[0]
        for target in (pair.producer, pair.producer_bias):
            if target is None:
                continue
            part = target.narrow(0, pair.start, n)
            div = s_rows if part.dim() == 1 else s_rows.unsqueeze(1)
            part.copy_((part.float() / div).to(part.dtype))
        pair.consumer.input_scale = s_rows if pair.source is None else s_rows[pair.source]
