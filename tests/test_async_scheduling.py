"""Async scheduling (docs/design.md): EngineCore plans step N+1 while step N runs.

With the fake workers of test_scheduler.py (which check every computed token's KV against the
block tables before each step), queued as real workers queue plans: a plan runs when it is
collected, in order, and the fake worker appends its own sampled tokens, as the real one does
under async scheduling. Outputs must equal the synchronous engine's exactly; the plans must
be the expected ones (planned ahead, none past max_tokens, one wasted after a stop).
"""
from __future__ import annotations

import random
from collections import deque

import msgspec
import pytest

from kvflow.core.engine_core import EngineCore
from kvflow.ipc.messages import StepPlan, StepResult
from test_scheduler import (EOS, FakeExecutor, Outcome, TokenFn, assert_all_released,
                            content_token, count_token, make_config, prompt, record, run_all,
                            schedule_of, scripted, submit)


class AsyncFakeExecutor(FakeExecutor):
    """Plans queue up and run in order when collected; sampled tokens stay with the worker."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.queue: deque[StepPlan] = deque()
        self.max_queued = 0

    def submit(self, plan: StepPlan) -> None:
        self.plans.append(plan)              # in the order sent (execute appends it again)
        self.queue.append(plan)
        self.max_queued = max(self.max_queued, len(self.queue))

    def send_masks(self, bitmask: bytes) -> None:
        raise AssertionError("no constrained requests here")

    def collect(self) -> StepResult:
        result = super().execute(self.queue.popleft())
        self.plans.pop()
        at = 0
        for request_id in result.request_ids:     # one token each: no drafts here
            if request_id in self.requests:
                self.requests[request_id].token_ids.append(result.sampled_token_ids[at])
            at += 1
        return result


def make_core(num_blocks: int, token_fn: TokenFn = count_token, async_scheduling: bool = True,
              **config: int | bool) -> tuple[EngineCore, FakeExecutor]:
    cfg = make_config(**config)  # type: ignore[arg-type]
    cfg = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(
        cfg.scheduler, async_scheduling=async_scheduling))
    executor = (AsyncFakeExecutor if async_scheduling else FakeExecutor)(num_blocks, cfg,
                                                                         token_fn)
    return EngineCore(cfg, executor), executor


def outcomes(out: dict[str, Outcome]) -> dict[str, tuple[list[int], str | None]]:
    return {k: (v.token_ids, v.finish_reason) for k, v in out.items()}


def test_steps_are_planned_one_ahead_and_never_past_max_tokens() -> None:
    core, ex = make_core(32)
    submit(core, "A", prompt(10, 6), max_tokens=3)
    out: dict[str, Outcome] = {}
    record(core.step(), out)
    assert schedule_of(ex) == [[("A", 6)]] and out == {}      # sent, not waited for
    record(core.step(), out)
    # The second plan was made before the first token was known: it decodes that token,
    # which the worker holds, so the plan carries no token ids.
    assert schedule_of(ex) == [[("A", 6)], [("A", 1)]]
    assert ex.plans[1].continuing_requests[0].new_token_ids == []
    assert out["A"].token_ids == [106]
    run_all(core, out)
    # Three tokens, three computing plans (the third token is the last: nothing after it
    # is planned), then the plan that forgets A.
    assert schedule_of(ex) == [[("A", 6)], [("A", 1)], [("A", 1)], []]
    assert ex.plans[-1].forget_ids == ["A"]
    assert outcomes(out) == {"A": ([106, 107, 108], "length")}
    assert isinstance(ex, AsyncFakeExecutor) and ex.max_queued == 2
    assert_all_released(core, ex)


def test_a_stop_wastes_one_planned_step_and_emits_nothing_after_it() -> None:
    core, ex = make_core(32, scripted({"S": [5, EOS, 7, 8], "L": [5, 6, 7, 8, 9, 10]}))
    submit(core, "S", prompt(10, 4), max_tokens=10)
    submit(core, "L", prompt(20, 4), max_tokens=6)
    out = run_all(core)
    assert outcomes(out) == {"S": ([5, EOS], "stop"), "L": ([5, 6, 7, 8, 9, 10], "length")}
    # S's EOS (sampled in plan 2) was unknown when plan 3 was made: plan 3 computes S's
    # next token, which is dropped; plan 4 forgets S.
    assert [("S" in p.scheduled_ids) for p in ex.plans] == [True, True, True, False, False,
                                                             False, False]
    assert [p.forget_ids for p in ex.plans] == [[], [], [], ["S"], [], [], ["L"]]
    assert_all_released(core, ex)


def test_abort_while_a_step_of_the_request_runs() -> None:
    core, ex = make_core(32)
    submit(core, "A", prompt(10, 10), max_tokens=20)
    submit(core, "B", prompt(30, 6), max_tokens=5)
    out: dict[str, Outcome] = {}
    for _ in range(3):
        record(core.step(), out)
    assert len(out["A"].token_ids) == 2          # plans 1-3 sent, 1 and 2 answered
    core.abort(["A"])
    assert core.scheduler.stats().num_free_blocks == 32 - 2   # A's blocks back at once
    record(core.step(), out)                   # plan 3's token for A is dropped
    assert ex.plans[3].forget_ids == ["A"] and "A" in ex.plans[2].scheduled_ids
    submit(core, "C", prompt(10, 10), max_tokens=3)    # A's prefix: its cached blocks
    run_all(core, out)
    assert (len(out["A"].token_ids), out["A"].finish_reason) == (2, "abort")
    assert outcomes(out)["B"] == ([106, 107, 108, 109, 110], "length")
    assert out["C"].num_cached_tokens == 8 and out["C"].token_ids == [110, 111, 112]
    assert_all_released(core, ex)


def test_a_dead_worker_names_each_running_request_once() -> None:
    """The worker dies while two plans of the same requests are in flight: StepFailure names
    each request once (the supervisor counts one crash per request, docs/design.md
    "Self-healing": a request named twice would reach its poison limit in one crash)."""
    from kvflow.core.engine_core import StepFailure
    core, ex = make_core(32)
    submit(core, "A", prompt(10, 4), max_tokens=20)
    submit(core, "B", prompt(30, 4), max_tokens=20)
    for _ in range(3):
        core.step()

    def dead() -> StepResult:
        raise RuntimeError("worker 0 died with exit code -9")
    ex.collect = dead                                         # type: ignore[method-assign]
    with pytest.raises(StepFailure) as failure:
        core.step()
    assert sorted(failure.value.request_ids) == ["A", "B"]


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_equals_the_synchronous_engine(seed: int) -> None:
    # Tight blocks and budget: chunked prefills, prefix hits, preemption of requests whose
    # step is running, stops (content_token samples EOS now and then) and max_model_len.
    rng = random.Random(seed)
    prefixes = [prompt(200 + 40 * i, 12) for i in range(3)]
    workload = []
    for i in range(16):
        body = rng.choice(prefixes)[:rng.randint(0, 12)] + prompt(600 + 7 * i, rng.randint(1, 14))
        workload.append((f"r{i}", body, rng.randint(1, 20)))

    def run(async_scheduling: bool, num_blocks: int, **config: int
            ) -> tuple[dict[str, Outcome], int]:
        core, ex = make_core(num_blocks, content_token, async_scheduling, max_model_len=40,
                             **config)
        for request_id, tokens, max_tokens in workload:
            submit(core, request_id, tokens, max_tokens=max_tokens)
        out = run_all(core)
        assert_all_released(core, ex)
        return out, core.scheduler.stats().num_preemptions

    tight, num_preemptions = run(True, 12, max_num_seqs=4, max_num_batched_tokens=8)
    roomy, _ = run(True, 400, max_num_seqs=64, max_num_batched_tokens=1000)
    sync, _ = run(False, 12, max_num_seqs=4, max_num_batched_tokens=8)
    assert num_preemptions > 0
    assert outcomes(tight) == outcomes(sync) == outcomes(roomy)
    assert {v.finish_reason for v in tight.values()} == {"stop", "length"}


# --- the real worker ---------------------------------------------------------------------

class QueuedWorker:
    """A real Worker behind the async executor protocol, in this process: plans queue up and
    run in order when collected, as a worker process runs them one after another, with the
    masks that followed each."""

    def __init__(self, worker) -> None:  # type: ignore[no-untyped-def]
        self.worker = worker
        self.num_blocks = worker.num_blocks
        self.queue: deque[StepPlan] = deque()
        self.masks: deque[bytes] = deque()
        self.log: list[tuple[StepPlan, StepResult]] = []

    def submit(self, plan: StepPlan) -> None:
        self.queue.append(plan)

    def send_masks(self, bitmask: bytes) -> None:
        self.masks.append(bitmask)

    def collect(self) -> StepResult:
        plan = self.queue.popleft()
        bitmask = self.masks.popleft() if plan.masked_ids else b""
        result = self.worker.execute(plan, (lambda: bitmask) if plan.masked_ids else None)
        self.log.append((plan, result))
        return result

    def execute(self, plan: StepPlan, masks=None) -> StepResult:  # type: ignore[no-untyped-def]
        raise AssertionError("an async EngineCore only submits and collects")


def run_requests(core: EngineCore, requests: list) -> dict[str, Outcome]:  # type: ignore[type-arg]
    for request in requests:
        core.add_request(request)
    out: dict[str, Outcome] = {}
    for _ in range(2000):
        if not core.has_work() and not core.structured.compiling:
            break
        if not core.has_work():
            core.structured.wait(0.1)
        record(core.step(), out)
    assert not core.has_work()
    record(core.step(), out)             # the plan that makes the worker forget the last
    assert not core.has_work()
    return out


@pytest.fixture(scope="module")
def real_core(default_model: str):  # type: ignore[no-untyped-def]
    from kvflow.config import make_engine_config
    from kvflow.workers.worker import Worker
    config = make_engine_config(default_model, dtype="float32", kv_cache_memory_gb=0.05,
                                max_model_len=256, async_scheduling=True)
    worker = Worker(config)
    yield EngineCore(config, QueuedWorker(worker)), worker


def test_real_worker_gives_the_synchronous_engines_tokens(real_core, default_model: str  # type: ignore[no-untyped-def]
                                                          ) -> None:
    """The real worker (float32, fused decode) keeping its sampled tokens: greedy with EOS
    stops, seeded sampling, penalties, logprobs and a JSON-constrained request (its masks
    sent after the previous step's token is accepted) give exactly the tokens of the
    synchronous in-process engine."""
    import json

    import jsonschema

    from kvflow import LLM, SamplingParams
    from kvflow.ipc.messages import EngineRequest
    from kvflow.sampling_params import StructuredOutputsParams
    core, worker = real_core
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))]
               for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30),
              SamplingParams(temperature=0.7, seed=5, max_tokens=30, presence_penalty=0.5,
                             repetition_penalty=1.2, logprobs=3),
              SamplingParams(temperature=0.5, seed=1, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=20)]
    with LLM(default_model, in_process=True, dtype="float32", kv_cache_memory_gb=0.05,
             max_model_len=256) as llm:
        # The last request stops at its 6th token (a stop id), unknown when its 7th is planned.
        free = llm.generate(prompts[5], params[5], use_tqdm=False)[0].token_ids
        params[5] = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free[5]])
        expected = llm.generate(prompts, params, use_tqdm=False)
    out = run_requests(core, [EngineRequest(f"r{i}", p, sp)
                              for i, (p, sp) in enumerate(zip(prompts, params))])
    assert [(out[f"r{i}"].token_ids, out[f"r{i}"].finish_reason) for i in range(6)] == \
        [(e.token_ids, e.finish_reason) for e in expected]
    assert expected[5].finish_reason == "stop" and len(expected[5].token_ids) <= 6
    assert expected[4].finish_reason == "stop"
    jsonschema.validate(json.loads(expected[4].text), schema)
    assert worker.runner.requests == {}


def test_a_step_that_raises_fails_its_requests_and_the_planned_step_skips_them(real_core  # type: ignore[no-untyped-def]
                                                                              ) -> None:
    """The worker raises in a step holding token id 4242; the step planned after it (already
    sent) names the same requests: the worker skips them, EngineCore fails exactly that
    step's requests, and the next request runs."""
    from kvflow import SamplingParams
    from kvflow.ipc.messages import EngineRequest
    from kvflow.workers import model_runner
    core, worker = real_core
    original = model_runner.ModelRunner.execute

    def poisoned(self, plan, masks=None):  # type: ignore[no-untyped-def]
        if any(4242 in new.token_ids for new in plan.new_requests):
            raise RuntimeError("a poisoned batch (test)")
        return original(self, plan, masks)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        model_runner.ModelRunner.execute = poisoned  # type: ignore[method-assign]
        out = run_requests(core, [EngineRequest("bad", [1, 4242, 3], greedy),
                                  EngineRequest("bad2", [5, 6, 7], greedy)])
        assert {k: (v.token_ids, v.finish_reason) for k, v in out.items()} == {
            "bad": ([], "error"), "bad2": ([], "error")}
        log = core.executor.log[-3:]     # the failed step, the one planned after it, forget
        assert [(p.scheduled_ids, r.error is not None, r.request_ids) for p, r in log] == [
            (["bad", "bad2"], True, []), (["bad", "bad2"], False, []), ([], False, [])]
        assert log[-1][0].forget_ids == ["bad", "bad2"]
        good = run_requests(core, [EngineRequest("good", [5, 6, 7], greedy)])["good"]
    finally:
        model_runner.ModelRunner.execute = original  # type: ignore[method-assign]
    assert good.finish_reason == "length" and len(good.token_ids) == 6
    assert worker.runner.requests == {} and worker.runner.dropped == set()


def test_cluster_with_async_scheduling(default_model: str) -> None:
    """EngineCore and a worker process (plans queued in the worker's socket, masks after
    them): a constrained request, a seeded one and greedy ones give the in-process
    synchronous engine's tokens; the options that cannot overlap are refused by name."""
    from kvflow import LLM, SamplingParams
    from kvflow.sampling_params import StructuredOutputsParams
    prompts = ["A sentence:", "The capital of France is", "def f(x):"]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=
                             StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*\.")),
              SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.7, seed=1, max_tokens=24, logprobs=2)]
    options = dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)
    with LLM(default_model, in_process=True, **options) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
    with LLM(default_model, async_scheduling=True, **options) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in got] == \
        [(o.token_ids, o.finish_reason) for o in expected]
    # Batches may differ (a step planned ahead), so float32 sums may round differently.
    for mine, theirs in zip(got[2].logprobs or [], expected[2].logprobs or []):
        assert mine.keys() == theirs.keys()
        assert mine == pytest.approx(theirs, abs=1e-4)
    for bad, name in (({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                      ({"speculative_method": "ngram"}, "speculative"),
                      ({"in_process": True}, "in_process")):
        with pytest.raises(ValueError, match=name):
            LLM(default_model, async_scheduling=True, **{**options, **bad})  # type: ignore[arg-type]


def test_auto_is_decided_by_the_worker_on_where_it_can_overlap(default_model: str) -> None:
    """None ("auto") stays undecided until the worker knows its device, and the worker turns
    it on (CPU as CUDA: one rank, no speculation); it is off wherever it cannot overlap
    (tensor parallelism, speculative decoding, in-process) or when asked."""
    from kvflow.config import make_engine_config
    from kvflow.frontend.engine_client import InProcessEngine
    from kvflow.workers.worker import Worker
    auto = make_engine_config(default_model, kv_cache_memory_gb=0.05, max_model_len=256)
    assert auto.scheduler.async_scheduling is None
    assert make_engine_config(default_model, device="cpu", kv_cache_memory_gb=0.05,
                              max_model_len=256).scheduler.async_scheduling is None
    for off in ({"tensor_parallel_size": 3}, {"speculative_method": "ngram"},
                {"async_scheduling": False}):
        assert make_engine_config(default_model, **off).scheduler.async_scheduling is False
    assert Worker(auto).async_scheduling is True     # what WorkerReady reports to EngineCore
    engine = InProcessEngine(auto)                 # auto in-process: the synchronous engine
    assert engine.worker.async_scheduling is False and engine.core.running is None
