"""A worker: one tensor-parallel rank. Loads its weight shards, owns its KV cache, runs steps."""
from __future__ import annotations

import logging

import torch

from kvflow.config import EngineConfig
from kvflow.kernels.torch_attention import cache_shape
from kvflow.ipc.messages import StepPlan, StepResult
from kvflow.workers.layers.attention import Attention
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.loader import init_dummy, load_safetensors
from kvflow.workers.model_runner import ModelRunner
from kvflow.workers.models.llama import MODELS, LlamaForCausalLM
from kvflow.workers.sampler import Sampler

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        torch.set_num_threads(config.num_threads)
        self.device = torch.device("cpu")
        self.dtype = getattr(torch, config.model.dtype)
        self.model = self._build_model()
        self.num_blocks = self._allocate_kv_cache()
        attn = next(m for m in self.model.modules() if isinstance(m, Attention))
        self.runner = ModelRunner(self.model, config.cache.block_size, Sampler(config.seed),
                                  self.tp.rank == 0, self.device, self.dtype,
                                  (attn.num_kv_heads, attn.head_dim))

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

    def _allocate_kv_cache(self) -> int:
        """As many blocks as kv_cache_memory_gb holds; bind each layer's slice of them."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        bs = self.config.cache.block_size
        a = layers[0]
        bytes_per_block = (2 * len(layers) * bs * a.num_kv_heads * a.head_dim
                           * self.dtype.itemsize)
        num_blocks = int(self.config.cache.kv_cache_memory_gb * 2**30 // bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={self.config.cache.kv_cache_memory_gb} holds "
                             f"no KV block ({bytes_per_block} bytes each)")
        shape = (2, len(layers)) + cache_shape(num_blocks, bs, a.num_kv_heads, a.head_dim)
        # Zeroed: padded attention slots are masked, but 0 * NaN garbage would still be NaN.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("rank %d: %d KV blocks of %d tokens (%.2f GiB)", self.tp.rank, num_blocks,
                    bs, num_blocks * bytes_per_block / 2**30)
        return num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)
