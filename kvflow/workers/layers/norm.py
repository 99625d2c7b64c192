"""RMSNorm with HF Llama's numerics: normalise in float32, cast back, then scale."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(dtype)


class RMSNorm(nn.Module):
    """`fn` is `rms_norm` or one of its twins (layers/ops.py)."""

    def __init__(self, hidden_size: int, eps: float, fn: NormFn = rms_norm) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)
