"""The engine on the triton attention backend, on CPU through Triton's interpreter.

Run by test_triton_backend.py in a subprocess, because TRITON_INTERPRET=1 must be set before
anything imports triton. For each tiny model folder given, runs the same batch through the
torch backend and the triton backend, the first model also through the triton backend with the
CUDA-graph decode path (static buffers, padded batches; replayed eagerly off CUDA), and prints
JSON: per run the greedy token ids and logprobs. The batch mixes a prefix-cache hit, chunked
prefills and decodes in one step (max_num_batched_tokens is small), so decode and prefill rows
interleave (the paged backends' gather path) as well as sit side by side (their slice path).
"""
from __future__ import annotations

import json
import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.frontend.engine_client import InProcessEngine  # noqa: E402

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(40)]      # > 2 blocks of 16
    batch = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17)]
    batch += [[rng.randrange(100, 40000) for _ in range(n)] for n in (1, 5, 33, 12, 60)]
    return shared + [7, 8, 9], batch


def run(model: str, backend: str, static_decode: bool = False) -> dict:
    warm, batch = prompts()
    with LLM(model, in_process=True, attention_backend=backend, dtype="float32", device="cpu",
             kv_cache_memory_gb=0.02, max_num_batched_tokens=48, max_num_seqs=8) as llm:
        if static_decode:
            assert isinstance(llm.engine, InProcessEngine)
            llm.engine.worker.runner.capture_cuda_graphs(8, llm.config.model.max_model_len)
        llm.generate([warm], PARAMS, use_tqdm=False)              # fills the prefix cache
        outs = llm.generate(batch, PARAMS, use_tqdm=False)
    assert outs[0].num_cached_tokens > 0, "the shared prefix should be a cache hit"
    return {"token_ids": [o.token_ids for o in outs],
            "logprobs": [[{str(t): lp for t, lp in step.items()} for step in o.logprobs or []]
                         for o in outs]}


if __name__ == "__main__":
    results = {}
    for i, model in enumerate(sys.argv[1:]):
        results[model] = {"torch": run(model, "torch"), "triton": run(model, "triton")}
        if i == 0:
            results[model]["triton_static_decode"] = run(model, "triton", static_decode=True)
    print(json.dumps(results))
