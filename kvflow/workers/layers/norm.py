"""RMSNorm with HF Llama's numerics: normalise in float32, cast back, then scale."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.elementwise_fn = rms_norm      # compiled on CUDA (layers/compile.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.elementwise_fn(x, self.weight, self.eps)
