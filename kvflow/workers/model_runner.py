"""Turns a step plan into tensors, runs the model, samples. Keeps per-request state.

The worker's view of a request is its token ids, its block table and how many tokens have KV
in the cache; plans only carry what changed, so this state must follow every plan exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import msgspec
import numpy as np
import torch

from kvflow.core.speculative import accept
from kvflow.ipc.messages import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.workers.attention import AttentionBackend, AttentionMetadata, SeqSpan, to_device
from kvflow.workers.cuda_graphs import DecodeGraphs
from kvflow.workers.draft_model import Drafter
from kvflow.workers.fused_decode import FusedDecode
from kvflow.workers.greedy_head import GreedyHead
from kvflow.workers.models.llama import LlamaForCausalLM
from kvflow.workers.sampler import Sampler, SamplingBatch


@dataclass
class RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    blocks: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """block_ids as an array (for the attention metadata), remade when they grow"""


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [num_tokens]
    positions: torch.Tensor        # [num_tokens]
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None   # [num_rows] packed rows whose logits are sampled;
    #                                    None: every row (the first len(sampling) rows), in order
    sampled_request_ids: list[str]
    sampling: SamplingBatch        # one row per logits row
    # Per sampled request: its drafts (speculative decoding; their rows follow its first).
    drafts: list[list[int]]
    graph_batch: int = 0           # > 0: replay the decode CUDA graph of this (padded) batch
    fused: bool = False            # a small decode step for FusedDecode (CPU)


class WorkerTimes:
    """Seconds per phase summed over steps: where a worker's time goes."""

    def __init__(self) -> None:
        self.prepare = 0.0
        self.forward = 0.0
        self.sample = 0.0


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, sampler: Sampler,
                 is_driver: bool, device: torch.device, dtype: torch.dtype,
                 drafter: Drafter | None = None, keeps_tokens: bool = False) -> None:
        self.model = model
        self.dtype = dtype
        self.backend = backend             # cache layout, attention metadata and kernels
        self.block_size = backend.block_size
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None   # set by capture_cuda_graphs (CUDA only)
        self.fused: FusedDecode | None = None     # decode steps in one C call (CPU only)
        # Steps whose rows are all plain greedy: their tokens without the whole LM head
        # (workers/greedy_head.py; CPU, bfloat16 panels or pair panels, or one-row steps
        # beside AMX tiles).
        self.greedy: GreedyHead | None = None
        self.is_driver = is_driver         # rank 0: samples and replies
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.times = WorkerTimes()
        self._byte_bias: torch.Tensor | None = None   # structured outputs' mask expansion
        # Speculative decoding with a draft model (workers/draft_model.py): it proposes the
        # drafts that the plan counts; without one they come in the plan (ngram).
        self.drafter = drafter
        # Async scheduling (one rank): the tokens this runner samples are appended to its
        # requests at once, since the next plan was made before they were known.
        self.keeps_tokens = keeps_tokens
        # Requests whose step raised: EngineCore fails them, but a plan already sent may
        # still name them (async scheduling); they are skipped until forgotten.
        self.dropped: set[str] = set()

    def apply_plan(self, plan: StepPlan) -> StepPlan:
        """Follow the plan; returns it without the dropped requests (if there are any)."""
        for request_id in plan.forget_ids:
            self.requests.pop(request_id, None)
            self.dropped.discard(request_id)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                len(new.token_ids) - new.num_output_tokens, new.sampling_params)
        for continuing in plan.continuing_requests:
            if continuing.request_id in self.dropped:
                continue
            state = self.requests[continuing.request_id]
            state.token_ids.extend(continuing.new_token_ids)
            state.block_ids.extend(continuing.new_block_ids)
            state.num_computed_tokens = continuing.num_computed_tokens
        if not self.dropped or not self.dropped.intersection(plan.scheduled_ids):
            return plan
        kept = [(i, n) for i, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens)
                if i not in self.dropped]
        return msgspec.structs.replace(plan, scheduled_ids=[i for i, _ in kept],
                                       num_scheduled_tokens=[n for _, n in kept])

    def drop(self, request_ids: list[str]) -> None:
        """A step of these requests raised: their state may be half-updated; forget them now
        and skip them in plans sent before EngineCore learned it."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.dropped.add(request_id)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, masks: Callable[[], bytes] | None = None) -> StepResult:
        """`masks`: the bitmask rows of plan.masked_ids (structured outputs), asked for once
        the logits are computed (in the cluster they arrive while the forward runs)."""
        t0 = time.perf_counter()
        plan = self.apply_plan(plan)
        drafts = (plan.spec_token_ids if self.drafter is None
                  else self.drafter.propose(plan, self.requests))
        if not plan.scheduled_ids:
            return StepResult([], [])
        inputs = self.prepare(plan, drafts)
        t1 = time.perf_counter()
        hidden = self.forward(inputs)
        if inputs.logits_rows is not None:
            hidden = hidden[inputs.logits_rows]
        elif hidden.shape[0] != len(inputs.sampling.params):
            hidden = hidden[:len(inputs.sampling.params)]    # a padded graph batch's rows
        greedy = (self.greedy(hidden) if self.greedy is not None and self.greedy.takes(
            inputs.sampling.params, bool(plan.masked_ids)) else None)
        logits = self.model.compute_logits(hidden) if greedy is None else None
        t2 = time.perf_counter()
        result = StepResult([], [])
        if self.is_driver and (logits is not None or greedy is not None):
            sampling = inputs.sampling
            if greedy is not None:              # plain greedy rows: the same tokens
                ids, logprobs = greedy, None
            else:
                assert logits is not None
                if plan.masked_ids:
                    assert masks is not None, "a plan with masked_ids needs its masks"
                    sampling = self._with_masks(sampling, inputs, plan.masked_ids, masks(),
                                                logits.shape[-1])
                ids, logprobs = self.sampler(logits, sampling)
            result = StepResult(inputs.sampled_request_ids, ids, logprobs)
            if plan.num_spec_tokens:
                result = self._accept(result, inputs.drafts)
            if self.keeps_tokens:                # no drafts here (config.py refuses them)
                for request_id, token_id in zip(result.request_ids, ids):
                    self.requests[request_id].token_ids.append(token_id)
        t3 = time.perf_counter()
        self.times.prepare += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        return result

    @staticmethod
    def _accept(result: StepResult, drafts: list[list[int]]) -> StepResult:
        """Speculative decoding: each request's rows hold the samples after its last token
        and after each draft; keep the accepted prefix plus one (speculative.accept)."""
        ids: list[int] = []
        counts: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if result.logprobs is not None else None
        row = 0
        for request_drafts in drafts:
            rows = len(request_drafts) + 1
            kept = accept(request_drafts, result.sampled_token_ids[row:row + rows])
            ids.extend(kept)
            if logprobs is not None:
                assert result.logprobs is not None
                logprobs.extend(result.logprobs[row:row + len(kept)])
            counts.append(len(kept))
            row += rows
        return StepResult(result.request_ids, ids, logprobs, num_sampled=counts)

    def _with_masks(self, sampling: SamplingBatch, inputs: StepInputs, masked_ids: list[str],
                    bitmask: bytes, vocab: int) -> SamplingBatch:
        """The batch with the constrained rows' mask bias ([rows, vocab], 0 where allowed,
        -inf elsewhere), expanded from the bitmask a byte at a time by a table lookup (a
        bool masked_fill of the same rows costs ~10x more on CPU). Constrained requests
        never draft: one row each."""
        row_of, row = {}, 0
        for request_id, drafts in zip(inputs.sampled_request_ids, inputs.drafts):
            row_of[request_id] = row
            row += 1 + len(drafts)
        data = np.frombuffer(bitmask, dtype=np.uint8).reshape(len(masked_ids), -1)
        if len(row_of) < len(masked_ids) and self.dropped:      # rows of dropped requests
            keep = [j for j, i in enumerate(masked_ids) if i in row_of]
            masked_ids, data = [masked_ids[j] for j in keep], data[keep]
        if self._byte_bias is None:       # byte value -> its 8 tokens' bias
            bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                 bitorder="little")
            self._byte_bias = torch.from_numpy(
                np.where(bits == 1, 0.0, -np.inf).astype(np.float32)).to(self.device)
        index = torch.from_numpy(data.astype(np.int64)).to(self.device)
        bias = torch.nn.functional.embedding(index, self._byte_bias).view(len(masked_ids), -1)
        if bias.shape[1] < vocab:                  # a tokenizer smaller than the model's rows
            bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=-np.inf)
        bias = bias[:, :vocab]
        bias[torch.from_numpy(~data.any(axis=1)).to(self.device)] = 0.0   # none allowed: failed
        return replace(sampling, masked_rows=[row_of[i] for i in masked_ids], mask_bias=bias)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.graph_batch:
            assert self.graphs is not None
            return self.graphs.replay(inputs.graph_batch)    # [graph_batch, hidden]
        if inputs.fused:
            assert self.fused is not None
            return self.fused.forward(inputs.input_ids, inputs.positions, inputs.meta)  # type: ignore[arg-type]
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        """Capture decode graphs for a ladder of batch sizes; returns the sizes."""
        graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, max_model_len,
                              self.device)
        graphs.capture()
        self.graphs = graphs
        return graphs.batch_sizes

    # --- input preparation -------------------------------------------------------------

    def prepare(self, plan: StepPlan, spec_token_ids: dict[str, list[int]] | None = None
                ) -> StepInputs:
        """The step's tensors; `spec_token_ids`: each drafting request's drafts."""
        block_size = self.block_size
        # Flat lists, one array each at the end: a decode row is a few int operations, not
        # a handful of numpy calls (one request's step spent 0.4 ms here on a CPU).
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes: list[SeqSpan] = []
        prefills: list[SeqSpan] = []
        logits_rows, sampled_request_ids, params, out_pos = [], [], [], []
        token_ids: list[list[int]] = []    # references, for the sampler's penalties
        all_drafts: list[list[int]] = []
        row = 0
        for request_id, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens):
            state = self.requests[request_id]
            drafts = spec_token_ids.get(request_id, []) if spec_token_ids else []
            start = state.num_computed_tokens
            end = start + n
            if len(state.blocks) != len(state.block_ids):       # grew: every block_size tokens
                state.blocks = np.asarray(state.block_ids, dtype=np.int64)
            if n == 1 and not drafts:
                input_ids.append(state.token_ids[start])
                positions.append(start)
                slots.append(state.block_ids[start // block_size] * block_size
                             + start % block_size)
                decodes.append(SeqSpan(row, 1, end, state.blocks))
            else:
                input_ids += state.token_ids[start:end - len(drafts)]
                input_ids += drafts
                pos = np.arange(start, end)
                positions += range(start, end)
                slots += (state.blocks[pos // block_size] * block_size
                          + pos % block_size).tolist()
                (decodes if n == 1 else prefills).append(SeqSpan(row, n, end, state.blocks))
            state.num_computed_tokens = end     # the next plan says how many were accepted
            if end - len(drafts) == len(state.token_ids):   # reached the end: sample
                sampled_request_ids.append(request_id)
                all_drafts.append(drafts)
                first = end - len(drafts)       # the position after each known/draft token
                for j in range(len(drafts) + 1):
                    logits_rows.append(row + n - 1 - len(drafts) + j)
                    params.append(state.sampling_params)
                    out_pos.append(first + j - state.num_prompt_tokens)
                    # Penalties at a draft's row see the drafts before it (a copy, only then).
                    token_ids.append(state.token_ids + drafts[:j]
                                     if j and state.sampling_params.processes_logits
                                     else state.token_ids)
            row += n
        sampling = SamplingBatch(params, out_pos, token_ids)
        # Every row sampled, in order (a decode-only step): no gather.
        rows = (None if len(logits_rows) == row
                else self._tensor(np.asarray(logits_rows, dtype=np.int64)))
        ids, pos, slot_mapping = (np.array(a, dtype=np.int64)
                                  for a in (input_ids, positions, slots))
        if self.graphs is not None and not prefills and self.graphs.fits(decodes):
            batch = self.graphs.load(ids, pos, slot_mapping, decodes)
            return StepInputs(self.graphs.input_ids[:batch], self.graphs.positions[:batch],
                              self.graphs.metadata[batch], rows, sampled_request_ids, sampling,
                              all_drafts, batch)
        meta = self.backend.build_metadata(slot_mapping, decodes, prefills)
        # Fused: decodes and drafts' verifications, not prefill chunks (a prompt's prefill
        # then rounds the same alone and in a batch).
        chunks = len(prefills) - sum(1 for drafts in all_drafts if drafts)
        fused = self.fused is not None and not chunks and self.fused.fits(len(ids))
        return StepInputs(self._tensor(ids), self._tensor(pos), meta, rows, sampled_request_ids,
                          sampling, all_drafts, fused=fused)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """The largest step the scheduler can send, for measuring peak memory: `num_tokens`
        prompt tokens (in sequences of at most max_model_len) through the model, then logits
        and sampling for max_num_seqs rows. Needs a bound KV cache of `profile_num_blocks`."""
        block_size = self.block_size
        seq_len, num_seqs = self._profile_shape(num_tokens, max_num_seqs, max_model_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        pos = np.arange(seq_len)
        spans: list[SeqSpan] = []
        slots = []
        for i in range(num_seqs):
            blocks = np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq)
            spans.append(SeqSpan(i * seq_len, seq_len, seq_len, blocks))
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        meta = self.backend.build_metadata(np.concatenate(slots), [], spans)
        ids = self._tensor(np.zeros(num_seqs * seq_len, dtype=np.int64))
        hidden = self.model(ids, self._tensor(np.tile(pos, num_seqs)), meta)
        logits = self.model.compute_logits(hidden[-1:].expand(max_num_seqs, -1))
        if logits is not None:                        # a throwaway sampler: no RNG state used
            # Penalties too: their [rows, vocab] tensors count towards the peak.
            params = [SamplingParams(temperature=1.0, top_p=0.9, logprobs=1, min_tokens=1,
                                     repetition_penalty=1.1, frequency_penalty=0.1)
                      ] * max_num_seqs
            Sampler(0, self.device, eos_token_ids=[0])(
                logits, SamplingBatch(params, [0] * max_num_seqs, [[0]] * max_num_seqs))

    def profile_num_blocks(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        seq_len, num_seqs = self._profile_shape(num_tokens, max_num_seqs, max_model_len)
        return num_seqs * -(-seq_len // self.block_size)

    @staticmethod
    def _profile_shape(num_tokens: int, max_num_seqs: int, max_model_len: int
                       ) -> tuple[int, int]:
        seq_len = min(max_model_len, num_tokens)
        return seq_len, max(1, min(num_tokens // seq_len, max_num_seqs))

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
