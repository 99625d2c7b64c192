"""EngineCore: owns the scheduler and block manager; drives one worker group step by step.

Its loop, one step: take new requests and aborts, schedule, execute the plan, emit outputs.
The executor is anything with `execute(StepPlan) -> StepResult` and `num_blocks`: the
in-process worker, or (in the cluster) a broadcast to the worker processes.
"""
from __future__ import annotations

import time
from typing import Protocol

from kvflow.config import EngineConfig
from kvflow.core.block_manager import BlockManager
from kvflow.core.request import Request
from kvflow.core.scheduler import Scheduler
from kvflow.core.validation import check_request
from kvflow.ipc.messages import (EngineOutputs, EngineRequest, FinishReason, RequestDelta,
                                 ResetPrefixCache, StepPlan, StepResult, UtilityCall, UtilityResult)


class Executor(Protocol):
    num_blocks: int

    def execute(self, plan: StepPlan) -> StepResult: ...


class CoreTimes:
    """Seconds spent per phase, summed over steps (the throughput benchmark prints them)."""

    def __init__(self) -> None:
        self.schedule = 0.0
        self.execute = 0.0
        self.update = 0.0
        self.num_steps = 0


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        cache = config.cache
        self.block_manager = BlockManager(executor.num_blocks, cache.block_size,
                                          cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens,
                                   config.model.max_model_len, config.model.eos_token_ids)
        self.pending: list[RequestDelta] = []   # replies not tied to a step (errors, aborts)
        self.times = CoreTimes()
        self.num_received = 0

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request, or queue an error reply naming what is wrong with it."""
        self.num_received += 1
        error = self.validate(request)
        if error is not None:
            self.pending.append(RequestDelta(request.request_id, [], FinishReason.ERROR,
                                             error=error))
            return
        self.scheduler.add_request(Request(request.request_id, request.prompt_token_ids,
                                           request.sampling_params, request.arrival_time))

    def validate(self, request: EngineRequest) -> str | None:
        if request.request_id in self.scheduler.requests:
            return f"request_id={request.request_id!r} is already in use"
        try:
            request.sampling_params.validate()
        except ValueError as e:
            return str(e)
        model = self.config.model
        return check_request(request.prompt_token_ids, request.sampling_params,
                             max_model_len=model.max_model_len, vocab_size=model.vocab_size,
                             block_size=self.block_manager.block_size,
                             num_blocks=self.block_manager.num_blocks)

    def abort(self, request_ids: list[str]) -> None:
        self.pending.extend(self.scheduler.abort(request_ids))

    def utility(self, call: UtilityCall, executor_timings: dict[str, float] | None = None
                ) -> UtilityResult:
        """The one place utility calls are answered, in both engine modes."""
        if isinstance(call, ResetPrefixCache):
            self.block_manager.reset_prefix_cache()
            return UtilityResult(call.call_id, {})
        t = self.times
        return UtilityResult(call.call_id, {
            "num_steps": t.num_steps, "schedule": t.schedule, "execute": t.execute,
            "update": t.update, **(executor_timings or {})})

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    def step(self) -> EngineOutputs:
        """Schedule one step, execute it, and return every request's news."""
        t0 = time.perf_counter()
        plan, batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        deltas, self.pending = self.pending, []
        if batch or plan.forget_ids:
            result = self.executor.execute(plan)
            t2 = time.perf_counter()
            deltas.extend(self.scheduler.update(plan, batch, result))
            self._record_times(t0, t1, t2)
        stats = self.scheduler.stats()
        stats.num_received = self.num_received
        return EngineOutputs(deltas, stats)

    def _record_times(self, t0: float, t1: float, t2: float) -> None:
        self.times.schedule += t1 - t0
        self.times.execute += t2 - t1
        self.times.update += time.perf_counter() - t2
        self.times.num_steps += 1
