"""A worker: one tensor-parallel rank. Loads its weight shards, owns its KV cache, runs steps.

Start-up decides what the config left to the hardware, before the model is built: the device
(cuda:rank when CUDA is there), the attention backend ("auto", logged) and the op set
(layers/ops.py: torch.compile'd elementwise ops on CUDA, kvflow's C kernels on CPU with the
`cpu` backend, else plain torch; oneDNN-packed linear weights on CPU); the model is then built
with them and with the KV cache (kvflow/workers/kv_cache.py). Then the number of KV blocks (on
CPU from kv_cache_memory_gb or a share of free RAM; on CUDA by profiling the largest step, then
gpu_memory_utilization of the card) and on CUDA graphs for decode steps (off with
enforce_eager).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Callable

import torch

from kvflow.config import EngineConfig, ModelConfig, auto_kv_cache_gb, available_memory_bytes
from kvflow.ipc.messages import StepPlan, StepResult
from kvflow.workers import cpu_threads, huge_pages
from kvflow.workers.attention import (AttentionBackend, cpu_kernels_usable, make_backend,
                                      resolve_backend)
from kvflow.workers.draft_model import DraftModel, Drafter, DraftReceiver
from kvflow.workers.fused_decode import FusedDecode
from kvflow.workers.greedy_head import GreedyHead
from kvflow.workers.hardware import DTYPE_NAMES, resolve_dtype
from kvflow.workers.kv_cache import KVCache
from kvflow.workers.layers.linear import GemvLinear, OneDnnLinear
from kvflow.workers.layers.ops import (FUSED_MAX_TOKENS, FUSED_MAX_TOKENS_WIDE, Ops, choose_ops,
                                     keep_copy)
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.loader import init_dummy, load_safetensors, round_weights
from kvflow.workers.model_runner import ModelRunner
from kvflow.workers.models.llama import MODELS, LlamaForCausalLM
from kvflow.workers.sampler import Sampler
from kvflow.workers.smoothing import calibration_ids, input_absmax, smooth

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
    """Start-up in named phases, each a method below: place (device, dtype, threads), choose
    implementations (attention backend and KV cache owner, ops), build and load the model with
    them, make the runner, size and allocate the KV cache, capture CUDA graphs."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None,
                 own_process: bool = False) -> None:
        """own_process: the worker's own process (worker_proc), which it may bind to CPUs."""
        self.config = config
        self.tp = tp or TPGroup()
        self.own_process = own_process
        self.device, self.dtype, self.storage_dtype = self._place()
        self.kv_cache, self.ops = self._choose_implementations()
        self.model = self._build_model(self.config.model, self.tp, self.kv_cache)
        self.drafter = self._build_drafter()
        auto = self.config.scheduler.async_scheduling
        self.async_scheduling = True if auto is None else auto   # config ruled out TP, spec
        self.runner = self._make_runner()
        self.num_blocks = self._allocate_kv_cache()
        self.use_cuda_graphs = self.ops.name == "compiled" and self.backend.supports_cuda_graphs
        self._fuse_decode_steps()
        self._log_choices()
        if self.use_cuda_graphs:
            self._capture_cuda_graphs()

    @property
    def backend(self) -> AttentionBackend:
        return self.kv_cache.backend

    @property
    def weight_dtype(self) -> torch.dtype:
        """The float weights' values: the storage dtype's (int8 quantizes them as loaded)."""
        return self.dtype if self.config.quantization is not None else self.storage_dtype

    def _place(self) -> tuple[torch.device, torch.dtype, torch.dtype]:
        """The device, the compute dtype and the dtype weights and KV cache are stored in
        (hardware.DtypeChoice: bfloat16 under float32 for dtype="auto" on a CPU without
        bfloat16 arithmetic)."""
        parallel = self.config.parallel
        device = resolve_device(self.config.device, parallel.local_rank(self.tp.rank))
        threads = self.config.num_threads
        if threads is None:
            share = cpu_threads.plan(parallel.ranks_per_node, parallel.local_rank(self.tp.rank))
            threads = share.threads
            if self.own_process and device.type == "cpu":
                cpu_threads.bind(share.cpus)
                logger.info("rank %d: %s", self.tp.rank, share.reason)
        torch.set_num_threads(threads)
        choice = resolve_dtype(self.config.model.dtype, device, self.config.model.hf_config)
        if self.tp.rank == 0:
            log = logger.warning if choice.slow else logger.info
            log("dtype %s (%s)", DTYPE_NAMES[choice.dtype], choice.reason)
        return device, choice.dtype, choice.weights or choice.dtype

    def _choose_implementations(self) -> tuple[KVCache, Ops]:
        cfg, block_size = self.config, self.config.cache.block_size
        name = resolve_backend(cfg.attention_backend, self.device, block_size, self.dtype)
        model_class = MODELS[cfg.model.architecture]
        num_layers, num_kv_heads, head_dim = model_class.kv_cache_spec(cfg.model.hf_config,
                                                                       self.tp)
        backend = make_backend(name, block_size, num_kv_heads, head_dim, self.dtype,
                               self.device, self._kv_dtype(name))
        ops = choose_ops(self.device, name, self.dtype, cfg.enforce_eager, cfg.quantization,
                         self.weight_dtype)
        return KVCache(backend, num_layers), ops

    def _kv_dtype(self, backend: str) -> torch.dtype:
        """The KV cache's dtype: the arithmetic's, or bfloat16 under float32 (the cpu
        backend's kernels round K/V when storing and widen them when reading): with
        kv_cache_dtype="auto" where the weights are stored in bfloat16 (dtype="auto" on a
        CPU without bfloat16 arithmetic, hardware.py), or with kv_cache_dtype="bfloat16"; int8
        (kv_cache_dtype="int8") on the cpu backend, under either arithmetic."""
        requested = self.config.cache.kv_cache_dtype
        if requested == "int8":                  # rows quantized by the cpu backend's store
            if backend != "cpu":
                why = cpu_kernels_usable(self.dtype) if self.device.type == "cpu" else None
                raise ValueError(f"kv_cache_dtype='int8' needs the cpu attention backend "
                                 f"(kvflow's C kernels on CPU); here: the {backend!r} backend"
                                 + (f" ({why})" if why else ""))
            return torch.int8
        wanted = self.storage_dtype if requested == "auto" else getattr(torch, requested)
        if wanted == self.dtype or (wanted == torch.bfloat16 and self.dtype == torch.float32
                                    and backend == "cpu"):
            return wanted
        if requested == "auto":
            return self.dtype
        raise ValueError(f"kv_cache_dtype={requested!r} under dtype "
                         f"{DTYPE_NAMES[self.dtype]} needs float32 arithmetic and the cpu "
                         f"attention backend (here: the {backend!r} backend)")

    def _build_model(self, model_cfg: ModelConfig, tp: TPGroup, kv_cache: KVCache
                     ) -> LlamaForCausalLM:
        """The target model, or the draft model (speculative decoding), built and loaded."""
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = MODELS[model_cfg.architecture](model_cfg.hf_config, tp, self.ops,
                                                       kv_cache)
        finally:
            torch.set_default_dtype(default_dtype)
        if model_cfg.load_format == "dummy":
            init_dummy(model, self.config.seed + tp.rank)
        else:
            load_safetensors(model, model_cfg.path)
        round_weights(model, self.weight_dtype)
        if self.config.quantization == "int8":      # SmoothQuant before quantizing
            pairs = model.smoothing_pairs()
            ids = calibration_ids(model_cfg.path, model_cfg.vocab_size)
            smooth(pairs, input_absmax(model, kv_cache, [p.consumer for p in pairs], ids))
        self._decide_copies(model)
        model.finish_loading()
        if self.device.type == "cpu":
            huge_pages.move_decode_weights(model)
        return model.eval()

    def _decide_copies(self, model: LlamaForCausalLM) -> None:
        """Which copies of the weights that only speed a path up are kept (layers/ops.py
        keep_copy), decided once, for the target model (a draft model follows it), before
        its weights are prepared: oneDNN's copy of the weights held in panels, for prompts
        (cpu_prefill_copy), and the 12-bit copy the decode steps of one to a few requests
        read (cpu_one_row_copy). "auto" weighs this rank's weights (all the method holds: an
        upper bound) against its share of the node's available RAM; the ranks agree (all keep
        a copy, or none)."""
        linear = self.ops.linear
        if (not isinstance(linear, GemvLinear)
                or linear.gemm_copy is not None and linear.one_row_copy is not None):
            return
        weights = {id(m.weight): m.weight.numel() for m in model.modules()
                   if getattr(m, "method", None) is linear and isinstance(m.weight, torch.Tensor)}
        params = sum(weights.values())
        share = available_memory_bytes() // self.config.parallel.ranks_per_node
        # nothing paneled, or no oneDNN to copy for: no copy to keep
        prefill = linear.holds_panels and isinstance(linear.inner, OneDnnLinear)
        keep = [prefill and keep_copy(self.config.cpu_prefill_copy,
                                      params * self.dtype.itemsize, share),
                linear.makes_one_row_copies and keep_copy(self.config.cpu_one_row_copy,
                                                          params * 3 // 2, share)]
        if self.tp.size > 1:
            votes = self.tp.all_reduce(torch.tensor([float(k) for k in keep]))
            keep = [int(v) == self.tp.size for v in votes.tolist()]
        linear.gemm_copy, linear.one_row_copy = keep
        if self.tp.rank != 0:
            return
        if prefill:
            logger.info("cpu_prefill_copy=%s: oneDNN's copy of the paneled weights for prompts "
                        "%s (%.2f GB a rank; %.1f GB of RAM available a rank)",
                        self.config.cpu_prefill_copy,
                        "kept" if keep[0] else "not kept: the panels take every product",
                        params * self.dtype.itemsize / 1e9, share / 1e9)
        if linear.makes_one_row_copies:
            logger.info("cpu_one_row_copy=%s: the 12-bit copy of the weights for the decode "
                        "steps of one to a few requests %s (about %.2f GB a rank; %.1f GB of "
                        "RAM available a rank)", self.config.cpu_one_row_copy,
                        "made" if keep[1] else "not made", params * 1.5 / 1e9, share / 1e9)

    def _build_drafter(self) -> Drafter | None:
        """speculative_method="draft_model": rank 0 builds the draft, unsharded, with its own
        KV cache (allocated with the target's, on the same block ids); other ranks receive
        its tokens (workers/draft_model.py)."""
        spec = self.config.speculative
        if spec is None or spec.draft is None:
            return None
        if self.tp.rank != 0:
            return DraftReceiver(self.tp, self.device)
        num_layers, num_kv_heads, head_dim = MODELS[spec.draft.architecture].kv_cache_spec(
            spec.draft.hf_config, TPGroup())
        backend = make_backend(self.backend.name, self.config.cache.block_size, num_kv_heads,
                               head_dim, self.dtype, self.device, self.backend.kv_dtype)
        kv_cache = KVCache(backend, num_layers)
        model = self._build_model(spec.draft, TPGroup(), kv_cache)
        return DraftModel(model, kv_cache, self.ops.argmax, self.device, self.tp)

    @property
    def _kv_caches(self) -> list[KVCache]:
        """The KV caches this rank allocates, on the same block ids: the target's, and the
        draft model's on rank 0."""
        if isinstance(self.drafter, DraftModel):
            return [self.kv_cache, self.drafter.kv_cache]
        return [self.kv_cache]

    @property
    def _bytes_per_block(self) -> int:
        return sum(cache.bytes_per_block for cache in self._kv_caches)

    def _make_runner(self) -> ModelRunner:
        sampler = Sampler(self.config.seed, self.device, self.ops.argmax,
                          self.config.model.eos_token_ids, self.ops.sample, self.ops.penalize,
                          self.ops.top_logprobs)
        return ModelRunner(self.model, self.backend, sampler, self.tp.rank == 0, self.device,
                           self.dtype, self.drafter, self.async_scheduling)

    def _fuse_decode_steps(self) -> None:
        """CPU with the C kernels: steps of at most FUSED_MAX_TOKENS tokens (up to
        FUSED_MAX_TOKENS_WIDE where every linear runs that many rows as the model's forward
        does: on the gemv kernel, or past its rows on kvflow's int8 GEMM,
        FusedDecode.gemv_rows) run every layer in one C call (workers/fused_decode.py), and
        steps of plain greedy rows take their tokens from an int8 copy of the LM head plus a
        few exact rows (workers/greedy_head.py); enforce_eager keeps both off."""
        if self.ops.name != "c" or self.backend.name != "cpu" or self.config.enforce_eager:
            return
        why = FusedDecode.unusable(self.model)
        if why is not None:
            logger.info("rank %d: decode steps unfused: %s", self.tp.rank, why)
            return
        max_tokens = max(FUSED_MAX_TOKENS,
                         min(FusedDecode.gemv_rows(self.model), FUSED_MAX_TOKENS_WIDE))
        self.runner.fused = FusedDecode(self.model, self.kv_cache, self.tp, max_tokens)
        self.runner.greedy = GreedyHead.build(self.model.lm_head, self.tp)

    def _log_choices(self) -> None:
        fast = (" + decode CUDA graphs" if self.use_cuda_graphs
                else f" + fused decode steps (<= {self.runner.fused.max_tokens} tokens)"
                if self.runner.fused is not None else "")
        logger.info("rank %d: device %s, attention backend %s%s, KV cache %s, ops %s%s, "
                    "linear %s, async scheduling %s", self.tp.rank, self.device,
                    self.backend.name,
                    " (auto)" if self.config.attention_backend == "auto" else "",
                    DTYPE_NAMES[self.backend.kv_dtype], self.ops.name, fast,
                    self.ops.linear.name, "on" if self.async_scheduling else "off")

    # --- KV cache ------------------------------------------------------------------------

    def _allocate_kv_cache(self) -> int:
        num_blocks = self._num_blocks()
        for cache in self._kv_caches:
            cache.allocate(num_blocks)
        logger.info("rank %d: %d KV blocks of %d tokens (%.2f GiB%s)", self.tp.rank,
                    num_blocks, self.config.cache.block_size,
                    num_blocks * self._bytes_per_block / 2**30,
                    ", the draft model's included" if len(self._kv_caches) > 1 else "")
        return num_blocks

    def _num_blocks(self) -> int:
        gb = self.config.cache.kv_cache_memory_gb
        if gb is None and self.device.type == "cuda":
            return self._profile_num_blocks()
        gb = gb or auto_kv_cache_gb()
        num_blocks = int(gb * 2**30 // self._bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={gb} holds no KV block "
                             f"({self._bytes_per_block} bytes each)")
        return num_blocks

    def _profile_num_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the card once the weights, the CUDA
        context, other processes and the peak activations of the largest step are counted.
        The largest step runs on a temporary cache just big enough for it."""
        sched, util = self.config.scheduler, self.config.cache.gpu_memory_utilization
        shape = (sched.max_num_batched_tokens, sched.max_num_seqs,
                 self.config.model.max_model_len)
        self.kv_cache.allocate(self.runner.profile_num_blocks(*shape))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        self.runner.profile_run(*shape)
        torch.cuda.synchronize()
        peak_activations = torch.cuda.max_memory_allocated(self.device) - baseline
        self.kv_cache.allocate(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free               # weights, CUDA context, other processes
        budget = total * util - in_use - peak_activations
        num_blocks = int(budget // self._bytes_per_block)
        logger.info("rank %d: %.2f GiB of GPU memory, %.2f GiB in use, %.2f GiB peak "
                    "activations: %.2f GiB for the KV cache at gpu_memory_utilization=%.2f",
                    self.tp.rank, total / 2**30, in_use / 2**30, peak_activations / 2**30,
                    max(budget, 0) / 2**30, util)
        if num_blocks < 1:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV cache "
                             f"({in_use / 2**30:.2f} GiB in use, {peak_activations / 2**30:.2f}"
                             f" GiB peak activations, {total / 2**30:.2f} GiB in all)")
        return num_blocks

    def _capture_cuda_graphs(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.mem_get_info(self.device)[0]
        sizes = self.runner.capture_cuda_graphs(self.config.scheduler.max_num_seqs,
                                                self.config.model.max_model_len)
        used = before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("rank %d: decode CUDA graphs for batch sizes %s..%s (%d graphs) captured "
                    "in %.1f s, %.2f GiB", self.tp.rank, sizes[0], sizes[-1], len(sizes),
                    time.perf_counter() - start, used / 2**30)

    def execute(self, plan: StepPlan, masks: Callable[[], bytes] | None = None
                ) -> StepResult:
        """The step's result; a step that raises (a bug, or data the boundary let through)
        is reported in `StepResult.error`, and EngineCore fails that step's requests instead
        of the engine (docs/design.md, "A step that raises")."""
        try:
            return self.runner.execute(plan, masks)
        except Exception:
            logger.exception("rank %d: a step of %d request(s) failed", self.tp.rank,
                             len(plan.scheduled_ids))
            self.runner.drop(plan.scheduled_ids)
            return StepResult([], [], error=traceback.format_exc())
