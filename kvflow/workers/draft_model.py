"""Speculative decoding with a draft model (speculative_method="draft_model"): worker rank 0
runs a smaller model with the target's tokenizer and proposes each drafting request's tokens
at the start of the step, before the target verifies them (kvflow/core/speculative.py decides
who drafts and how many; this module only makes the tokens).

The draft has its own KV cache (its own layers, heads and head size; kvflow/workers/
kv_cache.py) on the target's block tables: block b of a request holds the target's KV in the
target's cache and the draft's in the draft's. So the block manager, the prefix cache and
preemption serve both, and a block costs both models' bytes (on rank 0).

`DraftModel.propose` runs, each step:
  1. one forward of the draft over the known tokens it has not computed, for every request
     that drafts this step or computes a prefill chunk: the chunk itself, or a drafting
     decode's last token plus whatever it missed (accepted drafts it had not fed itself,
     tokens decoded while it did not draft). A plain decode skips the draft, so a request
     that is not drafting (paused for poor acceptance, or a large batch) costs nothing here;
  2. for the requests that draft this step, the argmax at their last row is the first draft,
     and k - 1 one-token forwards, each fed the draft before, give the rest.
Blocks where the target has KV that the draft may lack are kept in `stale`; a request that
reuses blocks from the prefix cache trusts the draft's KV only up to the first stale one, so
the draft's KV is right wherever it is read, and positions fed with drafts that were then
rejected are written again once their real tokens come. Drafts are argmaxes: a one-hot
proposal, which the target's acceptance turns into exact rejection sampling and which keeps a
seeded request's tokens the same with and without speculation. (A draft sampled from its
distribution would be accepted more often at high temperature, but would change which
uniform decides each token.) A catch-up is one forward of all the tokens it missed, however
many: the price of a draft that skips plain decodes.

With tensor parallelism the draft runs unsharded on rank 0 alone, and the other ranks receive
its tokens in one broadcast per step (`DraftReceiver`): every rank must feed the target the
same tokens, and the draft is too small to be worth a collective per layer.
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol

import numpy as np
import torch
import torch.distributed as dist

from kvflow.ipc.messages import StepPlan
from kvflow.workers.attention import SeqSpan, to_device
from kvflow.workers.kv_cache import KVCache
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.models.llama import LlamaForCausalLM


class RequestTokens(Protocol):
    """What the draft reads of the model runner's per-request state (model_runner.py)."""
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class Drafter(Protocol):
    def propose(self, plan: StepPlan, requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]: ...


