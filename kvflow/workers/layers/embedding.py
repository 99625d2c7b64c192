"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.workers.layers.linear import LinearMethod, prepare_weight
from kvflow.workers.layers.parallel import TPGroup, narrow


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_per_rank = -(-vocab_size // tp.size)         # the last shard may be short
        self.vocab_start = tp.rank * self.num_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, hidden_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.load_shard  # type: ignore[attr-defined]

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        n = min(self.num_per_rank, self.vocab_size - self.vocab_start)
        param.data[:n].copy_(narrow(source, 0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)   # [num_tokens, hidden]
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered on rank 0 (where sampling happens). The
    matmul is its `LinearMethod`'s (layers/linear.py); with tied embeddings the plain weight
    is the embedding's too, so it stays after `finish_loading`."""

    prepared: Any = None
    input_scale: torch.Tensor | None = None      # as PreparedLinear's (layers/linear.py)

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, method: LinearMethod,
                 tied: bool) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.method = method
        self.tied = tied

    def finish_loading(self) -> None:
        self.prepared = prepare_weight(self.method, self.weight, self.input_scale,
                                       free_plain_weight=not self.tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:   # type: ignore[override]
        """Logits of `hidden` (not an embedding lookup): a module call, so forward hooks
        (SmoothQuant's calibration) see the LM head's input like any linear's."""
        local = self.method.apply(hidden, self.weight, self.prepared)  # [tokens, vocab/rank]
        logits = self.tp.gather_last_dim(local)
        return None if logits is None else logits[:, :self.vocab_size]
