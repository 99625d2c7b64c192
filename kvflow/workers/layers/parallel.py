"""The tensor-parallel group a layer belongs to, and the few collectives the layers need."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None        # a torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dim on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total`, with a clear error when it can't split."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


def narrow(source: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Read part of a weight: a torch tensor or a safetensors slice (reads only that part)."""
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, length)
    index = [slice(None)] * len(source.get_shape())
    index[dim] = slice(start, start + length)
    return source[tuple(index)]


def full(source: Any) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]
