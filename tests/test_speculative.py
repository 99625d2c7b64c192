"""Speculative decoding (kvflow/core/speculative.py): the proposer against a brute-force
lookup, the acceptance rule against a direct rejection sampler, exact scheduler counts with the
fake workers of test_scheduler.py (which check every KV slot read back and every rollback),
then the real default model: the same tokens with and without speculation."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import msgspec
import pytest
import torch

from kvflow.config import SpeculativeConfig, make_engine_config
from kvflow.core.engine_core import EngineCore
from kvflow.core.request import Request
from kvflow.core.speculative import PAUSE_TOKENS, Speculator, _NgramIndex, accept
from kvflow.ipc.messages import EngineStats
from kvflow.sampling_params import SamplingParams
from kvflow.workers.sampler import Sampler, SamplingBatch
from test_scheduler import (EOS, FakeExecutor, TokenFn, assert_all_released, content_token,
                            make_config, prompt, run_all, schedule_of, submit)


def spec_config(k: int = 3, low: int = 1, high: int = 3, off: int = 0) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low,
                             prompt_lookup_max=high, disable_by_batch_size=off)


def draft_config(k: int = 3, off: int = 0) -> SpeculativeConfig:
    """A draft model's config for the fake workers (their draft_fn plays the model)."""
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k,
                             disable_by_batch_size=off)


# --- the proposer ------------------------------------------------------------------------

def brute_force_lookup(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The longest suffix (high..low) that occurred before; the latest such occurrence."""
    end = len(tokens)
    for n in range(high, low - 1, -1):
        if end <= n:
            continue
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):          # e: the index after the occurrence
            if tokens[e - n:e] == suffix:
                return tokens[e:e + k]
    return []


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    index = _NgramIndex(1, 3)
    assert index.propose([1, 2, 3, 4, 1, 2, 3, 5, 6, 1, 2, 3], 4) == [5, 6, 1, 2]
    assert _NgramIndex(1, 3).propose([7, 8, 9], 4) == []             # nothing repeats
    assert _NgramIndex(2, 2).propose([1, 2, 9, 3, 2], 3) == []       # only a 1-gram repeats
    assert _NgramIndex(1, 1).propose([1, 2, 9, 3, 2], 3) == [9, 3, 2]


@pytest.mark.parametrize("low,high", [(1, 1), (1, 3), (2, 5)])
def test_incremental_index_equals_brute_force(low: int, high: int) -> None:
    rng = random.Random(low * 10 + high)
    for _ in range(30):
        index = _NgramIndex(low, high)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        while len(tokens) < 120:
            k = rng.randrange(1, 6)
            assert index.propose(tokens, k) == brute_force_lookup(tokens, k, low, high), tokens
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


# --- the acceptance rule -----------------------------------------------------------------

def direct_rejection_probabilities(p: list[torch.Tensor], drafts: list[int]
                                   ) -> dict[tuple[int, ...], float]:
    """The textbook rule with a one-hot proposal q: accept draft x with min(1, p(x)/q(x)),
    on rejection draw from max(p - q, 0) renormalised, a bonus draw when all are accepted.
    Returns the exact probability of every emitted sequence."""
    out: dict[tuple[int, ...], float] = {}
    reach = 1.0                                   # probability of accepting drafts[:j]
    for j, d in enumerate(drafts):
        q = torch.zeros_like(p[j])
        q[d] = 1.0
        accept_p = float(torch.clamp(p[j][d] / q[d], max=1.0))
        residual = torch.clamp(p[j] - q, min=0.0)
        residual = residual / residual.sum()
        for y in range(len(p[j])):
            if residual[y] > 0:
                out[tuple(drafts[:j]) + (y,)] = reach * (1 - accept_p) * float(residual[y])
        reach *= accept_p
    for y in range(len(p[-1])):
        out[tuple(drafts) + (y,)] = reach * float(p[-1][y])
    return out


def test_sampler_plus_accept_is_rejection_sampling() -> None:
    """Samples of the engine's sampler at every draft position, cut by `accept`, have the
    distribution of the direct rule (chi-square over all emitted sequences)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    torch.manual_seed(0)
    vocab, drafts, trials = 5, [1, 3], 20000
    logits = torch.randn(len(drafts) + 1, vocab) * 1.5
    p = list(logits.softmax(-1))
    rows = logits.repeat(trials, 1)
    params = [SamplingParams(temperature=1.0)] * len(rows)
    ids, _ = Sampler(1)(rows, SamplingBatch(params, [0] * len(rows)))
    seen = Counter(tuple(accept(drafts, ids[i:i + 3])) for i in range(0, len(ids), 3))
    expected = direct_rejection_probabilities(p, drafts)
    assert set(seen) <= set(expected)
    keys = sorted(expected)
    observed = [seen.get(key, 0) for key in keys]
    exp = [expected[key] * trials for key in keys]
    assert abs(sum(expected.values()) - 1) < 1e-6
    # Pool rare sequences so every cell expects >= 5 (chi-square's condition).
    pooled_obs, pooled_exp, o_acc, e_acc = [], [], 0, 0.0
    for o, e in sorted(zip(observed, exp), key=lambda t: t[1]):
        o_acc, e_acc = o_acc + o, e_acc + e
        if e_acc >= 5:
            pooled_obs.append(o_acc)
            pooled_exp.append(e_acc)
            o_acc, e_acc = 0, 0.0
    pooled_obs[-1] += o_acc
    pooled_exp[-1] += e_acc
    pooled_exp = [e * trials / sum(pooled_exp) for e in pooled_exp]   # sums equal exactly
    assert scipy_stats.chisquare(pooled_obs, pooled_exp).pvalue > 1e-3


def test_accept_keeps_the_agreeing_prefix_plus_one() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]      # all accepted, plus a bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]            # the first mismatch ends it
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [3]) == [3]


