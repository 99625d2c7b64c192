"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.workers.layers.linear import linear, onednn_packed
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
    """Logits for this rank's vocab slice, gathered on rank 0 (where sampling happens)."""

    packed: torch.Tensor | None = None

    def pack_weight(self) -> None:
        """A packed copy for the matmul (layers/linear.py); the plain weight stays, as the
        embedding may share it."""
        self.packed = onednn_packed(self.weight.data)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = linear(hidden, self.weight, self.packed)  # [num_tokens, vocab_per_rank]
        logits = self.tp.gather_last_dim(local)
        return None if logits is None else logits[:, :self.vocab_size]
