"""The offline API: `LLM(model).generate(prompts, params)` and `chat(messages, params)`."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm import tqdm

from kvflow.config import EngineOptions, make_engine_config
from kvflow.frontend.engine_client import InProcessEngine
from kvflow.frontend.model_files import resolve_model
from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.frontend.processor import InputProcessor, Prompt
from kvflow.frontend.supervisor import SupervisedEngine
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.ipc.messages import EngineRequest, EngineStats
from kvflow.sampling_params import SamplingParams


class LLM:
    """Runs a model on a batch of prompts. Usable as a context manager.

    By default EngineCore and its workers run as child processes (the same cluster as
    `launch.py serve`); `in_process=True` runs them in this process, for debugging and tests.

    Engine options (kvflow.config.EngineOptions, given as keywords or as `options`):
    tensor_parallel_size=1, dtype="auto", seed=0, max_model_len=None, max_num_seqs=256,
    max_num_batched_tokens=2048, async_scheduling=None (on, except in_process=True), block_size=16,
    enable_prefix_caching=True,
    kv_cache_memory_gb=None, load_format="safetensors", attention_backend="auto",
    num_threads=None, device="auto", enforce_eager=False, gpu_memory_utilization=0.9.

    Execution: `device` auto|cpu|cuda (auto: cuda:rank when CUDA is available);
    `attention_backend` auto|cpu|torch|triton|flash_attn (auto: flash_attn on CUDA when installed
    and block_size % 256 == 0, else triton on CUDA; on CPU the C kernels of `cpu` when they
    build, else plain `torch`); `enforce_eager=True` turns CUDA
    graphs and torch.compile off; on CUDA with `kv_cache_memory_gb=None` the KV cache takes
    what `gpu_memory_utilization` of the card leaves after the weights and a profiling step.
    `num_threads=None`: one thread per physical core the process may use, within its cgroup's
    CPU limit, split between a node's ranks (kvflow/workers/cpu_threads.py).
    """

    def __init__(self, model: str = "default", options: EngineOptions | None = None, *,
                 in_process: bool = False, **overrides: Any) -> None:
        path = resolve_model(model)
        self.config = make_engine_config(path, options, **overrides)
        self.tokenizer = Tokenizer(path)
        # A cluster restarts a dead or hung engine and resumes its requests
        # (max_engine_restarts; kvflow/frontend/supervisor.py).
        self.engine: InProcessEngine | SupervisedEngine | None = (
            InProcessEngine(self.config) if in_process else SupervisedEngine(self.config))
        self.processor = InputProcessor(self.config, self.tokenizer, self.engine.num_blocks)
        self.last_stats = EngineStats()
        self._ids = itertools.count()

    # --- public API ------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is checked before any runs (ValueError)."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore
        params = self._params_list(sampling_params, len(batch))
        trackers = [self._make_tracker(i, p, sp) for i, (p, sp) in
                    enumerate(zip(batch, params))]
        return self._run(trackers, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered by the chat template,
        with `tools` (OpenAI's tool objects) shown to the model as the server shows them. The
        answer is text: `kvflow.frontend.api.tool_calls.parse(HermesParser, text)` reads
        calls from it; to force calls, constrain (SamplingParams.structured_outputs)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.processor.render_chat(c, tools) for c in conversations]  # type: ignore
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- internals -------------------------------------------------------------------------

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return list(params)

    def _make_tracker(self, index: int, prompt: Prompt, params: SamplingParams
                      ) -> RequestTracker:
        try:
            return self.processor.make_tracker(str(next(self._ids)), prompt, params)
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None

    def _engine(self) -> InProcessEngine | SupervisedEngine:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down")
        return self.engine

    def _run(self, trackers: list[RequestTracker], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._engine()
        now = time.time()
        engine.add_requests([EngineRequest(t.output.request_id, t.output.prompt_token_ids,
                                           t.params, now) for t in trackers])
        live = {t.output.request_id: t for t in trackers}
        bar = tqdm(total=len(trackers), disable=not use_tqdm or len(trackers) < 2,
                   desc="Generating", unit="prompt", dynamic_ncols=True)
        num_out_tokens, start = 0, time.perf_counter()
        while live:
            outputs = engine.get_outputs()
            if outputs is None:
                continue
            self.last_stats = outputs.stats
            for delta in outputs.outputs:
                tracker = live.get(delta.request_id)
                if tracker is None:
                    continue
                num_out_tokens += len(delta.new_token_ids)
                if tracker.apply(delta, engine.abort):
                    del live[delta.request_id]
                    bar.update(1)
            bar.set_postfix_str(f"{num_out_tokens / (time.perf_counter() - start):.1f} out tok/s",
                                refresh=False)
        bar.close()
        return [t.output for t in trackers]
