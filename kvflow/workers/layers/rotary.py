"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen use)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def rope_inv_freq(hf_config: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies from the config: rope_theta, optional partial rotary and scaling."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    rope_type = rope_type or "default"
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rope_type == "linear":
        factor = float(params.get("factor", scaling.get("factor", 1.0)))
        inv_freq = inv_freq / factor
    elif rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported (default, linear)")
    return inv_freq


RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; `fn` is `apply_rotary` or one of its twins
    (layers/ops.py)."""

    def __init__(self, hf_config: dict, head_dim: int, max_position: int,
                 fn: RotaryFn | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(hf_config, head_dim)
        # The angles as HF rounds them (float32 products); cos/sin in float64, rounded once.
        # torch's float32 cos/sin of large angles (thousands of radians) came out up to 1e-3
        # off in some worker processes and exact in others (measured: 3 fresh engines in 9
        # differed, by 6e-3 in logprobs; none with float64 tables, in 18).
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).double()        # [max_position, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)
        self.fn = fn or apply_rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(positions, q, k, self.cos, self.sin)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)        # [num_tokens, 1, head_dim]
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
