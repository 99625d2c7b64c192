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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a norm, fused: (rms_norm(residual + x), residual + x), the sum
    rounded to the dtype first, as HF's `hidden = residual + hidden` does."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


AddNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                     tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """`fn` is `rms_norm` or one of its twins, `add_fn` `add_rms_norm` or one of its twins
    (layers/ops.py). Called with a residual, it adds it first and returns the sum too."""

    def __init__(self, hidden_size: int, eps: float, fn: NormFn = rms_norm,
                 add_fn: AddNormFn = add_rms_norm) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fn = fn
        self.add_fn = add_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        return self.add_fn(x, residual, self.weight, self.eps)
