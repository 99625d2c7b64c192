"""The scheduler: one token budget per step, running requests first, then waiting ones (FCFS).

Invariant, checked at the end of every step (`check`):
  * every running request holds blocks for all its computed tokens, and running <= max_num_seqs;
  * a waiting request holds no blocks;
  * the block manager's references are exactly the blocks held by running requests.
There are no prefill and decode phases: each request's `num_computed_tokens` chases its
`num_tokens`; chunked prefill is a request given fewer tokens than it lacks, decode is a request
one token behind. When a running request cannot get a block, the most recently admitted running
request is preempted (blocks freed, recomputed later) and goes to the front of the queue.

A step's tokens count as computed from the moment it is planned (`num_computed_tokens`
advances in `_make_plan`); a step that reaches a request's end will sample a token, counted in
`num_pending` until `update` learns its id. With async scheduling the next plan is made while
a step runs: a request with a pending token is one token behind `num_tokens + num_pending`
and decodes that unknown token, which the worker holds (docs/design.md, "Async scheduling").

Speculative decoding (kvflow/core/speculative.py): a decode may also carry draft tokens, which
take budget and KV slots like any token; `update` keeps the accepted ones. Rejected drafts
leave nothing behind: `update` takes them off `num_computed_tokens` and `token_ids` only ever
holds accepted tokens, so no block hash covers a rejected one, and their KV slots are written
again later.
"""
from __future__ import annotations

import time
from collections import deque

