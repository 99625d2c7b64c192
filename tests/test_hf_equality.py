"""kvflow's greedy tokens and logprobs against HF transformers on the same weights (float32).

All prompts run together in one kvflow batch (so batching, padding of the attention groups and
mixed prefill/decode steps are exercised); HF runs them one at a time.
"""
from __future__ import annotations

import pytest

import torch

from hf_reference import assert_greedy_match, hf_greedy
from kvflow import LLM, RequestOutput, SamplingParams

MAX_TOKENS = 32
# Logprobs of the same float32 math differ only by summation order: measured ~1e-4. (Runs
# used to differ by up to 6e-3 when torch's float32 cos/sin built the rotary tables: see
# layers/rotary.py.)
LOGPROB_ATOL = 2e-3
# A bfloat16 KV cache: rounding is discontinuous, so the two sides' float32 keys and values,
# a few ulps apart, now and then round to neighbouring bfloat16 values, and a flip early in a
# sequence carries through every later step. With HF's keys and values rounded the same way
# the differences are heavy-tailed: over these prompts (default model, 1 or 2 threads) mean
# 0.0041-0.0050, 99th percentile 0.024-0.030, maximum 0.068-0.090 and once 0.101 (a CI run).
# So the bulk is held tight and the single worst value loosely: against HF with unrounded keys
# and values the mean is 0.0074, with unrounded weights (the dtype="auto" test) 0.014.
BF16_KV_MEAN, BF16_KV_P99, BF16_KV_MAX = 0.0065, 0.05, 0.2
# An int8 cache (kv_cache_dtype="int8"): the same mechanism with one int8 step (a row's
# largest magnitude / 127, large next to most of the row's values where one channel stands
# out) in place of a bfloat16 ulp. HF against itself, float32 against float64 arithmetic,
# both with keys and values quantized so: mean 0.024, p99 0.15, max 0.43 over these prompts
# (0.0041, 0.026, 0.038 with bfloat16 rounding); kvflow float32 against HF float32 measured
# 0.024, 0.15, 0.23, and against HF with unquantized keys and values 0.037, 0.19, 0.32.
KV_BOUNDS = {torch.bfloat16: (BF16_KV_MEAN, BF16_KV_P99, BF16_KV_MAX),
             torch.int8: (0.033, 0.22, 0.6)}

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 5, 8, 13, 21,",
    "Translate to French: I would like a cup of coffee, please.",
    "<|im_start|>user\nName three primes.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders WHERE",
    # A long prompt (~500 tokens): several prefill blocks, a long decode context.
    " ".join(f"Item {i}: the {['red', 'green', 'blue', 'black'][i % 4]} box holds {i * 7} "
             f"marbles." for i in range(45)) + " In total, the boxes hold",
]


def _check_against_hf(model_path: str, prompts: list[str], weights: torch.dtype | None = None,
                      kv: torch.dtype | None = None, **llm_kwargs: object
                      ) -> list[RequestOutput]:
    """`weights`, `kv`: HF's weight matrices, and its keys and values as cached, rounded to
    that dtype (float32 arithmetic all the same)."""
    llm_kwargs.setdefault("dtype", "float32")
    with LLM(model_path, kv_cache_memory_gb=0.3, **llm_kwargs) as llm:   # type: ignore[arg-type]
        token_prompts = [llm.tokenizer.encode(p) for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=5)
        outs = llm.generate(token_prompts, params, use_tqdm=False)
    refs = hf_greedy(model_path, token_prompts, MAX_TOKENS, weights=weights, kv=kv)
    num_exact = 0
    diffs = []
    for out, ref in zip(outs, refs):
        assert out.logprobs is not None
        n = assert_greedy_match(out.token_ids, out.logprobs, ref)
        num_exact += n
        for i in range(n):
            for token_id, logprob in out.logprobs[i].items():
                if kv is None:
                    assert logprob == pytest.approx(float(ref.logprobs[i][token_id]),
                                                    abs=LOGPROB_ATOL)
                diffs.append(abs(logprob - float(ref.logprobs[i][token_id])))
    if kv is not None:
        d = torch.tensor(diffs)
        stats = (float(d.mean()), float(d.quantile(0.99)), float(d.max()))
        assert all(s <= b for s, b in zip(stats, KV_BOUNDS[kv])), (
            "mean, p99, max |logprob - HF's|", stats)
    # The tie rule is for rare near-ties, not a way out: most tokens must match exactly (with
    # an int8 cache a flipped step moves logprobs by up to ~0.4, so near-ties are less rare:
    # 212 of 256 measured).
    share = 0.75 if kv == torch.int8 else 0.9
    assert num_exact >= share * len(prompts) * MAX_TOKENS, num_exact
    return outs


def test_default_model_matches_hf(default_model: str) -> None:
    with LLM(default_model, kv_cache_memory_gb=0.1) as llm:
        assert len(llm.tokenizer.encode(PROMPTS[-1])) > 450
    _check_against_hf(default_model, PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_models: dict[str, str], arch: str) -> None:
    _check_against_hf(tiny_models[arch], PROMPTS)


def test_auto_without_native_bf16_is_float32_on_bf16_weights(default_model: str,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """dtype="auto" as a CPU without AVX512-BF16 or AMX runs it (the flags kvflow decides by,
    faked): float32 arithmetic on weights rounded to bfloat16, whose decode steps stream a
    bfloat16 copy, and a bfloat16 KV cache (workers/hardware.py, worker.py _kv_dtype). HF in
    float32 with its weight matrices and its cached keys and values rounded to bfloat16 is
    the reference (tests/test_hardware.py checks the weights' copies themselves)."""
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    _check_against_hf(default_model, PROMPTS, weights=torch.bfloat16, kv=torch.bfloat16,
                      dtype="auto")


def test_float32_with_a_bfloat16_kv_cache(default_model: str) -> None:
    """kv_cache_dtype="bfloat16" under dtype="float32": float32 arithmetic, the weights as
    loaded, keys and values rounded to bfloat16 as they are stored; HF float32 with its
    cached keys and values rounded the same is the reference."""
    _check_against_hf(default_model, PROMPTS, kv=torch.bfloat16, kv_cache_dtype="bfloat16")


def test_int8_kv_cache_matches_hf(default_model: str) -> None:
    """kv_cache_dtype="int8" under float32 arithmetic: each head's key and value rows stored in
    8 bits with their own scale; HF in float32 with its cached keys and values quantized and
    read back the same way is the reference. (Under bfloat16 arithmetic the kernels are
    checked against torch in test_cpu_ops.py and the fused decode against the unfused one in
    test_fused_decode.py.)"""
    _check_against_hf(default_model, PROMPTS, kv=torch.int8, kv_cache_dtype="int8")
