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