from kvflow.core.block_manager import BlockManager
from kvflow.core.request import Request, Status
from kvflow.core.speculative import Speculator
from kvflow.ipc.messages import (ContinuingRequestData, EngineStats, FinishReason,
                                 NewRequestData, RequestDelta, StepPlan, StepResult)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (),
                 speculator: Speculator | None = None, async_scheduling: bool = False) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order
        self.requests: dict[str, Request] = {}
        self.forget_ids: list[str] = []       # for the workers, with the next plan
        self.num_preemptions = 0
        self.speculator = speculator
        # Async scheduling: the worker appends the tokens it samples itself (plans never
        # carry them back), and a plan may be made while the previous step runs.
        self.async_scheduling = async_scheduling
        # This step's drafts by request id: how many, and their tokens where EngineCore
        # proposed them (ngram; a draft model's come from worker rank 0).
        self.num_drafts: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- schedule --------------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan, list[Request]]:
        """Pick this step's batch and build the plan (a diff against the workers' state)."""
        batch: list[tuple[Request, int]] = []
        budget = self.max_num_batched_tokens
        budget, preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._schedule_waiting(batch, budget)
        plan = self._make_plan(batch)
        return plan, [request for request, _ in batch]

    def _schedule_running(self, batch: list[tuple[Request, int]], budget: int) -> tuple[int, bool]:
        preempted = False
        speculate = self.speculator is not None and self.speculator.enabled(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._lacking(request), budget)
            if num_new == 0:          # its last token is still being sampled
                i += 1
                continue
            if speculate and num_new == 1 and self._draft(request, budget):
                num_new = 1 + self.num_drafts[request.request_id]
                batch.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            while not self.block_manager.allocate(request, num_new):
                victim = self.running.pop()           # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                batch.append((request, num_new))
                budget -= num_new
                i += 1
        return budget, preempted

    def _lacking(self, request: Request) -> int:
        """Tokens to compute for the request to reach its end, counting the pending ones;
        none when the pending token is its last (max_tokens, max_model_len)."""
        if request.num_pending and (
                request.num_output_tokens + request.num_pending
                >= request.sampling_params.max_tokens
                or request.num_tokens + request.num_pending >= self.max_model_len):
            return 0
        return request.num_tokens + request.num_pending - request.num_computed_tokens

    def _draft(self, request: Request, budget: int) -> bool:
        """Give a decoding request its drafts, if it has any and their blocks fit (else it
        decodes one token as usual)."""
        assert self.speculator is not None
        num_drafts, drafts = self.speculator.propose(request, budget - 1)
        if not num_drafts or not self.block_manager.allocate(request, 1 + num_drafts):
            return False
        self.num_drafts[request.request_id] = num_drafts
        if drafts is not None:
            self.drafts[request.request_id] = drafts
        return True

    def _schedule_waiting(self, batch: list[tuple[Request, int]], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.block_manager.find_cached_blocks(request)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:     # first admission: count it for the stats
                request.num_cached_tokens = num_cached
                if request.arrival_time:
                    request.queue_seconds = max(0.0, time.time() - request.arrival_time)
                self.block_manager.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.status = Status.RUNNING
            self.running.append(request)
            batch.append((request, num_new))
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_pending = 0           # a token sampled in flight is dropped (`update`)
        request.num_registered_blocks = 0
        request.status = Status.WAITING
        request.on_worker = False
        self.forget_ids.append(request.request_id)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _make_plan(self, batch: list[tuple[Request, int]]) -> StepPlan:
        new, cached = [], []
        for request, _ in batch:
            if not request.on_worker:
                new.append(NewRequestData(
                    request.request_id, list(request.token_ids), list(request.block_ids),
                    request.num_computed_tokens, request.sampling_params,
                    request.num_output_tokens))
                request.on_worker = True
            else:
                cached.append(ContinuingRequestData(
                    request.request_id, request.token_ids[request.num_tokens_sent:],
                    request.block_ids[request.num_blocks_sent:], request.num_computed_tokens))
            request.num_tokens_sent = request.num_tokens
            request.num_blocks_sent = len(request.block_ids)
        masked_ids = []                   # constrained requests that sample this step
        for request, n in batch:          # planned = computed; reaching the end samples
            request.num_computed_tokens += n
            if (request.num_computed_tokens - self.num_drafts.get(request.request_id, 0)
                    == request.num_tokens + request.num_pending):
                request.num_pending += 1
                if request.grammar is not None:
                    masked_ids.append(request.request_id)
        plan = StepPlan(new, cached, [r.request_id for r, _ in batch], [n for _, n in batch],
                        self.forget_ids, masked_ids, num_spec_tokens=self.num_drafts,
                        spec_token_ids=self.drafts)
        self.forget_ids = []
        self.num_drafts, self.drafts = {}, {}
        return plan

    # --- update ----------------------------------------------------------------------------

    def update(self, plan: StepPlan, batch: list[Request],
               result: StepResult) -> list[RequestDelta]:
        """Advance the batch by what was computed, append sampled tokens, finish requests."""
        counts = result.num_sampled or [1] * len(result.request_ids)
        sampled, at = {}, 0
        for request_id, count in zip(result.request_ids, counts):
            sampled[request_id] = (at, count)
            at += count
        deltas = []
        for request in batch:
            # Finished, aborted or preempted since planned (async scheduling): its token is
            # dropped. (A request preempted while a step of its runs is admitted again only
            # after that step's update: the plan that preempts admits nobody.)
            if request.status != Status.RUNNING:
                continue
            where = sampled.get(request.request_id)
            if where is None:                # a prefill chunk that did not reach the end yet
                self.block_manager.cache_computed_blocks(request)
                continue
            at, count = where
            request.num_pending -= 1
            num_drafts = plan.num_spec_tokens.get(request.request_id, 0)
            if num_drafts:
                assert self.speculator is not None and 1 <= count <= num_drafts + 1
                self.speculator.record(request, num_drafts, count - 1)
            # Accepted drafts have KV now; rejected ones' slots are simply written again.
            request.num_computed_tokens -= num_drafts - (count - 1)
            new_ids = []
            for token_id in result.sampled_token_ids[at:at + count]:
                request.token_ids.append(token_id)
                new_ids.append(token_id)
                self._check_stop(request, token_id)
                if request.finish_reason is not None:     # never emit past a stop
                    break
            if self.async_scheduling:        # the worker appended what it sampled itself
                request.num_tokens_sent += count
            self.block_manager.cache_computed_blocks(request)
            logprobs = (result.logprobs[at:at + len(new_ids)]
                        if result.logprobs is not None
                        and request.sampling_params.logprobs is not None else None)
            deltas.append(RequestDelta(request.request_id, new_ids, request.finish_reason,
                                       logprobs, request.num_cached_tokens,
                                       queue_seconds=(request.queue_seconds
                                                      if request.num_output_tokens
                                                      == len(new_ids) else 0.0),
                                       error=request.grammar.error if request.grammar else None))
            if request.finish_reason is not None:
                self._finish(request)
        self.check()
        return deltas

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        # Below min_tokens the sampler masks EOS and stop ids; vLLM never stops on them there.
        stop_ids_apply = request.num_output_tokens >= params.min_tokens
        if stop_ids_apply and ((not params.ignore_eos and token_id in self.eos_token_ids)
                               or (params.stop_token_ids and token_id in params.stop_token_ids)):
            request.finish_reason = FinishReason.STOP
        elif (request.num_output_tokens >= params.max_tokens
              or request.num_tokens >= self.max_model_len):
            request.finish_reason = FinishReason.LENGTH
        if request.grammar is not None and request.grammar.accept(token_id):
            # Complete (nothing may follow), or failed (the delta carries its error).
            request.finish_reason = (FinishReason.ERROR if request.grammar.error
                                     else request.finish_reason or FinishReason.STOP)

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = Status.FINISHED
        self.forget_ids.append(request.request_id)
        del self.requests[request.request_id]

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> list[RequestDelta]:
        """Remove the requests at once, freeing their blocks; unknown ids are ignored. One
        pass over the waiting queue, however many are aborted. `reason` ERROR with `error`
        fails them instead (a step that raised)."""
        deltas = []
        leaving: set[str] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == Status.RUNNING:
                self.running.remove(request)
                self.block_manager.free(request)
                self.forget_ids.append(request_id)
            else:                       # a waiting request is never on the workers
                leaving.add(request_id)
            request.status = Status.FINISHED
            request.finish_reason = reason
            del self.requests[request_id]
            deltas.append(RequestDelta(request_id, [], reason, error=error))
        if leaving:
            self.waiting = deque(r for r in self.waiting if r.request_id not in leaving)
        return deltas

    # --- invariant and stats ---------------------------------------------------------------

    def check(self) -> None:
        assert len(self.running) <= self.max_num_seqs, (len(self.running), self.max_num_seqs)
        block_size = self.block_manager.block_size
        for r in self.running:
            assert len(r.block_ids) * block_size >= r.num_computed_tokens, r
        assert all(not r.block_ids for r in self.waiting), "a waiting request holds blocks"
        held = sum(len(r.block_ids) for r in self.running)
        assert held == self.block_manager.total_refs, (held, self.block_manager.total_refs)
        self.block_manager.check()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            kv_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            **(self.speculator.stats() if self.speculator is not None else {}))