class _Span:
    """One scheduled request's draft work this step."""

    def __init__(self, request_id: str, start: int, end: int, num_drafts: int,
                 blocks: np.ndarray) -> None:
        self.request_id = request_id
        self.start, self.end = start, end     # known tokens [start, end) the draft computes
        self.num_drafts = num_drafts
        self.blocks = blocks
        self.drafts: list[int] = []


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache,
                 argmax: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 tp: TPGroup) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = kv_cache.backend
        self.block_size = self.backend.block_size
        self.argmax = argmax
        self.device = device
        self.tp = tp
        self.computed: dict[str, int] = {}       # tokens whose draft KV is right
        self.fed: dict[str, list[int]] = {}      # drafts fed after those, not yet confirmed
        self.clean: dict[str, int] = {}          # leading blocks already taken off `stale`
        # Blocks where the target may have KV that the draft lacks (the draft skipped those
        # decode steps): a request reusing them from the prefix cache recomputes the
        # draft's KV from the first of them.
        self.stale: set[int] = set()

    @torch.inference_mode()
    def propose(self, plan: StepPlan, requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        """The drafts of every request in `plan.num_spec_tokens` (the model runner has
        applied the plan to `requests` already)."""
        self._follow(plan, requests)
        scheduled = list(zip(plan.scheduled_ids, plan.num_scheduled_tokens))
        # A plain decode skips the draft, which catches up when that request drafts again.
        spans = [self._span(request_id, n, plan.num_spec_tokens.get(request_id, 0),
                            requests[request_id])
                 for request_id, n in scheduled
                 if n > 1 or request_id in plan.num_spec_tokens]
        drafting = [s for s in spans if s.num_drafts]
        if spans:
            self._forward_known(spans, drafting, requests)
        for j in range(1, max((s.num_drafts for s in drafting), default=0)):
            self._forward_drafts([s for s in drafting if s.num_drafts > j], j)
        for s in spans:
            self.computed[s.request_id] = s.end
            self.fed[s.request_id] = s.drafts[:-1]
        for request_id, n in scheduled:       # the target's KV after this step, drafts too
            state = requests[request_id]
            self._mark(request_id, state.block_ids, state.num_computed_tokens + n)
        drafts = {s.request_id: s.drafts for s in drafting}
        if self.tp.size > 1 and drafting:
            flat = torch.tensor([t for s in drafting for t in s.drafts], dtype=torch.int64,
                                device=self.device)
            dist.broadcast(flat, src=0, group=self.tp.group)
        return drafts

    def _follow(self, plan: StepPlan, requests: Mapping[str, RequestTokens]) -> None:
        """Forget what the workers forget; a new (or preempted and resumed) request's draft
        KV is its prefix-cache hits up to the first stale block."""
        for request_id in plan.forget_ids:
            for state in (self.computed, self.fed, self.clean):
                state.pop(request_id, None)
        for new in plan.new_requests:
            fresh = 0
            while fresh < len(new.block_ids) and new.block_ids[fresh] not in self.stale:
                fresh += 1
            self.computed[new.request_id] = min(new.num_computed_tokens,
                                                fresh * self.block_size)
            self.fed[new.request_id] = []
            self.clean[new.request_id] = 0

    def _mark(self, request_id: str, block_ids: list[int], target_end: int) -> None:
        """The target has (or may have, for drafts) KV below `target_end`, the draft below
        its `computed`: the blocks in between are stale, those wholly below are not."""
        bs, computed = self.block_size, self.computed[request_id]
        clean = self.clean[request_id]
        if computed // bs > clean:
            self.stale.difference_update(block_ids[clean:computed // bs])
            self.clean[request_id] = computed // bs
        if target_end > computed:
            self.stale.update(block_ids[computed // bs:-(-target_end // bs)])

    def _span(self, request_id: str, n: int, num_drafts: int, state: RequestTokens) -> _Span:
        end = state.num_computed_tokens + n - num_drafts       # known tokens after this step
        start, fed = self.computed[request_id], self.fed[request_id]
        matched = 0                         # fed drafts that the verification accepted
        while (matched < len(fed) and start + matched < end - 1
               and state.token_ids[start + matched] == fed[matched]):
            matched += 1
        start += matched
        assert start < end, (request_id, start, end)
        return _Span(request_id, start, end, num_drafts,
                     np.asarray(state.block_ids, dtype=np.int64))

    def _forward_known(self, spans: list[_Span], drafting: list[_Span],
                       requests: Mapping[str, RequestTokens]) -> None:
        """Step 1: every span's known tokens; the drafting spans' first draft."""
        ids, positions, rows, row = [], [], [], 0
        decodes: list[SeqSpan] = []
        prefills: list[SeqSpan] = []
        for s in spans:
            n = s.end - s.start
            ids.append(np.asarray(requests[s.request_id].token_ids[s.start:s.end],
                                  dtype=np.int64))
            positions.append(np.arange(s.start, s.end))
            (decodes if n == 1 else prefills).append(SeqSpan(row, n, s.end, s.blocks))
            if s.num_drafts:
                rows.append(row + n - 1)
            row += n
        first = self._run(np.concatenate(ids), np.concatenate(positions), decodes, prefills,
                          rows)
        for s, token in zip(drafting, first):
            s.drafts.append(token)

    def _forward_drafts(self, spans: list[_Span], j: int) -> None:
        """Step 2: each span's latest draft at its position, giving draft j + 1."""
        ids = np.asarray([s.drafts[-1] for s in spans], dtype=np.int64)
        positions = np.asarray([s.end + j - 1 for s in spans], dtype=np.int64)
        decodes = [SeqSpan(i, 1, s.end + j, s.blocks) for i, s in enumerate(spans)]
        for s, token in zip(spans, self._run(ids, positions, decodes, [],
                                             list(range(len(spans))))):
            s.drafts.append(token)

    def _run(self, ids: np.ndarray, positions: np.ndarray, decodes: list[SeqSpan],
             prefills: list[SeqSpan], rows: list[int]) -> list[int]:
        """A draft forward; the argmax token at each of `rows`."""
        slots = self._slots(positions, decodes + prefills)
        meta = self.backend.build_metadata(slots, decodes, prefills)
        hidden = self.model(to_device(ids, self.device), to_device(positions, self.device),
                            meta)                                   # [tokens, hidden]
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[to_device(np.asarray(rows), self.device)])
        assert logits is not None, "the draft is unsharded"
        return self.argmax(logits).tolist()

    def _slots(self, positions: np.ndarray, spans: list[SeqSpan]) -> np.ndarray:
        """Each token's KV slot: its position in its request's blocks (rows in span order)."""
        table = np.empty(len(positions), dtype=np.int64)
        for span in spans:
            at = slice(span.first_row, span.first_row + span.num_query_tokens)
            pos = positions[at]
            table[at] = span.block_ids[pos // self.block_size] * self.block_size \
                + pos % self.block_size
        return table


class DraftReceiver:
    """Ranks other than 0: the draft model's tokens arrive in one broadcast per step."""

    def __init__(self, tp: TPGroup, device: torch.device) -> None:
        self.tp = tp
        self.device = device

    def propose(self, plan: StepPlan, requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        counts = [(request_id, plan.num_spec_tokens[request_id])
                  for request_id in plan.scheduled_ids if request_id in plan.num_spec_tokens]
        if not counts:
            return {}
        flat = torch.empty(sum(n for _, n in counts), dtype=torch.int64, device=self.device)
        dist.broadcast(flat, src=0, group=self.tp.group)
        tokens, drafts, at = flat.tolist(), {}, 0
        for request_id, n in counts:
            drafts[request_id] = tokens[at:at + n]
            at += n
        return drafts
