"""A request's state inside EngineCore: its tokens, its progress, its blocks."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvflow.ipc.messages import FinishReason
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.core.grammar import Grammar
    from kvflow.core.speculative import _RequestSpec


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Tokens so far (prompt + output) and how many of them have KV in the cache.

    `num_computed_tokens` chases `num_tokens`: a prefill is a request far behind, a decode is a
    request one token behind. It counts the tokens of every planned step, from the moment it is
    planned; `num_pending` counts the tokens those steps will sample (docs/design.md, "Async
    scheduling"). `block_hashes[i]` is the chained hash of full block i.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float = 0.0,
                 output_token_ids: list[int] | None = None) -> None:
        """`output_token_ids`: what a request resumed after an engine restart had produced;
        it is computed again like a preempted request's."""
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids) + list(output_token_ids or ())
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.status = Status.WAITING
        self.num_computed_tokens = 0      # with KV, or computed by a step already planned
        # Tokens sampled by steps still running (async scheduling): their ids are not known
        # yet, but the next step may already compute their KV.
        self.num_pending = 0
        self.num_cached_tokens = -1       # set once, when first scheduled
        self.queue_seconds = 0.0          # arrival (frontend's clock) to first scheduling
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0    # leading blocks whose hash is in the prefix cache
        self.finish_reason: FinishReason | None = None
        # Structured outputs: the matcher of its constraint (kvflow/core/grammar.py), set
        # once compiled; the scheduler advances it with each token.
        self.grammar: Grammar | None = None
        # Speculative decoding: its n-gram index and acceptance (kvflow/core/speculative.py).
        self.spec: _RequestSpec | None = None
        # What the worker already knows of this request (plans are diffs against it).
        self.on_worker = False
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
