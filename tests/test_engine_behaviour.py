"""End-to-end engine behaviour on the real default model: prefix caching, forced preemption,
forced chunking, stop conditions. Each constrained run must equal the unconstrained one."""
from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Exact equality across schedules (chunks, preemption, cache hits) is a float32 promise;
# dtype="auto" would be bfloat16 on CPUs with AVX512-BF16 and float32 elsewhere.
DTYPE = "float32"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n",
    "Once upon a time, in a small village by the sea,",
    "The first ten prime numbers are",
]


@pytest.fixture(scope="module")
def reference(default_model: str) -> list[list[int]]:
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3,
             enable_prefix_caching=False) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_prefix_caching_same_outputs_and_exact_hits(default_model: str,
                                                    reference: list[list[int]]) -> None:
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3, block_size=16) as llm:
        shared = llm.tokenizer.encode(PROMPTS[0])          # > 3 full blocks of 16
        first = llm.generate([shared + [504, 2988]], GREEDY, use_tqdm=False)[0]
        second = llm.generate([shared + [1147, 314, 260]], GREEDY, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        # The shared prefix's full blocks (floor(len/16)) are served from the cache, exactly.
        assert second.num_cached_tokens == (len(shared) // 16) * 16
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert outs[0].num_cached_tokens > 0            # PROMPTS[0] starts with `shared`
        stats = llm.last_stats
        assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits


def test_forced_preemption_same_outputs(default_model: str, reference: list[list[int]]) -> None:
    # Bytes per 16-token block of the default model in float32: 30 layers * K,V * 16 tokens
    # * 3 KV heads * 64 dims * 4 bytes = 737,280. 10 blocks hold every request alone but not all four together.
    kv_gb = 10 * 737_280 / 2**30
    with LLM(default_model, kv_cache_memory_gb=kv_gb, dtype=DTYPE) as llm:
        assert llm.engine is not None and llm.engine.num_blocks == 10
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert llm.last_stats.num_preemptions > 0
        assert llm.last_stats.num_free_blocks == 10       # everything returned at the end


def test_forced_chunking_same_outputs(default_model: str, reference: list[list[int]]) -> None:
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3, max_num_batched_tokens=7,
             enable_prefix_caching=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_stop_conditions(default_model: str, reference: list[list[int]]) -> None:
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3) as llm:
        ref = reference[2]
        stop_id = ref[5]
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24,
                                                      stop_token_ids=[stop_id]),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop_id) + 1]
        full = llm.tokenizer.decode(ref)
        stop = full[len(full) // 2:len(full) // 2 + 4]
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert out.finish_reason == "length" and out.token_ids == ref[:5]
        assert out.text == llm.tokenizer.decode(ref[:5])


def test_seeded_sampling_independent_of_batch(default_model: str) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1234,
                            ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3) as llm:
        alone = llm.generate(PROMPTS[3], seeded, use_tqdm=False)[0]
        mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [other, seeded, other],
                             use_tqdm=False)[1]
    assert alone.token_ids == mixed.token_ids


def test_a_generate_batch_is_scheduled_together(default_model: str) -> None:
    """LLM.generate's prompts reach EngineCore in one message, so its first step has all of
    them: 16 one-token requests take exactly one step (sent one by one, EngineCore could start
    stepping on the first; the step's batch decides the kernels, and bfloat16's greedy tokens
    then changed between identical calls)."""
    from kvflow.ipc.messages import GetTimings
    with LLM(default_model, kv_cache_memory_gb=0.05, max_model_len=256) as llm:
        for call in range(3):
            before = llm.engine.utility(GetTimings(2 * call))["num_steps"]
            outs = llm.generate([[100 + i] * 8 for i in range(16)],
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                use_tqdm=False)
            assert [len(o.token_ids) for o in outs] == [1] * 16
            assert llm.engine.utility(GetTimings(2 * call + 1))["num_steps"] - before == 1
