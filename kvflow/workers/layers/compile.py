"""Faster twins for the small elementwise modules: RMSNorm, SiLU-and-mul, rotary.

Each of those modules does its math through `self.elementwise_fn`, a plain function of tensors.
On CUDA the worker swaps in one compiled copy of each function, shared by every layer (dynamic
shapes: one compilation serves every batch size), which fuses each into one or two kernels
instead of five to ten launches of tiny elementwise ops; under CUDA graphs that is less GPU
time per step. On CPU (bfloat16, float32) the twins are kvflow's C kernels
(kvflow/kernels/cpu_ops.c, built once in a second): one call each instead of five to ten small
torch ops, which is most of the cost of these ops on CPU.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def compile_elementwise(model: nn.Module) -> int:
    """Replace every module's `elementwise_fn` by its compiled twin; returns how many distinct
    functions were compiled."""
    compiled: dict[Callable, Callable] = {}
    for module in model.modules():
        fn = getattr(module, "elementwise_fn", None)
        if fn is None:
            continue
        if fn not in compiled:
            compiled[fn] = torch.compile(fn, dynamic=True)
        setattr(module, "elementwise_fn", compiled[fn])
    return len(compiled)


def use_cpu_kernels(model: nn.Module) -> int:
    """Replace every module's `elementwise_fn` by its C twin; returns how many were replaced."""
    from kvflow.kernels import cpu_ops
    from kvflow.workers.layers.activation import silu_and_mul
    from kvflow.workers.layers.norm import rms_norm
    from kvflow.workers.layers.rotary import apply_rotary
    twins: dict[Callable, Callable] = {rms_norm: cpu_ops.rms_norm,
                                       silu_and_mul: cpu_ops.silu_and_mul,
                                       apply_rotary: cpu_ops.apply_rotary}
    replaced = 0
    for module in model.modules():
        twin = twins.get(getattr(module, "elementwise_fn", None))  # type: ignore[arg-type]
        if twin is not None:
            setattr(module, "elementwise_fn", twin)
            replaced += 1
    return replaced