# --- the scheduler, exactly, with the fake workers ---------------------------------------

def make_spec_core(num_blocks: int, token_fn: TokenFn, spec: SpeculativeConfig | None,
                   draft_fn: TokenFn | None = None, **config: int | bool
                   ) -> tuple[EngineCore, FakeExecutor]:
    cfg = msgspec.structs.replace(make_config(**config), speculative=spec)  # type: ignore[arg-type]
    executor = FakeExecutor(num_blocks, cfg, token_fn)
    executor.draft_fn = draft_fn
    return EngineCore(cfg, executor), executor


def often_wrong(token_fn: TokenFn, every: int) -> TokenFn:
    """A fake draft model: the target's token, except at every `every`-th output position."""
    def draft_fn(request_id: str, token_ids: list[int], num_output: int) -> int:
        if num_output % every == every - 1:
            return 999
        return token_fn(request_id, token_ids, num_output)
    return draft_fn


def cycle_token(period: list[int], every: int = 0) -> TokenFn:
    """Outputs repeat the prompt's cycle (lookup hits), but every `every`-th output token
    is off the cycle (a rejected draft)."""
    def token_fn(request_id: str, token_ids: list[int], num_output: int) -> int:
        if every and num_output % every == every - 1:
            return 900 + num_output % 7
        return period[len(token_ids) % len(period)]
    return token_fn


def test_drafts_take_budget_and_blocks_and_give_the_same_tokens() -> None:
    period = [10, 11, 12, 13, 14]
    fn = cycle_token(period)
    outs = []
    for spec in (None, spec_config(k=3)):
        core, ex = make_spec_core(64, fn, spec)
        submit(core, "A", period * 2, max_tokens=12)
        outs.append(run_all(core))
        assert_all_released(core, ex)
    assert outs[0]["A"].token_ids == outs[1]["A"].token_ids
    # Prefill (10), then 1 + 3 drafts per step, all accepted: 4 tokens a step, 12 in all
    # (the last step's drafts are capped by max_tokens: 12 - 9 - 1 = 2).
    assert schedule_of(ex) == [[("A", 10)], [("A", 4)], [("A", 4)], [("A", 3)], []]
    stats = core.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (3, 8, 8)
    assert stats.spec_accepted_per_pos == [3, 3, 2]
    assert outs[1]["A"].finish_reason == "length" and len(outs[1]["A"].token_ids) == 12


