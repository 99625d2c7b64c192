"""torch.compile for the small elementwise modules: RMSNorm, SiLU-and-mul, rotary. CUDA only.

Each of those modules does its math through `self.elementwise_fn`, a plain function of tensors.
On CUDA the worker swaps in one compiled copy of each function, shared by every layer (dynamic
shapes: one compilation serves every batch size), which fuses each into one or two kernels
instead of five to ten launches of tiny elementwise ops; under CUDA graphs that is less GPU
time per step. On CPU nothing is compiled: start-up stays fast and the eager ops are what the
CPU path is tuned for.
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
