"""kvflow on a CUDA GPU: HF equality in bf16, CUDA graphs vs eager, flash-attn vs triton, async
scheduling vs sync.

Greedy comparisons use docs/design.md §4's rule (assert_greedy_match): equal up to the first
divergence, and there each side's token in the other's top-5, since bf16 rounding (and any
change of kernel or summation order) can flip near-tied logits of a random model.
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_helpers import VOCAB_SIZE, as_reference, requires_cuda
from hf_reference import assert_greedy_match, hf_greedy
from kvflow import LLM, SamplingParams
from kvflow.workers.attention import flash_attn_importable

pytestmark = requires_cuda
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def make_prompts(lengths: tuple[int, ...] = (1, 7, 16, 33, 100, 257, 600, 1100)
                 ) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, VOCAB_SIZE - 100) for _ in range(n)] for n in lengths]


def run(model: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
        = GREEDY, **kwargs: object) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    kwargs.setdefault("in_process", True)
    kwargs.setdefault("kv_cache_memory_gb", 1.0)
    with LLM(model, max_model_len=2048, **kwargs) as llm:   # type: ignore[arg-type]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], [o.logprobs or [] for o in outs]


def assert_same_greedy(ours: tuple, theirs: tuple, min_exact: float) -> None:
    num_exact = sum(assert_greedy_match(t, lp, as_reference(rt, rlp))
                    for t, lp, rt, rlp in zip(*ours, *theirs))
    total = sum(len(t) for t in ours[0])
    assert num_exact >= min_exact * total, f"only {num_exact} of {total} tokens equal"


def test_hf_equality_bf16(qwen3_small: str) -> None:
    """The cluster as a user starts it (worker process, KV cache sized by profiling, CUDA
    graphs, torch.compile, auto backend) against HF transformers on the GPU, both bf16."""
    prompts = make_prompts()
    tokens, logprobs = run(qwen3_small, prompts, dtype="bfloat16", in_process=False,
                           kv_cache_memory_gb=None, gpu_memory_utilization=0.5)
    refs = hf_greedy(qwen3_small, prompts, MAX_TOKENS, dtype=torch.bfloat16, device="cuda")
    num_exact = sum(assert_greedy_match(t, lp, ref) for t, lp, ref in zip(tokens, logprobs, refs))
    # bf16 near-ties of a random model end some comparisons early; most tokens still match.
    assert num_exact >= 0.5 * len(prompts) * MAX_TOKENS, num_exact


def test_cuda_graphs_match_eager_fp32(qwen3_small: str) -> None:
    """float32, so rounding differences (padding rows, split-K, compiled norms) are ~1e-6 and
    the tokens should agree almost everywhere."""
    prompts = make_prompts()
    graphs = run(qwen3_small, prompts, dtype="float32", attention_backend="triton")
    eager = run(qwen3_small, prompts, dtype="float32", attention_backend="triton",
                enforce_eager=True)
    assert_same_greedy(graphs, eager, min_exact=0.95)


def test_graph_replay_padding_and_eager_fallback(qwen3_small: str) -> None:
    """Graphs captured only up to 4 requests: steps with 5-8 decodes fall back to eager,
    smaller ones replay padded graphs; outputs of different lengths make both happen."""
    prompts = make_prompts((3, 30, 90, 200, 17, 64, 5, 300))
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=5)
              for i in range(len(prompts))]
    with LLM(qwen3_small, dtype="float32", max_num_seqs=8, kv_cache_memory_gb=1.0,
             in_process=True, max_model_len=2048) as llm:
        runner = llm.engine.worker.runner                   # type: ignore[union-attr]
        assert runner.graphs is not None
        runner.capture_cuda_graphs(4, llm.config.model.max_model_len)
        replays: list[int] = []
        replay = runner.graphs.replay
        runner.graphs.replay = lambda b: replays.append(b) or replay(b)  # type: ignore
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert replays and set(replays) <= {1, 2, 4}
    eager = run(qwen3_small, prompts, params, dtype="float32", enforce_eager=True)
    assert_same_greedy(([o.token_ids for o in outs], [o.logprobs for o in outs]), eager, 0.95)


def test_async_scheduling_matches_sync_on_gpu(qwen3_small: str) -> None:
    """The cluster with async scheduling (EngineCore plans each step while the worker process
    runs the previous one, CUDA graphs; on by default on CUDA) against the same cluster
    without, float32: the same
    greedy tokens (batches may differ: a request admitted mid-step starts a step later)."""
    prompts = make_prompts()
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True, logprobs=5)
              for i in range(len(prompts))]
    overlapped = run(qwen3_small, prompts, params, dtype="float32", in_process=False,
                     async_scheduling=True)
    plain = run(qwen3_small, prompts, params, dtype="float32", in_process=False,
                async_scheduling=False)
    assert [len(t) for t in overlapped[0]] == [8 + 4 * i for i in range(len(prompts))]
    assert_same_greedy(overlapped, plain, min_exact=0.95)


@pytest.mark.skipif(not flash_attn_importable(), reason="flash-attn is not installed")
def test_flash_attn_matches_triton(qwen3_small: str) -> None:
    prompts = make_prompts()
    flash = run(qwen3_small, prompts, dtype="bfloat16", attention_backend="flash_attn",
                block_size=256)
    triton = run(qwen3_small, prompts, dtype="bfloat16", attention_backend="triton",
                 block_size=256)
    assert_same_greedy(flash, triton, min_exact=0.5)


def test_auto_backend_and_sampling_on_gpu(qwen3_small: str) -> None:
    """auto picks flash_attn only with block_size % 256 == 0 and flash-attn installed; seeded
    sampling on the GPU is reproducible and independent of the batch."""
    with LLM(qwen3_small, in_process=True, kv_cache_memory_gb=1.0, max_model_len=2048) as llm:
        worker = llm.engine.worker                          # type: ignore[union-attr]
        assert worker.device.type == "cuda" and worker.backend.name == "triton"
        seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=7,
                                ignore_eos=True)
        other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        prompts = make_prompts((20, 40, 60))
        alone = llm.generate(prompts[1], seeded, use_tqdm=False)[0].token_ids
        mixed = llm.generate(prompts, [other, seeded, other], use_tqdm=False)[1].token_ids
    assert alone == mixed