def test_rejected_drafts_are_rolled_back_exactly() -> None:
    """Every 3rd output is off the cycle: drafts are rejected part-way. The fake workers check
    each step that all computed KV reads back, and that num_computed_tokens rolled back."""
    period = [20, 21, 22, 23]
    fn = cycle_token(period, every=3)
    outs = []
    for spec in (None, spec_config(k=4)):
        core, ex = make_spec_core(64, fn, spec)
        submit(core, "A", period * 3, max_tokens=30)
        outs.append(run_all(core))
        assert_all_released(core, ex)
    assert outs[0]["A"].token_ids == outs[1]["A"].token_ids
    stats = core.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_random_workload_with_preemption_and_prefix_hits_equals_no_speculation(
        method: str) -> None:
    """Many requests sharing prefixes, a cache small enough to preempt, content-dependent
    tokens with repeats (lookups hit and miss; the fake draft model is wrong at every 4th
    position): identical outputs, everything released."""
    rng = random.Random(7)
    base = [rng.randrange(50, 60) for _ in range(12)]
    prompts = {f"r{i}": base[:rng.randrange(4, 12)] + [rng.randrange(50, 60) for _ in range(6)]
               for i in range(10)}

    def repeating(request_id: str, token_ids: list[int], num_output: int) -> int:
        h = content_token(request_id, token_ids[-2:], num_output)
        return EOS if h == EOS else 50 + h % 10        # a small alphabet: n-grams repeat

    max_tokens = {request_id: rng.randrange(5, 25) for request_id in prompts}
    outs, preemptions = [], []
    spec = spec_config(k=3, low=1, high=2) if method == "ngram" else draft_config(k=3)
    for speculative in (None, spec):
        core, ex = make_spec_core(14, repeating, speculative, often_wrong(repeating, 4),
                                  max_num_batched_tokens=24)
        for request_id, p in prompts.items():
            submit(core, request_id, p, max_tokens=max_tokens[request_id], ignore_eos=False)
        outs.append({k: (v.token_ids, v.finish_reason) for k, v in run_all(core).items()})
        assert_all_released(core, ex)
        preemptions.append(core.stats().num_preemptions)
    assert outs[0] == outs[1]
    stats = core.stats()
    assert preemptions[1] > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_eos_and_stop_ids_inside_a_draft_end_the_request_there() -> None:
    period = [30, 31, EOS, 33]

    def own_cycle(request_id: str, token_ids: list[int], num_output: int) -> int:
        return token_ids[len(token_ids) % 4]          # each request repeats its prompt

    core, ex = make_spec_core(64, own_cycle, spec_config(k=4))
    submit(core, "eos", period * 2, max_tokens=20, ignore_eos=False)
    submit(core, "stop", [40, 41, 42, 43] * 2, max_tokens=20, stop_token_ids=[42])
    out = run_all(core)
    assert out["eos"].token_ids == [30, 31, EOS] and out["eos"].finish_reason == "stop"
    assert out["stop"].token_ids == [40, 41, 42] and out["stop"].finish_reason == "stop"
    assert core.stats().spec_num_drafts == 2           # both drafted, past their stop
    assert_all_released(core, ex)


