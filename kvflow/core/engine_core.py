"""EngineCore: owns the scheduler and block manager; drives one worker group step by step.

Its loop, one step: take new requests and aborts, schedule, execute the plan, emit outputs.
The executor is anything with `execute(StepPlan) -> StepResult` and `num_blocks`: the
in-process worker, or (in the cluster) a broadcast to the worker processes.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

from kvflow.config import EngineConfig
from kvflow.core.block_manager import BlockManager
from kvflow.core.grammar import StructuredOutputs
from kvflow.core.request import Request
from kvflow.core.speculative import Speculator
from kvflow.core.scheduler import Scheduler
from kvflow.core.validation import check_request
from kvflow.ipc.messages import (INTERNAL_ERROR, EngineOutputs, EngineRequest, EngineStats,
                                 FinishReason, RequestDelta, ResetPrefixCache, StepPlan,
                                 StepResult, UtilityCall, UtilityResult)

if TYPE_CHECKING:
    from kvflow.core.grammar import Grammar

logger = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3     # steps in a row that raise: the worker is broken, not a request


class StepFailure(RuntimeError):
    """A step failed in a way the engine cannot survive; `request_ids` were in it."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class Executor(Protocol):
    num_blocks: int

    def execute(self, plan: StepPlan, masks: Callable[[], bytes] | None = None
                ) -> StepResult:
        """Run the plan; `masks` (when plan.masked_ids is not empty) computes the bitmask
        rows of the constrained requests: call it while the forward runs if you can."""


class AsyncExecutor(Executor, Protocol):
    """Async scheduling: a plan is sent while the previous one runs (the workers queue it)."""

    def submit(self, plan: StepPlan) -> None:
        """Send the plan; with plan.masked_ids, its `send_masks` must follow before the
        next plan."""

    def send_masks(self, bitmask: bytes) -> None: ...

    def collect(self) -> StepResult:
        """The result of the oldest plan submitted and not yet collected."""


