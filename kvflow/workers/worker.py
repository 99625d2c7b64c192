"""A worker: one tensor-parallel rank. Loads its weight shards, owns its KV cache, runs steps.

Start-up decides what the config left to the hardware: the device (cuda:rank when CUDA is
there), the attention backend ("auto", logged), the number of KV blocks (on CPU from
kv_cache_memory_gb or a share of free RAM; on CUDA by profiling the largest step, then
gpu_memory_utilization of the card), and on CUDA torch.compile for the small elementwise
modules and CUDA graphs for decode steps (both off with enforce_eager). On CPU the linear
weights are packed for oneDNN, and the `cpu` backend brings C kernels for attention and the
elementwise modules (`torch` keeps everything in plain torch ops).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvflow.config import EngineConfig, auto_kv_cache_gb
from kvflow.ipc.messages import StepPlan, StepResult
from kvflow.workers.attention import AttentionBackend, make_backend, resolve_backend
from kvflow.workers.layers.attention import Attention
from kvflow.workers.layers.compile import compile_elementwise, use_cpu_kernels
from kvflow.workers.layers.linear import cpu_packing_works, pack_cpu_weights
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.loader import init_dummy, load_safetensors
from kvflow.workers.model_runner import ModelRunner
from kvflow.workers.models.llama import MODELS, LlamaForCausalLM
from kvflow.workers.sampler import Sampler, torch_argmax

logger = logging.getLogger(__name__)


def resolve_device(requested: str, rank: int) -> torch.device:
    """cuda:rank or cpu; "auto" picks CUDA when it is available."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available to this process")
    if rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {rank} needs cuda:{rank}, but only "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device, self.tp.rank)
        self.dtype = getattr(torch, config.model.dtype)
        self.model = self._build_model()
        if self.device.type == "cpu" and cpu_packing_works(self.dtype):
            logger.info("rank %d: %d weights packed for oneDNN", self.tp.rank,
                        pack_cpu_weights(self.model))
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = self._make_backend()
        compiled = self.device.type == "cuda" and not config.enforce_eager
        use_graphs = compiled and self.backend.supports_cuda_graphs
        logger.info("rank %d: device %s, attention backend %s%s, %s", self.tp.rank,
                    self.device, self.backend.name,
                    " (auto)" if config.attention_backend == "auto" else "",
                    "decode CUDA graphs + torch.compile" if use_graphs
                    else "torch.compile" if compiled
                    else "C elementwise kernels" if self.backend.name == "cpu" else "eager")
        argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax
        if compiled:
            compile_elementwise(self.model)
        elif self.backend.name == "cpu":       # its C library has the elementwise ops, argmax
            use_cpu_kernels(self.model)
            from kvflow.kernels import cpu_ops
            argmax = cpu_ops.argmax
        self.runner = ModelRunner(self.model, self.backend,
                                  Sampler(config.seed, self.device, argmax,
                                          config.model.eos_token_ids), self.tp.rank == 0,
                                  self.device, self.dtype)
        self.num_blocks = self._allocate_kv_cache(self._num_blocks())
        if use_graphs:
            self._capture_cuda_graphs()

    def _build_model(self) -> LlamaForCausalLM:
        model_cfg = self.config.model
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = MODELS[model_cfg.architecture](model_cfg.hf_config, self.tp)
        finally:
            torch.set_default_dtype(default_dtype)
        if model_cfg.load_format == "dummy":
            init_dummy(model, self.config.seed + self.tp.rank)
        else:
            load_safetensors(model, model_cfg.path)
        return model.eval()

    def _make_backend(self) -> AttentionBackend:
        block_size = self.config.cache.block_size
        name = resolve_backend(self.config.attention_backend, self.device, block_size,
                               self.dtype)
        a = self.layers[0]
        return make_backend(name, block_size, a.num_kv_heads, a.head_dim, self.dtype,
                            self.device)

    # --- KV cache ------------------------------------------------------------------------

    def _bytes_per_block(self) -> int:
        a = self.layers[0]
        return (2 * len(self.layers) * self.config.cache.block_size * a.num_kv_heads
                * a.head_dim * self.dtype.itemsize)

    def _num_blocks(self) -> int:
        gb = self.config.cache.kv_cache_memory_gb
        if gb is None and self.device.type == "cuda":
            return self._profile_num_blocks()
        gb = gb or auto_kv_cache_gb()
        num_blocks = int(gb * 2**30 // self._bytes_per_block())
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={gb} holds no KV block "
                             f"({self._bytes_per_block()} bytes each)")
        return num_blocks

    def _profile_num_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the card once the weights, the CUDA
        context, other processes and the peak activations of the largest step are counted."""
        sched, util = self.config.scheduler, self.config.cache.gpu_memory_utilization
        shape = (sched.max_num_batched_tokens, sched.max_num_seqs,
                 self.config.model.max_model_len)
        self._bind_kv_cache(self.runner.profile_num_blocks(*shape))   # a temporary cache
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        self.runner.profile_run(*shape)
        torch.cuda.synchronize()
        peak_activations = torch.cuda.max_memory_allocated(self.device) - baseline
        self._unbind_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free               # weights, CUDA context, other processes
        budget = total * util - in_use - peak_activations
        num_blocks = int(budget // self._bytes_per_block())
        logger.info("rank %d: %.2f GiB of GPU memory, %.2f GiB in use, %.2f GiB peak "
                    "activations: %.2f GiB for the KV cache at gpu_memory_utilization=%.2f",
                    self.tp.rank, total / 2**30, in_use / 2**30, peak_activations / 2**30,
                    max(budget, 0) / 2**30, util)
        if num_blocks < 1:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV cache "
                             f"({in_use / 2**30:.2f} GiB in use, {peak_activations / 2**30:.2f}"
                             f" GiB peak activations, {total / 2**30:.2f} GiB in all)")
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> int:
        self._bind_kv_cache(num_blocks)
        logger.info("rank %d: %d KV blocks of %d tokens (%.2f GiB)", self.tp.rank, num_blocks,
                    self.config.cache.block_size,
                    num_blocks * self._bytes_per_block() / 2**30)
        return num_blocks

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate [K/V, layer, *backend cache shape] and bind each layer's slices."""
        shape = (2, len(self.layers)) + self.backend.cache_shape(num_blocks)
        # Zeroed: padded attention slots are masked, but 0 * NaN garbage would still be NaN.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.backend = self.backend
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _unbind_kv_cache(self) -> None:
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        del self.kv_cache

    def _capture_cuda_graphs(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.mem_get_info(self.device)[0]
        sizes = self.runner.capture_cuda_graphs(self.config.scheduler.max_num_seqs,
                                                self.config.model.max_model_len)
        used = before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("rank %d: decode CUDA graphs for batch sizes %s..%s (%d graphs) captured "
                    "in %.1f s, %.2f GiB", self.tp.rank, sizes[0], sizes[-1], len(sizes),
                    time.perf_counter() - start, used / 2**30)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)