def test_no_drafts_above_the_batch_size_limit() -> None:
    fn = cycle_token([10, 11, 12])
    core, ex = make_spec_core(64, fn, spec_config(k=2, off=2), max_num_seqs=8)
    for i in range(3):
        submit(core, f"r{i}", [10, 11, 12] * 2, max_tokens=6 + 4 * i)
    run_all(core)
    for plan in ex.plans:
        if plan.num_spec_tokens:
            assert len(plan.scheduled_ids) <= 2, plan
    assert any(plan.num_spec_tokens for plan in ex.plans)     # once two had finished


def test_draft_model_drafts_are_counted_by_engine_core_and_made_by_the_workers() -> None:
    """method draft_model: the plan carries how many drafts (k, capped by max_tokens), never
    their tokens; a draft wrong at every 3rd position is rolled back exactly."""
    fn = cycle_token([10, 11, 12, 13])
    outs = []
    for spec in (None, draft_config(k=3)):
        core, ex = make_spec_core(64, fn, spec, often_wrong(fn, 3))
        submit(core, "A", [10, 11, 12, 13] * 2, max_tokens=14)
        outs.append(run_all(core))
        assert_all_released(core, ex)
    assert outs[0]["A"].token_ids == outs[1]["A"].token_ids
    drafting = [p for p in ex.plans if p.num_spec_tokens]
    assert drafting and not any(p.spec_token_ids for p in drafting)
    # Outputs 0..13; the draft is wrong at outputs 2, 5, 8, 11: each verification after the
    # first token accepts up to that position and emits the target's token there.
    assert [p.num_spec_tokens["A"] for p in drafting] == [3, 3, 3, 3, 1]
    stats = core.stats()
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (13, 8)


def test_poor_acceptance_pauses_a_request() -> None:
    spec = Speculator(spec_config(k=2), max_model_len=1000)
    r = Request("r", [1, 2, 1, 2, 1], SamplingParams(max_tokens=500))
    assert spec.propose(r, 10) == (2, [2, 1])
    for _ in range(6):                        # nothing accepted, again and again
        spec.record(r, 2, 0)
        if spec.propose(r, 10) == (0, []):
            break
    assert spec.propose(r, 10) == (0, [])
    r.token_ids += [2] * PAUSE_TOKENS          # the pause is over
    assert spec.propose(r, 10) == (1, [2])     # the latest match of 2,2,2 is one token back
    spec.record(r, 1, 0)                       # the try fails: a pause twice as long
    r.token_ids += [2] * (2 * PAUSE_TOKENS - 1)
    assert spec.propose(r, 10) == (0, [])
    r.token_ids += [2]
    assert spec.propose(r, 10) == (1, [2])
    spec.record(r, 1, 1)                       # accepted: the next pause is short again
    for _ in range(6):
        spec.record(r, 2, 0)
        if spec.propose(r, 10) == (0, []):
            break
    r.token_ids += [2] * PAUSE_TOKENS
    assert spec.propose(r, 10) == (1, [2])
    assert spec.propose(r, 0) == (0, [])       # no budget left
    short = Request("s", [1, 2, 1, 2, 1], SamplingParams(max_tokens=500))
    assert Speculator(spec_config(k=2), max_model_len=6).propose(short, 10) == (1, [2])
    assert Speculator(spec_config(k=2), max_model_len=1000).propose(short, 10) == (2, [2, 1])
    capped = Request("c", [1, 2, 1, 2, 1], SamplingParams(max_tokens=2))
    assert Speculator(spec_config(k=2), max_model_len=1000).propose(capped, 10) == (1, [2])
    # A draft model: EngineCore sets the number only, under the same limits and pause.
    drafter = Speculator(draft_config(k=3), max_model_len=1000)
    assert drafter.propose(Request("d", [1, 2], SamplingParams(max_tokens=500)), 10) == (3, None)
    assert drafter.propose(Request("d", [1, 2], SamplingParams(max_tokens=3)), 10) == (2, None)
    assert drafter.propose(Request("d", [1, 2], SamplingParams(max_tokens=500)), 1) == (1, None)