class _Running(NamedTuple):
    """A plan sent to the workers and not yet answered (async scheduling)."""
    plan: StepPlan
    batch: list[Request]
    grammars: list[Grammar]          # of plan.masked_ids, in order


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
        speculator = (Speculator(config.speculative, config.model.max_model_len)
                      if config.speculative is not None else None)
        overlap = config.scheduler.async_scheduling    # None: as the workers decided
        if overlap is None:
            overlap = bool(getattr(executor, "async_scheduling", False))
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens,
                                   config.model.max_model_len, config.model.eos_token_ids,
                                   speculator, overlap)
        # Async scheduling (docs/design.md): plans sent and not yet answered, at most two.
        self.running: deque[_Running] | None = deque() if overlap else None
        self.pending: list[RequestDelta] = []   # replies not tied to a step (errors, aborts)
        self.times = CoreTimes()
        self.num_received = 0
        self.failed_steps = 0                   # in a row (a step that raised)
        self.structured = StructuredOutputs(config.model.path, config.model.vocab_size,
                                            config.model.eos_token_ids,
                                            config.grammar_compile_timeout)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request, or queue an error reply naming what is wrong with it."""
        self.num_received += 1
        error = self.validate(request)
        if error is not None:
            self.pending.append(RequestDelta(request.request_id, [], FinishReason.ERROR,
                                             error=error))
            return
        r = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                    request.arrival_time, request.output_token_ids)
        if request.sampling_params.structured_outputs is not None:
            self.structured.add(r)          # waits outside the scheduler until compiled
        else:
            self.scheduler.add_request(r)

    def validate(self, request: EngineRequest) -> str | None:
        if (request.request_id in self.scheduler.requests
                or request.request_id in self.structured.compiling):
            return f"request_id={request.request_id!r} is already in use"
        try:
            request.sampling_params.validate()
        except ValueError as e:
            return str(e)
        model = self.config.model
        if len(request.output_token_ids) >= request.sampling_params.max_tokens:
            return (f"a resumed request with {len(request.output_token_ids)} output tokens "
                    f"has nothing left of max_tokens={request.sampling_params.max_tokens}")
        return check_request(request.prompt_token_ids, request.sampling_params,
                             max_model_len=model.max_model_len, vocab_size=model.vocab_size,
                             block_size=self.block_manager.block_size,
                             num_blocks=self.block_manager.num_blocks)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in self.structured.abort(request_ids):
            self.pending.append(RequestDelta(request_id, [], FinishReason.ABORT))
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
        """Anything to schedule or to say (requests still compiling are not: a compile that
        ends wakes EngineCore's poll through `structured.wakeup_fd`)."""
        return self.scheduler.has_unfinished() or bool(self.pending) or bool(self.running)

    def take_compiled(self) -> None:
        """Queue the constrained requests whose grammar is ready; fail those that failed."""
        if not self.structured.compiling:
            return
        ready, failed = self.structured.collect()
        for request in ready:
            self.scheduler.add_request(request)
        for request_id, error in failed:
            self.pending.append(RequestDelta(request_id, [], FinishReason.ERROR, error=error))

    def step(self) -> EngineOutputs:
        """Schedule one step, execute it, and return every request's news. With async
        scheduling: send the next plan, then apply the result of the one before it."""
        if self.running is not None:
            return self._step_async()
        t0 = time.perf_counter()
        self.take_compiled()
        plan, batch = self.scheduler.schedule()
        grammars = self._grammars(plan)
        masks = (lambda: self.structured.fill_masks(grammars)) if grammars else None
        t1 = time.perf_counter()
        deltas, self.pending = self.pending, []
        if batch or plan.forget_ids:
            try:
                result = self.executor.execute(plan, masks)
            except Exception as e:      # a worker died or hung in this step: name its batch
                raise StepFailure(str(e), list(plan.scheduled_ids)) from e
            t2 = time.perf_counter()
            deltas.extend(self._apply(plan, batch, result))
            self._record_times(t0, t1, t2)
        return EngineOutputs(deltas, self.stats())

    def _step_async(self) -> EngineOutputs:
        """Plan step N+1 while step N runs (its sampled tokens counted as pending), send it,
        then wait for step N's result and apply it. The workers start N+1 as soon as N ends;
        EngineCore's own work (update, outputs, the next plan) overlaps N+1's forward."""
        assert self.running is not None
        executor: AsyncExecutor = self.executor      # type: ignore[assignment]
        t0 = time.perf_counter()
        self.take_compiled()
        plan, batch = self.scheduler.schedule()
        deltas, self.pending = self.pending, []
        sent = bool(batch or plan.forget_ids)
        try:
            if sent:
                executor.submit(plan)
                self.running.append(_Running(plan, batch, self._grammars(plan)))
                if len(self.running) == 1:       # nothing before it: its grammars are current
                    self._send_masks(executor, self.running[0])
            t1 = time.perf_counter()
            if not self.running or (sent and len(self.running) == 1 and plan.scheduled_ids):
                return EngineOutputs(deltas, self.stats())   # to be answered next step
            done = self.running[0]
            result = executor.collect()
            self.running.popleft()
            t2 = time.perf_counter()
            deltas.extend(self._apply(done.plan, done.batch, result))
            if self.running:                     # its grammars now have step N's tokens
                self._send_masks(executor, self.running[0])
        except StepFailure:
            raise
        except Exception as e:          # a worker died or hung: name every running batch
            raise StepFailure(str(e), list(dict.fromkeys(   # each once, though in two steps
                [i for r in self.running for i in r.plan.scheduled_ids]
                + (list(plan.scheduled_ids) if sent else [])))) from e
        self._record_times(t0, t1, t2)
        return EngineOutputs(deltas, self.stats())

    def _send_masks(self, executor: AsyncExecutor, running: _Running) -> None:
        if running.grammars:
            executor.send_masks(self.structured.fill_masks(running.grammars))

    def _grammars(self, plan: StepPlan) -> list[Grammar]:
        """The grammars of the constrained requests sampling this step (plan.masked_ids);
        their bitmask rows go to the workers while the forward runs."""
        return [self.scheduler.requests[i].grammar for i in plan.masked_ids]  # type: ignore[misc]

    def _apply(self, plan: StepPlan, batch: list[Request], result: StepResult
               ) -> list[RequestDelta]:
        if result.error is not None:
            return self._step_failed(plan, result.error)
        self.failed_steps = 0
        return self.scheduler.update(plan, batch, result)

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        stats.num_received = self.num_received
        return stats

    def _step_failed(self, plan: StepPlan, error: str) -> list[RequestDelta]:
        """A live worker's step raised: fail that step's requests, keep serving the rest.
        With several ranks the others may be stuck in a collective rank 0 left, so the
        engine stops instead (WorkerFailure: the frontend restarts it)."""
        self.failed_steps += 1
        if self.config.parallel.tensor_parallel_size > 1:
            raise StepFailure(f"worker 0's step failed with tensor parallelism (the other "
                              f"ranks may be stuck in a collective):\n{error}",
                              list(plan.scheduled_ids))
        if self.failed_steps >= MAX_FAILED_STEPS:     # e.g. a sticky CUDA error: restart
            raise StepFailure(f"{self.failed_steps} steps in a row failed; the worker is "
                              f"broken:\n{error}", list(plan.scheduled_ids))
        logger.error("a step failed; its %d request(s) fail, the engine goes on:\n%s",
                     len(plan.scheduled_ids), error)
        return self.scheduler.abort(list(plan.scheduled_ids), FinishReason.ERROR,
                                    INTERNAL_ERROR)

    def _record_times(self, t0: float, t1: float, t2: float) -> None:
        self.times.schedule += t1 - t0
        self.times.execute += t2 - t1
        self.times.update += time.perf_counter() - t2
        self.times.num_steps += 1
