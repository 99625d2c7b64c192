"""Turns a step plan into tensors, runs the model, samples. Keeps per-request state.

The worker's view of a request is its token ids, its block table and how many tokens have KV
in the cache; plans only carry what changed, so this state must follow every plan exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.ipc.messages import StepPlan, StepResult
from kvflow.kernels.torch_attention import TorchAttnGroup
from kvflow.sampling_params import SamplingParams
from kvflow.workers.layers.attention import AttentionMetadata
from kvflow.workers.models.llama import LlamaForCausalLM
from kvflow.workers.sampler import Sampler, SamplingBatch


@dataclass
class RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [num_tokens]
    positions: torch.Tensor        # [num_tokens]
    meta: AttentionMetadata
    logits_rows: torch.Tensor      # [num_sampled] packed row of each sampling request's last token
    sampled_ids: list[str]
    sampling: SamplingBatch


class StepTimes:
    """Seconds per phase summed over steps: where a worker's time goes."""

    def __init__(self) -> None:
        self.prepare = 0.0
        self.forward = 0.0
        self.sample = 0.0


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, block_size: int, sampler: Sampler,
                 is_driver: bool, device: torch.device, dtype: torch.dtype,
                 kv_shape: tuple[int, int]) -> None:
        self.model = model
        self.dtype = dtype
        self.kv_shape = kv_shape           # (num_kv_heads, head_dim) per rank
        self.block_size = block_size
        self.sampler = sampler
        self.is_driver = is_driver         # rank 0: samples and replies
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.times = StepTimes()

    def apply_plan(self, plan: StepPlan) -> None:
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                len(new.token_ids) - new.num_output_tokens, new.sampling_params)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.apply_plan(plan)
        if not plan.scheduled_ids:
            return StepResult([], [])
        inputs = self.prepare(plan)
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        t2 = time.perf_counter()
        result = StepResult([], [])
        if self.is_driver and logits is not None:
            ids, logprobs = self.sampler(logits.float(), inputs.sampling)
            result = StepResult(inputs.sampled_ids, ids, logprobs)
        t3 = time.perf_counter()
        self.times.prepare += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        return result

    # --- input preparation -------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        # (first packed row, q_len, context_len, block_ids) of each request, by group
        decodes: list[tuple[int, int, int, np.ndarray]] = []
        prefills: list[tuple[int, int, int, np.ndarray]] = []
        logits_rows, sampled_ids, params, out_pos = [], [], [], []
        row = 0
        for request_id, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens):
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + n
            pos = np.arange(start, end)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            (decodes if n == 1 else prefills).append((row, n, end, blocks))
            state.num_computed_tokens = end
            if end == len(state.token_ids):            # reached the end: sample a token
                logits_rows.append(row + n - 1)
                sampled_ids.append(request_id)
                params.append(state.sampling_params)
                out_pos.append(end - state.num_prompt_tokens)
            row += n
        groups = [self._group(g) for g in (decodes, prefills) if g]
        meta = AttentionMetadata(self._tensor(np.concatenate(slots)), groups)
        return StepInputs(self._tensor(np.concatenate(input_ids)),
                          self._tensor(np.concatenate(positions)), meta,
                          self._tensor(np.asarray(logits_rows, dtype=np.int64)),
                          sampled_ids, SamplingBatch(params, out_pos))

    def _group(self, members: list[tuple[int, int, int, np.ndarray]]) -> TorchAttnGroup:
        """Padded gather indices and the causal mask for requests of one group."""
        bs = self.block_size
        max_q = max(m[1] for m in members)
        max_blocks = -(-max(m[2] for m in members) // bs)
        max_kv = max_blocks * bs
        q_index = np.zeros((len(members), max_q), dtype=np.int64)
        block_index = np.zeros((len(members), max_blocks), dtype=np.int64)
        q_valid = np.zeros((len(members), max_q), dtype=bool)
        mask = np.zeros((len(members), max_q, max_kv), dtype=bool)
        kv_pos = np.arange(max_kv)
        for i, (row, q_len, ctx, blocks) in enumerate(members):
            q_index[i, :q_len] = np.arange(row, row + q_len)
            q_valid[i, :q_len] = True
            num_blocks = -(-ctx // bs)
            block_index[i, :num_blocks] = blocks[:num_blocks]
            q_pos = np.arange(ctx - q_len, ctx)
            mask[i, :q_len] = kv_pos[None, :] <= q_pos[:, None]
            mask[i, q_len:, 0] = True     # padded query rows see one slot: no NaN rows
        valid = q_valid.ravel()
        bias = np.where(mask, 0.0, -np.inf).astype(np.float32)[:, :, None, :]
        num_kv_heads, head_dim = self.kv_shape
        buf_shape = (num_kv_heads, block_index.size, bs * head_dim)
        return TorchAttnGroup(
            len(members), max_q, max_kv, self._tensor(q_index.ravel()),
            self._tensor(block_index.ravel()), self._tensor(bias), self._tensor(valid),
            self._tensor(q_index.ravel()[valid]),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device),
            torch.empty(buf_shape, dtype=self.dtype, device=self.device))

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)