# --- the default model: the same tokens as without speculation --------------------------

DTYPE = "float32"          # exact equality across step shapes is a float32 promise
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}
COPY_PROMPTS = [           # lookup hits often
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Copy this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    "    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
]
OPEN_PROMPTS = [           # lookup rarely hits
    "Once upon a time, in a small village by the sea,",
    "The first ten prime numbers are",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def plain(default_model: str):  # type: ignore[no-untyped-def]
    from kvflow import LLM
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3, in_process=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(default_model: str):  # type: ignore[no-untyped-def]
    """The real cluster (EngineCore and a worker in their processes): the plan's drafts and
    the result's token counts cross the sockets."""
    from kvflow import LLM
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3,
             speculative_config=NGRAM) as llm:
        yield llm


def token_ids(llm, prompts: list[str], params: SamplingParams | list[SamplingParams]
              ) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_no_speculation(plain, spec) -> None:  # type: ignore[no-untyped-def]
    before = spec.last_stats
    for prompts in (COPY_PROMPTS, OPEN_PROMPTS):
        assert token_ids(spec, prompts, GREEDY) == token_ids(plain, prompts, GREEDY)
        for p in prompts:              # one at a time too (other batch shapes)
            assert token_ids(spec, [p], GREEDY) == token_ids(plain, [p], GREEDY)
    # Run again, the prompt's blocks come from the prefix cache: the same tokens.
    [again] = spec.generate([COPY_PROMPTS[1]], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens >= 16
    assert again.token_ids == token_ids(plain, [COPY_PROMPTS[1]], GREEDY)[0]
    stats = spec.last_stats
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert 0 < accepted < drafted
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens


def test_seeded_sampling_and_logprobs_equal_no_speculation(plain, spec  # type: ignore[no-untyped-def]
                                                           ) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, logprobs=2),
              SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=32,
                             repetition_penalty=1.2, frequency_penalty=0.3, logprobs=1),
              SamplingParams(temperature=0.5, min_p=0.1, seed=13, max_tokens=32,
                             min_tokens=20)]
    before = spec.last_stats.spec_num_accepted_tokens
    ours = spec.generate(COPY_PROMPTS, params, use_tqdm=False)
    theirs = plain.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert spec.last_stats.spec_num_accepted_tokens > before
    for a, b in zip(ours[:2], theirs[:2]):
        assert a.logprobs is not None and b.logprobs is not None
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-3 for t in x)


def test_stop_strings_max_tokens_and_stop_ids_mid_draft(plain, spec  # type: ignore[no-untyped-def]
                                                        ) -> None:
    prompt = COPY_PROMPTS[0]
    [ref] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40),
                           use_tqdm=False)
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 5]
    cases = [SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                            include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=7),
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref.token_ids[12]])]
    for params in cases:
        [a] = spec.generate([prompt], params, use_tqdm=False)
        [b] = plain.generate([prompt], params, use_tqdm=False)
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    [a] = spec.generate([prompt], cases[2], use_tqdm=False)
    assert len(a.token_ids) == 7 and a.finish_reason == "length"


def test_preemption_with_speculation(default_model: str, plain  # type: ignore[no-untyped-def]
                                                        ) -> None:
    from kvflow import LLM
    prompts = COPY_PROMPTS + OPEN_PROMPTS
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = token_ids(plain, prompts, params)
    # 10 blocks of 16 float32 tokens hold every request alone but not all five together.
    kv_gb = 10 * 737_280 / 2**30
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=kv_gb, in_process=True,
             speculative_config=NGRAM) as llm:
        assert token_ids(llm, prompts, params) == reference
        assert llm.last_stats.num_preemptions > 0
        assert llm.last_stats.spec_num_accepted_tokens > 0
        assert llm.last_stats.num_free_blocks == 10


