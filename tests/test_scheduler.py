"""Scheduler and EngineCore with a fake executor: exact plans, counts, preemption, stop, abort.

The fake executor plays the workers: it rebuilds each request's state from the plan diffs
alone, keeps a fake KV cache (the token id stored in every slot) and checks, before each step,
that every token already computed reads back from the request's block table. A wrong prefix
hit, a block handed to two requests or a lost diff therefore fails loudly. Its "model" samples
a deterministic token from the request's tokens so far. It also verifies draft tokens
(speculative decoding) as the real worker does: it writes their KV, samples every position,
keeps the agreeing prefix plus one, and checks that the next plan's num_computed_tokens
rolled the rejected ones back.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from kvflow.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig)
from kvflow.core.engine_core import EngineCore
from kvflow.core.request import Request
from kvflow.core.speculative import accept
from kvflow.ipc.messages import EngineOutputs, EngineRequest, StepPlan, StepResult
from kvflow.sampling_params import SamplingParams

EOS = 2
VOCAB = 1000

# (request id, its tokens so far, how many of them are outputs) -> the next token
TokenFn = Callable[[str, list[int], int], int]


def count_token(request_id: str, token_ids: list[int], num_output: int) -> int:
    return 100 + len(token_ids)


def content_token(request_id: str, token_ids: list[int], num_output: int) -> int:
    """Depends on every token so far, so a lost or duplicated token changes all later ones."""
    h = 17
    for t in token_ids:
        h = (h * 31 + t) % 1_000_003
    return EOS if h % 41 == 0 else 100 + h % 800


def scripted(scripts: dict[str, list[int]]) -> TokenFn:
    """Request id -> the exact output tokens to produce (other requests: count_token)."""
    def token_fn(request_id: str, token_ids: list[int], num_output: int) -> int:
        if request_id in scripts:
            return scripts[request_id][num_output]
        return count_token(request_id, token_ids, num_output)
    return token_fn


# --- the fake workers --------------------------------------------------------------------

@dataclass
class WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


class FakeExecutor:
    def __init__(self, num_blocks: int, config: EngineConfig, token_fn: TokenFn) -> None:
        self.num_blocks = num_blocks
        self.block_size = config.cache.block_size
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_fn = token_fn
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(num_blocks)]
        self.requests: dict[str, WorkerRequest] = {}
        self.plans: list[StepPlan] = []
        # Speculative decoding with a draft model: the drafts the plan counts but does not
        # carry come from this fake draft model, autoregressively (as workers/draft_model.py).
        self.draft_fn: TokenFn | None = None

    def execute(self, plan: StepPlan, masks: Callable[[], bytes] | None = None) -> StepResult:
        assert not plan.masked_ids and masks is None, "no constrained requests here"
        self.plans.append(plan)
        assert sum(plan.num_scheduled_tokens) <= self.max_num_batched_tokens, plan
        assert len(plan.scheduled_ids) <= self.max_num_seqs, plan
        assert len(set(plan.scheduled_ids)) == len(plan.scheduled_ids), plan
        self._apply_diff(plan)
        sampled_ids, sampled, counts = [], [], []
        for request_id, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens):
            state = self.requests[request_id]
            drafts = self._drafts(plan, request_id, state)
            assert not drafts or state.num_computed_tokens + 1 == len(state.token_ids), state
            assert n >= 1 and state.num_computed_tokens + n - len(drafts) <= len(
                state.token_ids), (state, n)
            self._read_kv(state)
            self._write_kv(state, n, drafts)
            if state.num_computed_tokens - len(drafts) == len(state.token_ids):
                num_output = len(state.token_ids) - state.num_prompt_tokens
                samples = [self.token_fn(request_id, state.token_ids + drafts[:j],
                                         num_output + j) for j in range(len(drafts) + 1)]
                kept = accept(drafts, samples)
                state.num_computed_tokens -= len(drafts) - (len(kept) - 1)   # roll back
                sampled_ids.append(request_id)
                sampled.extend(kept)
                counts.append(len(kept))
        if len(sampled) == len(sampled_ids):
            counts = []
        return StepResult(sampled_ids, sampled, num_sampled=counts)

    def _drafts(self, plan: StepPlan, request_id: str, state: WorkerRequest) -> list[int]:
        num_drafts = plan.num_spec_tokens.get(request_id, 0)
        drafts = plan.spec_token_ids.get(request_id)
        if drafts is None and num_drafts:
            assert self.draft_fn is not None, "a draft model's drafts, but no draft model"
            drafts = []
            num_output = len(state.token_ids) - state.num_prompt_tokens
            for j in range(num_drafts):
                drafts.append(self.draft_fn(request_id, state.token_ids + drafts,
                                            num_output + j))
        assert len(drafts or []) == num_drafts, (plan, request_id)
        return drafts or []

    def _apply_diff(self, plan: StepPlan) -> None:
        for request_id in plan.forget_ids:             # forgotten before the step runs
            del self.requests[request_id]
        for new in plan.new_requests:
            assert new.request_id not in self.requests, new.request_id
            self.requests[new.request_id] = WorkerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                len(new.token_ids) - new.num_output_tokens)
        for cached in plan.continuing_requests:
            state = self.requests[cached.request_id]
            state.token_ids += cached.new_token_ids
            state.block_ids += cached.new_block_ids
            assert cached.num_computed_tokens == state.num_computed_tokens, (cached, state)
        sent = ([r.request_id for r in plan.new_requests]
                + [r.request_id for r in plan.continuing_requests])
        assert sorted(sent) == sorted(plan.scheduled_ids), (sent, plan.scheduled_ids)

    def _slot(self, state: WorkerRequest, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def _read_kv(self, state: WorkerRequest) -> None:
        for pos in range(state.num_computed_tokens):
            block_id, offset = self._slot(state, pos)
            assert self.kv[block_id][offset] == state.token_ids[pos], (state, pos)

    def _write_kv(self, state: WorkerRequest, n: int, drafts: list[int]) -> None:
        tokens = state.token_ids + drafts
        for pos in range(state.num_computed_tokens, state.num_computed_tokens + n):
            block_id, offset = self._slot(state, pos)
            self.kv[block_id][offset] = tokens[pos]
        state.num_computed_tokens += n


# --- driving the engine ------------------------------------------------------------------

def make_config(*, block_size: int = 4, max_model_len: int = 64, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 64, prefix_caching: bool = True) -> EngineConfig:
    model = ModelConfig(path="/nonexistent", architecture="LlamaForCausalLM", dtype="float32",
                        load_format="dummy", vocab_size=VOCAB, max_model_len=max_model_len,
                        eos_token_ids=(EOS,), hf_config={})
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                          kv_cache_memory_gb=1.0),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens),
        parallel=ParallelConfig(), seed=0, attention_backend="torch", num_threads=1)


def make_core(num_blocks: int, token_fn: TokenFn = count_token,
              **config: int | bool) -> tuple[EngineCore, FakeExecutor]:
    cfg = make_config(**config)  # type: ignore[arg-type]
    executor = FakeExecutor(num_blocks, cfg, token_fn)
    return EngineCore(cfg, executor), executor


def submit(core: EngineCore, request_id: str, prompt: list[int], **params: object) -> None:
    core.add_request(EngineRequest(request_id, prompt, SamplingParams(**params)))  # type: ignore


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


def record(outputs: EngineOutputs, outcomes: dict[str, Outcome]) -> None:
    for delta in outputs.outputs:
        outcome = outcomes.setdefault(delta.request_id, Outcome())
        assert outcome.finish_reason is None, f"{delta.request_id} got news after finishing"
        outcome.token_ids += delta.new_token_ids
        outcome.finish_reason = delta.finish_reason
        outcome.num_cached_tokens = delta.num_cached_tokens


def run_all(core: EngineCore, outcomes: dict[str, Outcome] | None = None,
            max_steps: int = 500) -> dict[str, Outcome]:
    """Step until every request is done, then one more step so the workers forget the last."""
    outcomes = {} if outcomes is None else outcomes
    for _ in range(max_steps):
        if not core.has_work():
            break
        record(core.step(), outcomes)
    assert not core.has_work(), "the engine did not finish"
    record(core.step(), outcomes)
    return outcomes


def assert_all_released(core: EngineCore, executor: FakeExecutor) -> None:
    bm = core.block_manager
    assert bm.total_refs == 0
    assert bm.ref_counts == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.scheduler.requests == {}
    assert executor.requests == {}, "the workers were not told to forget every request"


def schedule_of(executor: FakeExecutor) -> list[list[tuple[str, int]]]:
    return [list(zip(p.scheduled_ids, p.num_scheduled_tokens)) for p in executor.plans]


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- token budget, chunking, order -------------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt_exactly() -> None:
    core, ex = make_core(32, max_num_batched_tokens=16)
    submit(core, "long", prompt(300, 50), max_tokens=3)
    out = run_all(core)
    assert schedule_of(ex) == [[("long", 16)], [("long", 16)], [("long", 16)], [("long", 2)],
                               [("long", 1)], [("long", 1)], []]
    assert out["long"].token_ids == [150, 151, 152]
    assert out["long"].finish_reason == "length"
    # The diffs: full state once, then only what is new (4 blocks per 16-token chunk).
    assert [len(p.new_requests) for p in ex.plans[:6]] == [1, 0, 0, 0, 0, 0]
    assert len(ex.plans[0].new_requests[0].block_ids) == 4
    assert [len(p.continuing_requests[0].new_block_ids) for p in ex.plans[1:6]] == [4, 4, 1, 0, 0]
    assert [p.continuing_requests[0].new_token_ids for p in ex.plans[1:6]] == [[], [], [], [150],
                                                                           [151]]
    assert ex.plans[-1].forget_ids == ["long"]
    assert_all_released(core, ex)


def test_running_first_then_waiting_fcfs_within_the_budget() -> None:
    core, ex = make_core(32, max_num_batched_tokens=10)
    for request_id, start in (("A", 10), ("B", 20), ("C", 30)):
        submit(core, request_id, prompt(start, 6), max_tokens=3)
    out = run_all(core)
    assert schedule_of(ex) == [
        [("A", 6), ("B", 4)],              # B gets the 4 tokens left of the budget
        [("A", 1), ("B", 2), ("C", 6)],    # running A and B first, then C from the queue
        [("A", 1), ("B", 1), ("C", 1)],
        [("B", 1), ("C", 1)],              # A finished after 3 tokens
        [],                                # B and C too: this plan only forgets them
    ]
    assert {k: v.token_ids for k, v in out.items()} == {
        "A": [106, 107, 108], "B": [106, 107, 108], "C": [106, 107, 108]}
    assert [p.forget_ids for p in ex.plans] == [[], [], [], ["A"], ["B", "C"]]
    assert_all_released(core, ex)


def test_max_num_seqs_is_respected() -> None:
    core, ex = make_core(32, max_num_seqs=2)
    for i, request_id in enumerate("ABCD"):
        submit(core, request_id, prompt(10 * i + 10, 3), max_tokens=2)
    record(core.step(), {})
    stats = core.step().stats
    assert (stats.num_running, stats.num_waiting) == (0, 2)   # A and B done, C and D queued
    out = run_all(core)
    assert schedule_of(ex) == [[("A", 3), ("B", 3)], [("A", 1), ("B", 1)],
                               [("C", 3), ("D", 3)], [("C", 1), ("D", 1)], []]
    assert out["D"].token_ids == [103, 104]
    assert_all_released(core, ex)


def test_waiting_queue_is_fcfs_even_when_a_later_request_would_fit() -> None:
    # 6 blocks of 4. A takes 4-5 blocks; B (3 blocks) must wait, and C (1 block) behind it
    # must not jump the queue although it would fit.
    core, ex = make_core(6)
    submit(core, "A", prompt(10, 16), max_tokens=4)
    submit(core, "B", prompt(40, 12), max_tokens=1)
    submit(core, "C", prompt(60, 2), max_tokens=1)
    out = run_all(core)
    assert schedule_of(ex) == [[("A", 16)], [("A", 1)], [("A", 1)], [("A", 1)],
                               [("B", 12), ("C", 2)], []]
    assert out["B"].token_ids == [112] and out["C"].token_ids == [102]
    assert_all_released(core, ex)


# --- preemption --------------------------------------------------------------------------

def preemption_workload(core: EngineCore) -> None:
    submit(core, "A", prompt(10, 8), max_tokens=8)
    submit(core, "B", prompt(30, 8), max_tokens=8)
    submit(core, "C", prompt(50, 4), max_tokens=2)


def test_preemption_of_the_latest_admitted_and_resume_with_same_tokens() -> None:
    # 6 blocks of 4: A and B (8 + 8 tokens each) can't both reach 13 tokens.
    core, ex = make_core(6, content_token, max_num_seqs=2)
    preemption_workload(core)
    out: dict[str, Outcome] = {}
    for _ in range(6):                     # at step 6 both need a 4th block; none is free
        record(core.step(), out)
    assert schedule_of(ex)[5] == [("A", 1)]
    assert ex.plans[5].forget_ids == ["B"]            # the workers forget B at once
    assert [r.request_id for r in core.scheduler.waiting] == ["B", "C"]   # front of queue
    assert core.scheduler.stats().num_preemptions == 1
    assert len(out["B"].token_ids) == 5 and out["B"].finish_reason is None
    run_all(core, out)
    # Step 7: B does not fit yet (and C waits behind it); step 9, after A is done, it resumes
    # with its 5 tokens so far, 2 blocks of them still in the prefix cache.
    assert schedule_of(ex)[6:9] == [[("A", 1)], [("A", 1)], [("B", 5), ("C", 4)]]
    resumed = ex.plans[8].new_requests[0]
    assert resumed.request_id == "B"
    assert (len(resumed.token_ids), resumed.num_output_tokens,
            resumed.num_computed_tokens) == (13, 5, 8)
    assert ex.plans[8].forget_ids == ["A"]
    assert_all_released(core, ex)
    # B's recomputed blocks went back into the prefix cache: all 3 full blocks of its
    # first 13 tokens are hits again (the 4th block would hold the last token).
    probe = Request("probe", prompt(30, 8) + out["B"].token_ids[:5], SamplingParams())
    assert len(core.block_manager.find_cached_blocks(probe)) == 3

    baseline_core, baseline_ex = make_core(64, content_token, max_num_seqs=2)
    preemption_workload(baseline_core)
    baseline = run_all(baseline_core)
    assert baseline_core.scheduler.stats().num_preemptions == 0
    assert {k: (v.token_ids, v.finish_reason) for k, v in out.items()} == \
        {k: (v.token_ids, v.finish_reason) for k, v in baseline.items()}
    assert [len(v.token_ids) for v in out.values()] == [8, 8, 2]


def test_random_workload_matches_an_unconstrained_run() -> None:
    # Tight blocks and budget force chunking, prefix sharing and preemption; the outputs must
    # equal those of a run with room for everything.
    rng = random.Random(1234)
    prefixes = [prompt(200 + 40 * i, 12) for i in range(3)]
    workload = []
    for i in range(14):
        body = rng.choice(prefixes)[:rng.randint(0, 12)] + prompt(600 + 7 * i, rng.randint(1, 14))
        workload.append((f"r{i}", body, rng.randint(1, 14)))

    def run(num_blocks: int, **config: int) -> tuple[dict[str, Outcome], int]:
        core, ex = make_core(num_blocks, content_token, max_model_len=48, **config)
        for request_id, tokens, max_tokens in workload:
            submit(core, request_id, tokens, max_tokens=max_tokens)
        out = run_all(core)
        assert_all_released(core, ex)
        return out, core.scheduler.stats().num_preemptions

    tight, num_preemptions = run(12, max_num_seqs=4, max_num_batched_tokens=8)
    roomy, _ = run(400, max_num_seqs=64, max_num_batched_tokens=1000)
    assert num_preemptions > 0
    assert {k: (v.token_ids, v.finish_reason) for k, v in tight.items()} == \
        {k: (v.token_ids, v.finish_reason) for k, v in roomy.items()}
    assert all(v.finish_reason in ("stop", "length") for v in tight.values())


# --- prefix caching ----------------------------------------------------------------------

def test_num_cached_tokens_counts_shared_full_blocks() -> None:
    core, ex = make_core(64)
    first = prompt(400, 10)
    submit(core, "first", first, max_tokens=4)
    assert run_all(core)["first"].num_cached_tokens == 0
    cases = {
        "two_blocks": (first[:8] + [7, 7, 7], 8),
        "same_prompt": (first, 8),                  # block 2 is partial in the prompt
        "exactly_two_blocks": (first[:8], 4),       # the last token is never a hit
        "one_block": (first[:4] + [9] * 6, 4),
        "first_token_differs": ([9] + first[1:], 0),
    }
    num_prompt_tokens, num_hits = 10, 0
    for request_id, (tokens, expected) in cases.items():
        submit(core, request_id, tokens, max_tokens=2)
        out = run_all(core)
        assert out[request_id].num_cached_tokens == expected, request_id
        assert ex.plans[-3].new_requests[0].num_computed_tokens == expected
        num_prompt_tokens += len(tokens)
        num_hits += expected
    stats = core.scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (num_prompt_tokens, num_hits)
    assert_all_released(core, ex)


def test_prefix_caching_disabled_computes_everything() -> None:
    core, ex = make_core(64, prefix_caching=False)
    submit(core, "a", prompt(400, 10), max_tokens=2)
    run_all(core)
    submit(core, "b", prompt(400, 10), max_tokens=2)
    out = run_all(core)
    assert out["b"].num_cached_tokens == 0
    assert schedule_of(ex)[-3:] == [[("b", 10)], [("b", 1)], []]
    assert_all_released(core, ex)


# --- stop conditions ---------------------------------------------------------------------

def test_stop_conditions() -> None:
    scripts = {
        "eos": [5, 6, EOS, 7, 8],
        "eos_first": [EOS, 5],
        "ignore_eos": [5, 6, EOS, 7, 8, 9],
        "ignore_eos_stop_id": [5, EOS, 7],
        "stop_id": [5, 6, 7, 8, 9],
        "stop_id_too_late": [5, 6, 7],
    }
    core, ex = make_core(64, scripted(scripts), max_model_len=64)
    p = [10, 11, 12]
    submit(core, "eos", p, max_tokens=10)
    submit(core, "eos_first", p, max_tokens=10)
    submit(core, "ignore_eos", p, max_tokens=5, ignore_eos=True)
    submit(core, "ignore_eos_stop_id", p, max_tokens=3, ignore_eos=True, stop_token_ids=[EOS])
    submit(core, "stop_id", p, max_tokens=10, stop_token_ids=[7, 300])
    submit(core, "stop_id_too_late", p, max_tokens=2, stop_token_ids=[7])
    submit(core, "max_tokens", p, max_tokens=4)
    # Beyond max_model_len (the scheduler's own check; EngineCore would reject it up front).
    core.scheduler.add_request(Request("model_len", prompt(300, 60), SamplingParams(max_tokens=50)))
    out = run_all(core)
    got = {k: (v.token_ids, v.finish_reason) for k, v in out.items()}
    assert got == {
        "eos": ([5, 6, EOS], "stop"),
        "eos_first": ([EOS], "stop"),
        "ignore_eos": ([5, 6, EOS, 7, 8], "length"),
        "ignore_eos_stop_id": ([5, EOS], "stop"),
        "stop_id": ([5, 6, 7], "stop"),
        "stop_id_too_late": ([5, 6], "length"),
        "max_tokens": ([103, 104, 105, 106], "length"),
        "model_len": ([160, 161, 162, 163], "length"),     # 60 + 4 = max_model_len
    }
    assert_all_released(core, ex)


# --- abort -------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_tells_the_workers() -> None:
    core, ex = make_core(32, max_num_seqs=2)
    submit(core, "A", prompt(10, 10), max_tokens=20)    # 3 blocks
    submit(core, "B", prompt(30, 6), max_tokens=5)      # 2 blocks
    submit(core, "W", prompt(50, 3), max_tokens=5)      # waits: max_num_seqs=2
    out: dict[str, Outcome] = {}
    record(core.step(), out)
    record(core.step(), out)
    assert core.scheduler.stats().num_free_blocks == 32 - 5
    core.abort(["A", "W", "unknown"])
    stats = core.scheduler.stats()
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (32 - 2, 1, 0)
    outputs = core.step()
    aborted = [(d.request_id, d.new_token_ids, d.finish_reason)
               for d in outputs.outputs if d.finish_reason == "abort"]
    assert aborted == [("A", [], "abort"), ("W", [], "abort")]
    assert ex.plans[-1].forget_ids == ["A"]           # W never reached the workers
    assert schedule_of(ex)[-1] == [("B", 1)]
    record(outputs, out)
    run_all(core, out)
    assert (len(out["A"].token_ids), out["A"].finish_reason) == (2, "abort")
    assert (out["B"].token_ids, out["B"].finish_reason) == ([106, 107, 108, 109, 110], "length")
    assert all("W" not in p.scheduled_ids for p in ex.plans)
    assert_all_released(core, ex)


# --- rejection ---------------------------------------------------------------------------

def test_bad_requests_get_error_replies_while_others_run() -> None:
    # max_model_len 32; 6 blocks of 4 = 24 tokens of KV.
    core, ex = make_core(6, max_model_len=32)
    submit(core, "good", prompt(10, 4), max_tokens=6)
    out: dict[str, Outcome] = {}
    record(core.step(), out)
    bad = {
        "empty": ([], 16, ["empty"]),
        "too_long": (prompt(10, 40), 1, ["40", "max_model_len=32"]),
        "too_long_total": (prompt(10, 20), 20, ["20", "max_tokens=20", "max_model_len=32"]),
        "out_of_vocab": ([5, VOCAB, 7], 1, [str(VOCAB), "vocabulary"]),
        "negative_id": ([5, -1], 1, ["-1", "vocabulary"]),
        "too_many_blocks": (prompt(10, 20), 8, ["7 KV blocks", "only 6"]),
        "good": (prompt(10, 4), 1, ["'good'", "already in use"]),
    }
    for request_id, (tokens, max_tokens, _) in bad.items():
        submit(core, request_id, tokens, max_tokens=max_tokens)
    outputs = core.step()
    errors = {d.request_id: d for d in outputs.outputs if d.finish_reason == "error"}
    assert set(errors) == set(bad)
    for request_id, (_, _, words) in bad.items():
        delta = errors[request_id]
        assert delta.new_token_ids == [] and delta.error is not None
        assert all(w in delta.error for w in words), (request_id, delta.error)
    # The good request kept going in the same step and finishes normally.
    assert [(d.request_id, d.new_token_ids) for d in outputs.outputs
            if d.finish_reason != "error"] == [("good", [105])]
    record(EngineOutputs([d for d in outputs.outputs if d.finish_reason != "error"],
                         outputs.stats), out)
    run_all(core, out)
    assert (out["good"].token_ids, out["good"].finish_reason) == \
        ([104, 105, 106, 107, 108, 109], "length")
    assert {i for p in ex.plans for i in p.scheduled_ids} == {"good"}
    assert_all_released(core, ex)


def test_a_finished_request_id_can_be_reused() -> None:
    core, ex = make_core(16)
    submit(core, "A", prompt(10, 5), max_tokens=1)
    assert run_all(core)["A"].token_ids == [105]
    submit(core, "A", prompt(10, 5), max_tokens=2)
    submit(core, "B", prompt(10, 3), max_tokens=1)
    record(core.step(), {})
    assert schedule_of(ex)[-1] == [("A", 1), ("B", 3)]   # A's first block is a prefix hit
    submit(core, "B", [1], max_tokens=1)                   # B just finished: its id is free
    out = run_all(core)
    assert (out["A"].token_ids, out["B"].token_ids) == ([106], [101])
    # One plan both forgets the old B and brings the new one: workers forget first.
    reuse = ex.plans[-2]
    assert (reuse.forget_ids, [r.request_id for r in reuse.new_requests]) == (["B"], ["B"])
    assert reuse.new_requests[0].token_ids == [1]
    assert_all_released(core, ex)
