"""Llama as plain modules (also the base of Qwen2 and Qwen3, which differ in two flags).

Qwen2 adds a bias to q/k/v; Qwen3 adds an RMSNorm over each head of q and k before rotary.
Tensor parallelism lives in the layers; this file reads like the paper. The model is built with
everything it runs: the worker's op implementations (`ops`, layers/ops.py: elementwise
functions and linear method) and its KV cache (kvflow/workers/kv_cache.py); after the weights
are loaded, `finish_loading` lets each linear layer prepare its weight (e.g. oneDNN packing).
"""
from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from kvflow.workers.attention import AttentionMetadata
from kvflow.workers.kv_cache import KVCache
from kvflow.workers.layers.attention import Attention
from kvflow.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.workers.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear, heads_per_rank)
from kvflow.workers.layers.norm import RMSNorm
from kvflow.workers.layers.ops import Ops
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.layers.rotary import RotaryEmbedding
from kvflow.workers.smoothing import SmoothPair


def head_dim_of(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, tp: TPGroup, ops: Ops, qkv_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding, kv_cache: KVCache, layer_index: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads", num_heads)
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads,
                                          qkv_bias, tp, ops.linear)
        self.num_heads = self.qkv_proj.num_heads             # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden,
                                        cfg.get("attention_bias", False), tp, ops.linear)
        self.rotary = rotary                                  # one table, shared by layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, kv_cache, layer_index)
        eps = cfg["rms_norm_eps"]
        self.q_norm = RMSNorm(self.head_dim, eps, ops.rms_norm) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, ops.rms_norm) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)                          # [num_tokens, heads, head_dim]
        return self.o_proj(o.view(num_tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict, tp: TPGroup, ops: Ops) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = cfg.get("mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, tp,
                                                       ops.linear)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp, ops.linear)
        self.silu_and_mul = ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, tp: TPGroup, ops: Ops, qkv_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding, kv_cache: KVCache, layer_index: int) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps, ops.rms_norm, ops.add_rms_norm)
        self.self_attn = LlamaAttention(cfg, tp, ops, qkv_bias, qk_norm, rotary, kv_cache,
                                        layer_index)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops.rms_norm, ops.add_rms_norm)
        self.mlp = LlamaMLP(cfg, tp, ops)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous sublayer's output, residual: the running sum before it (None in
        the first layer, where h is the embedding). Each residual add is fused into the norm
        that follows it; returns (MLP output, residual stream without it)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x, residual = self.post_attention_layernorm.add_forward(
            self.self_attn(positions, x, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, tp: TPGroup, ops: Ops, qkv_bias: bool, qk_norm: bool,
                 kv_cache: KVCache) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp)
        rotary = RotaryEmbedding(cfg, head_dim_of(cfg), cfg.get("max_position_embeddings", 4096),
                                 ops.apply_rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, ops, qkv_bias, qk_norm, rotary, kv_cache, i)
            for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], ops.rms_norm,
                            ops.add_rms_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)                      # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    qkv_bias = False      # Llama and Qwen3: only when config.attention_bias says so
    qk_norm = False
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: dict, tp: TPGroup, ops: Ops, kv_cache: KVCache) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_bias = self.qkv_bias or bool(cfg.get("attention_bias", False))
        self.model = LlamaModel(cfg, tp, ops, qkv_bias, self.qk_norm, kv_cache)
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp, ops.linear,
                                      tied)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def kv_cache_spec(cfg: dict, tp: TPGroup) -> tuple[int, int, int]:
        """(layers, KV heads on this rank, head_dim): what the KV cache is sized by, known
        before the model is built."""
        num_heads = cfg["num_attention_heads"]
        _, num_kv_heads, _ = heads_per_rank(num_heads, cfg.get("num_key_value_heads", num_heads),
                                            tp)
        return cfg["num_hidden_layers"], num_kv_heads, head_dim_of(cfg)

    def smoothing_pairs(self) -> list[SmoothPair]:
        """Where SmoothQuant can fold a scale into what makes a linear's input
        (workers/smoothing.py): the norms before q/k/v, gate/up and the LM head; v's rows
        before o_proj (per KV head, shared by its query heads); up's rows before down_proj."""
        pairs = []
        for layer in cast(list[LlamaDecoderLayer], list(self.model.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, d = attn.qkv_proj, attn.head_dim
            group = attn.num_heads // attn.num_kv_heads
            heads = torch.arange(attn.num_heads * d) // d
            v_row = (heads // group) * d + torch.arange(attn.num_heads * d) % d
            v_start = (attn.num_heads + attn.num_kv_heads) * d
            n_up = mlp.gate_up_proj.out_sizes[0] // mlp.gate_up_proj.tp.size   # up after gate
            pairs += [
                SmoothPair(qkv, layer.input_layernorm.weight.data, None, 0),
                SmoothPair(attn.o_proj, qkv.weight.data, _data(qkv.bias), v_start, v_row),
                SmoothPair(mlp.gate_up_proj, layer.post_attention_layernorm.weight.data, None, 0),
                SmoothPair(mlp.down_proj, mlp.gate_up_proj.weight.data,
                           _data(mlp.gate_up_proj.bias), n_up)]
        pairs.append(SmoothPair(self.lm_head, self.model.norm.weight.data, None, 0))
        return pairs

    def finish_loading(self) -> int:
        """Each linear layer prepares its loaded weight for its method; returns how many."""
        layers = [m for m in self.modules() if hasattr(m, "finish_loading") and m is not self]
        for layer in layers:
            layer.finish_loading()      # type: ignore[operator]
        return len(layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """Our parameter name and shard id for a checkpoint tensor (None: not ours to load)."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.cfg.get("tie_word_embeddings", False):
            return None
        for ckpt, (ours, shard_id) in self.packed_modules.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{ours}."), shard_id
        return name, None


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else param.data


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