def test_tensor_parallel_2_with_speculation(default_model: str, tmp_path: str) -> None:
    """The default model's 9 heads do not split in two: a tiny random Llama that does, with
    small weights (its greedy outputs fall into loops, where lookup hits; its top logits
    stay 0.04+ apart, far above float32's rounding of the sharded sums)."""
    from kvflow import LLM
    from model_helpers import make_tiny_model
    path = make_tiny_model(default_model, str(tmp_path), "llama", initializer_range=0.05)
    prompts = ["The quick brown fox", "1, 2, 3, 1, 2, 3, 1, 2", [7] * 45]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(path, in_process=True, kv_cache_memory_gb=0.05, dtype=DTYPE) as llm:
        reference = token_ids(llm, prompts, params)
    with LLM(path, tensor_parallel_size=2, kv_cache_memory_gb=0.05, dtype=DTYPE,
             num_threads=1, speculative_config=NGRAM) as llm:
        assert token_ids(llm, prompts, params) == reference
        assert llm.last_stats.spec_num_accepted_tokens > 0


def test_unseeded_distribution_matches_hf_at_a_verified_position(
        default_model: str, spec) -> None:  # type: ignore[no-untyped-def]
    """Unseeded sampling: the second output token (verified against a draft: the prompt
    repeats) follows HF transformers' distribution, given the first (chi-square)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from transformers import AutoModelForCausalLM
    prompt = "red green blue, red green blue, red green blue, red green"
    # max_tokens=3: room for one draft, verified at the second token.
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    before = spec.last_stats
    outs = spec.generate([prompt] * 600, params, use_tqdm=False)
    stats = spec.last_stats
    assert stats.spec_num_drafts - before.spec_num_drafts >= 300       # verified, mostly
    first = Counter(o.token_ids[0] for o in outs).most_common(1)[0][0]
    seconds = Counter(o.token_ids[1] for o in outs if o.token_ids[0] == first)
    prompt_ids = spec.tokenizer.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + [first]])).logits[0, -1]
    top = logits.topk(6)
    probs = top.values.softmax(-1)
    n = sum(seconds.values())
    assert set(seconds) <= set(top.indices.tolist())
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for token, prob in zip(top.indices.tolist(), probs.tolist()):
        if prob * n >= 5:
            observed.append(seconds.get(token, 0))
            expected.append(prob * n)
        else:
            rest_o += seconds.get(token, 0)
            rest_e += prob * n
    if rest_e:
        observed.append(rest_o)
        expected.append(rest_e)
    if len(observed) > 1:
        expected = [e * n / sum(expected) for e in expected]
        assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3, (seconds, probs)
    else:                          # one token takes nearly all the mass: it must dominate
        assert seconds[top.indices[0].item()] >= 0.95 * n


# --- a draft model: tiny random models that share the default tokenizer ------------------

@pytest.fixture(scope="module")
def tiny_pair(default_model: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, str]:
    """A target (2-layer Llama, small weights: its greedy outputs loop, and its top logits
    stay far apart, so argmaxes do not flip with the batch shape) and an unrelated 1-layer
    Qwen2 draft (other heads and sizes: its own KV cache layout)."""
    from model_helpers import make_tiny_model
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(default_model, str(root / "target"), "llama",
                             initializer_range=0.05)
    draft = make_tiny_model(default_model, str(root / "draft"), "qwen2", hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, initializer_range=0.05)
    return target, draft


TINY_PROMPTS = ["The quick brown fox", "1, 2, 3, 1, 2, 3, 1, 2", [7] * 45,
                "Once upon a time there was"]


def draft_llm(target: str, draft: str, **options: object):  # type: ignore[no-untyped-def]
    from kvflow import LLM
    options.setdefault("in_process", True)
    return LLM(target, dtype=DTYPE, speculative_config={
        "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 0}, **options)


def test_draft_model_options_are_checked(default_model: str, tiny_pair: tuple[str, str],
                                         tmp_path: str) -> None:
    from model_helpers import make_tiny_model
    target, draft = tiny_pair
    config = make_engine_config(target, speculative_config={"model": draft})
    assert config.speculative is not None and config.speculative.method == "draft_model"
    assert config.speculative.draft is not None
    assert config.speculative.draft.architecture == "Qwen2ForCausalLM"
    other_vocab = make_tiny_model(default_model, f"{tmp_path}/v", "llama", vocab_size=1000)
    short = make_tiny_model(default_model, f"{tmp_path}/s", "llama",
                            max_position_embeddings=64)
    bad = [({"method": "draft_model"}, "needs speculative_model"),
           ({"model": other_vocab}, "vocab_size 1000"),
           ({"model": short}, "max_position_embeddings 64"),
           ({"model": f"{tmp_path}/none"}, "no such directory"),
           ({"method": "ngram", "model": draft}, "not 'ngram'"),
           ({"model": draft, "prompt_lookup_max": 3}, "prompt_lookup_max apply to"),
           ({"method": "eagle"}, "must be one of")]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            make_engine_config(target, max_model_len=128, speculative_config=spec)


def test_draft_model_gives_the_target_tokens(tiny_pair: tuple[str, str]) -> None:
    """An unrelated draft: greedy and seeded outputs equal the target's alone, whatever it
    proposes (in one batch and one request at a time)."""
    from kvflow import LLM
    target, draft = tiny_pair
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.7, top_k=8, seed=4, max_tokens=40,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    with LLM(target, dtype=DTYPE, in_process=True, kv_cache_memory_gb=0.05) as llm:
        reference = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
    with draft_llm(target, draft, kv_cache_memory_gb=0.05) as llm:
        ours = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
        for a, b in zip(ours[1].logprobs or [], reference[1].logprobs or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        for prompt, p, ref in zip(TINY_PROMPTS, params, reference):
            assert llm.generate([prompt], p, use_tqdm=False)[0].token_ids == ref.token_ids
        assert llm.last_stats.spec_num_draft_tokens > 0


def accepted_fraction(llm, before):  # type: ignore[no-untyped-def]
    s = llm.last_stats
    drafted = s.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0
    return (s.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / drafted


def test_the_target_as_its_own_draft_is_always_accepted(tiny_pair: tuple[str, str]) -> None:
    """With the target as the draft, greedy drafts are accepted every time exactly when the
    draft's KV cache is right everywhere it is read: after verifications that accepted part
    of a draft, in blocks that come from the prefix cache, and after preemption."""
    from kvflow import LLM
    target, _ = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(target, dtype=DTYPE, in_process=True, kv_cache_memory_gb=0.05) as llm:
        reference = [o.token_ids for o in llm.generate(TINY_PROMPTS, params, use_tqdm=False)]
    with draft_llm(target, target, kv_cache_memory_gb=0.05) as llm:
        before = llm.last_stats
        assert token_ids(llm, TINY_PROMPTS, params) == reference
        assert accepted_fraction(llm, before) == 1.0
        before = llm.last_stats                  # again: prompts from the prefix cache
        [again] = llm.generate([TINY_PROMPTS[2]], params, use_tqdm=False)
        assert again.num_cached_tokens >= 32 and again.token_ids == reference[2]
        assert accepted_fraction(llm, before) == 1.0
    # 6 blocks of 16 tokens hold any one request (45 + 40 tokens) but not two: preemption.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4 * 2        # target's + draft's KV, float32
    with draft_llm(target, target, kv_cache_memory_gb=6 * block_bytes / 2**30) as llm:
        assert token_ids(llm, TINY_PROMPTS, params) == reference
        assert llm.last_stats.num_preemptions > 0 and llm.last_stats.num_total_blocks == 6
        assert accepted_fraction(llm, EngineStats()) == 1.0


def test_a_draft_that_skipped_decodes_catches_up_exactly(tiny_pair: tuple[str, str]) -> None:
    """Two requests decode side by side, above the batch-size limit, so the draft skips
    their decodes; a third request reuses the first one's output blocks from the prefix
    cache. With the target as its own draft every draft is still accepted: the draft
    recomputes what it skipped (in the first request's blocks too) before it drafts."""
    from kvflow import LLM
    target, _ = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(target, dtype=DTYPE, in_process=True, kv_cache_memory_gb=0.05,
             speculative_config={"model": target, "num_speculative_tokens": 3,
                                 "disable_by_batch_size": 1}) as llm:
        first, _ = llm.generate([[5] * 20, [9] * 20], params, use_tqdm=False)
        assert llm.last_stats.spec_num_draft_tokens == 0          # two running: no drafts
        follow_up = [5] * 20 + first.token_ids
        [ref] = llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True), use_tqdm=False)
        assert ref.num_cached_tokens >= 48                   # blocks of the first's output
        assert accepted_fraction(llm, EngineStats()) == 1.0
    with LLM(target, dtype=DTYPE, in_process=True, kv_cache_memory_gb=0.05) as plain_llm:
        [plain_ref] = plain_llm.generate([follow_up], SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert ref.token_ids == plain_ref.token_ids


def test_draft_model_under_tensor_parallel_2(tiny_pair: tuple[str, str]) -> None:
    """TP=2 in the real cluster: rank 0 runs the draft and broadcasts its tokens; the
    target's tokens equal TP=1's, and with the target as draft all are accepted."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with draft_llm(target, draft, kv_cache_memory_gb=0.05) as llm:
        reference = token_ids(llm, TINY_PROMPTS, params)
    for d in (draft, target):
        with draft_llm(target, d, in_process=False, tensor_parallel_size=2, num_threads=1,
                       kv_cache_memory_gb=0.05) as llm:
            assert token_ids(llm, TINY_PROMPTS, params) == reference
            if d == target:
                assert accepted_fraction(llm, EngineStats()) == 1.0


# --- the OpenAI server ------------------------------------------------------------------

def test_openai_server_streams_several_tokens_per_step(default_model: str, plain  # type: ignore[no-untyped-def]
                                                       ) -> None:
    """`launch.py serve --speculative-method ngram` with the openai SDK: whole and streamed
    answers equal LLM's without speculation (greedy; n=2 seeded), and /metrics counts drafts."""
    openai = pytest.importorskip("openai")
    from test_openai_server import metrics, serve
    prompt = COPY_PROMPTS[1]
    [ref] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40),
                           use_tqdm=False)
    seeded = [SamplingParams(temperature=0.8, seed=seed, max_tokens=30) for seed in (5, 6)]
    ref_seeded = plain.generate([prompt] * 2, seeded, use_tqdm=False)  # choice i: seed + i
    s = serve(default_model, "--speculative-method", "ngram", "--num-speculative-tokens", "5",
              "--prompt-lookup-max", "4")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
        whole = c.completions.create(model="default", prompt=prompt, max_tokens=40,
                                     temperature=0)
        assert whole.choices[0].text == ref.text
        chunks = [ch.choices[0].text for ch in c.completions.create(
            model="default", prompt=prompt, max_tokens=40, temperature=0, stream=True)]
        assert "".join(chunks) == ref.text
        assert len([t for t in chunks if t]) < len(ref.token_ids)   # several tokens a delta
        two = c.completions.create(model="default", prompt=prompt, max_tokens=30,
                                   temperature=0.8, seed=5, n=2)
        assert [ch.text for ch in two.choices] == [o.text for o in ref_seeded]
        m = metrics(s)
        drafted = m["kvflow:spec_decode_num_draft_tokens_total"]
        accepted = m["kvflow:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= drafted and m["kvflow:spec_decode_num_drafts_total"] > 0
        per_pos = [m.get(f"kvflow:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}",
                         0) for i in range(5)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        s.cleanup()
