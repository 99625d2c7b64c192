"""The MLP's activation: SiLU of the gate times the up projection (SwiGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)                             # [num_tokens, inter] each
    return F.silu(gate) * up
