"""Weights straight from safetensors into the model's (already sharded) parameters.

Each tensor is opened as a lazy slice and every parameter's `weight_loader` reads only this
rank's part of it, so no rank ever holds the full checkpoint and no HF model is built.
"""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from kvflow.workers.layers.linear import load_full
from kvflow.workers.models.llama import LlamaForCausalLM


def load_safetensors(model: LlamaForCausalLM, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r}: no *.safetensors weights in the folder")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_target(name)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    raise ValueError(f"model={path!r}: unexpected weight {name!r} in {file}")
                param = params[param_name]
                loader = getattr(param, "weight_loader", load_full)
                loader(param, f.get_slice(name), shard_id)
                loaded.add(param_name)
    missing = _missing(model, params, loaded)
    if missing:
        raise ValueError(f"model={path!r}: weights missing from the checkpoint: {missing[:5]}")


def _missing(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> list[str]:
    ids_loaded = {id(params[n]) for n in loaded}       # tied weights count once
    return [n for n, p in model.named_parameters() if id(p) not in ids_loaded]


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes (for benchmarks): N(0, 0.02), norms at 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


@torch.no_grad()
def round_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every weight matrix (linears, embeddings; not norms or biases) to `dtype`'s values
    in place, keeping the parameters' own dtype: dtype="auto" on a CPU without bfloat16
    arithmetic computes in float32 on bfloat16 weights (hardware.DtypeChoice.weights), so
    that every path, oneDNN's float32 GEMM and the bfloat16 stream of the gemv kernel alike,
    multiplies by the same values."""
    for param in model.parameters():
        if param.dim() >= 2 and param.dtype != dtype and param.is_floating_point():
            param.copy_(param.to(dtype))
