"""Every message that crosses a process boundary, as a msgspec Struct. No pickle on the wire.

Hot-path structs (one per step) are array_like (encoded as arrays, no field names), omit
defaults and skip the garbage collector's tracking.
"""
from __future__ import annotations

import enum

import msgspec

from kvflow.config import EngineConfig
from kvflow.sampling_params import SamplingParams

class FinishReason(str, enum.Enum):
    """Why a request ended; the values are what users see (OpenAI's finish_reason, plus ours)."""
    STOP = "stop"           # EOS, a stop token id or a stop string
    LENGTH = "length"       # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"         # the request was rejected; `error` says why

    def __str__(self) -> str:
        return self.value


# The error of a request whose step raised in a worker: the details are in the logs only.
INTERNAL_ERROR_PREFIX = "internal error:"     # such errors are the server's (HTTP 500)
INTERNAL_ERROR = (f"{INTERNAL_ERROR_PREFIX} the engine failed while computing this request, "
                  "which was stopped (the server's log has the details)")


class _Hot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# --- frontend -> EngineCore ---------------------------------------------------------------

class EngineRequest(_Hot, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # A request resumed after an engine restart: the tokens it had produced (they count
    # against max_tokens and min_tokens, and seeded sampling goes on from their position).
    output_token_ids: list[int] = []


class EngineRequests(_Hot, tag=True):
    """Several requests in one message (an `LLM.generate` batch): EngineCore takes them all in
    before its next step, so the batch's first step does not depend on how fast the frontend
    sent them (a step's batch decides which kernel a product runs on: results of bfloat16
    differ in the last bits between them)."""
    requests: list[EngineRequest]


class Abort(_Hot, tag=True):
    request_ids: list[str]


# --- EngineCore -> frontend ---------------------------------------------------------------

class RequestDelta(_Hot):
    """What one step added to one request."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # Per new token: token id -> logprob (top-k plus the sampled token).
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queue_seconds: float = 0.0       # on a request's first token: arrival to first scheduling


class EngineStats(_Hot):
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0    # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0       # of those, tokens served from it
    num_preemptions: int = 0
    num_received: int = 0            # EngineRequests taken in so far (the frontend's back-pressure)
    # Speculative decoding, totals since start: verifications, draft tokens, accepted ones,
    # and accepted drafts by their position in the draft.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class EngineOutputs(_Hot, tag=True):
    outputs: list[RequestDelta]
    stats: EngineStats


# --- EngineCore -> workers: the step plan, a diff against what the worker already knows ---

class NewRequestData(_Hot):
    """A request the worker has not seen, or one coming back after preemption (full state)."""
    request_id: str
    token_ids: list[int]             # prompt plus any tokens generated before a preemption
    block_ids: list[int]
    num_computed_tokens: int         # tokens whose KV is already in the cache (prefix hits)
    sampling_params: SamplingParams
    num_output_tokens: int = 0       # generated tokens among token_ids (for seeded sampling)


class ContinuingRequestData(_Hot):
    """A request the worker knows: what was appended since the last plan."""
    request_id: str
    new_token_ids: list[int]         # tokens sampled since the last step
    new_block_ids: list[int]
    # Tokens with KV in the cache: the worker's own count may be ahead by the drafts the
    # last step rejected (speculative decoding), which only EngineCore knows on every rank.
    num_computed_tokens: int = 0


class StepPlan(_Hot, tag=True):
    new_requests: list[NewRequestData]
    continuing_requests: list[ContinuingRequestData]
    # The batch, in order: which requests compute how many tokens this step.
    scheduled_ids: list[str]
    num_scheduled_tokens: list[int]
    # Requests to forget before this step (finished, aborted or preempted).
    forget_ids: list[str]
    # Structured outputs: the requests sampling this step under a constraint, in batch
    # order; their token bitmasks follow in a StepMasks, sent while the forward runs.
    masked_ids: list[str] = []
    # Speculative decoding (kvflow/core/speculative.py): how many drafts each drafting request
    # verifies after its last token (its num_scheduled_tokens counts them), and their tokens
    # when EngineCore proposed them (ngram); a draft model's come from worker rank 0
    # (kvflow/workers/draft_model.py).
    num_spec_tokens: dict[str, int] = {}
    spec_token_ids: dict[str, list[int]] = {}


class StepMasks(_Hot, tag=True):
    """The bitmask rows of a plan's masked_ids (int32 words; bit t: token t allowed),
    kvflow/core/grammar.py."""
    bitmask: bytes


class StepResult(_Hot, tag=True):
    """From rank 0: the tokens of each request that reached the end of its tokens: one, or
    with drafts (speculative decoding) the accepted ones plus one, `num_sampled[i]` of them
    for request i (empty: one each); sampled_token_ids and logprobs hold them all in order."""
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    worker_seconds: float = 0.0      # time inside the worker, to measure IPC overhead
    error: str | None = None         # the step raised (its traceback): nothing was sampled
    num_sampled: list[int] = []


# --- control messages ---------------------------------------------------------------------

class _Control(msgspec.Struct, tag=True, omit_defaults=True, array_like=True):
    pass


class WorkerReady(_Control):
    """A worker loaded its shard and allocated its cache."""
    rank: int
    num_blocks: int
    async_scheduling: bool = False     # what "auto" became on this rank's device


class Ping(_Control):
    """EngineCore -> workers until every rank answers Pong: no plan is lost to a slow SUB."""
    seq: int


class Pong(_Control):
    rank: int
    seq: int


class EngineReady(_Control):
    """EngineCore -> frontend: every process is up; requests are accepted from now on."""
    num_blocks: int


class ChildFailed(_Control):
    """A child process failed (at start-up or later); `error` is its message/traceback.
    `request_ids`: the requests of the step during which it failed (the frontend's suspects
    when it restarts the engine), if it failed during one."""
    who: str
    error: str
    request_ids: list[str] = []


class Shutdown(_Control):
    """Stop. `restart`: EngineCore -> a --headless node when EngineCore stops because it
    failed: the frontend will start a new engine, which the node rejoins."""
    restart: bool = False


class ResetPrefixCache(_Control):
    """Frontend -> EngineCore: forget every cached block no request holds."""
    call_id: int


class GetTimings(_Control):
    """Frontend -> EngineCore: seconds per phase summed over steps (the benchmarks')."""
    call_id: int


UtilityCall = ResetPrefixCache | GetTimings      # each answered by a UtilityResult


class UtilityResult(_Control):
    call_id: int
    result: dict[str, float] = {}


class Heartbeat(_Control):
    """Between EngineCore and a --headless node, both ways, while both live (multi-node)."""
    node_rank: int


class ClusterInfo(msgspec.Struct, frozen=True):
    """What rank 0 puts in the torch.distributed store for the other nodes: where EngineCore
    listens, and the configuration every rank must run. `start_id`: random, new at every
    start of the engine, so a node rejoining a restarted engine tells its info from the last
    one's (the old store may still answer for a moment)."""
    plan_address: str
    result_address: str
    control_address: str
    config: EngineConfig
    start_id: str = ""


# What each receiver accepts (a tagged union per socket direction).
ToEngine = EngineRequest | EngineRequests | Abort | ResetPrefixCache | GetTimings | Shutdown
FromEngine = EngineOutputs | EngineReady | ChildFailed | UtilityResult
ToWorker = StepPlan | StepMasks | Ping | Shutdown
FromWorker = StepResult | WorkerReady | Pong | ChildFailed
ToNode = Heartbeat | Shutdown
FromNode = Heartbeat | ChildFailed



# --- client library <-> server (launch.py serve) -----------------------------------------

class ClientRequest(_Control):
    """A prompt as text, token ids or chat messages. sampling_params stays raw until the
    server validates it, so a bad value gets an error reply instead of a dropped message."""
    request_id: str
    sampling_params: msgspec.Raw
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    timeout: float | None = None     # seconds, then aborted (finish_reason "abort")


class ClientAbort(_Control):
    request_id: str


class ClientStatsRequest(_Control):
    request_id: str


ERROR_INVALID = "invalid"          # the request was rejected (ValueError on the client)
ERROR_ENGINE_DEAD = "engine_dead"  # EngineDeadError on the client
ERROR_OVERLOADED = "overloaded"    # EngineOverloadedError on the client: retry later
ERROR_UNAUTHORIZED = "unauthorized"  # PermissionError on the client: wrong or no API key
ERROR_INTERNAL = "internal"        # RuntimeError on the client: the server failed the request


class ClientOutput(_Control):
    """News of one request: new text and tokens (deltas when streaming, else the whole)."""
    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt_token_ids: list[int] | None = None
    error: str | None = None
    error_kind: str | None = None


class ClientStats(_Control):
    request_id: str
    stats: EngineStats


ToServer = ClientRequest | ClientAbort | ClientStatsRequest
FromServer = ClientOutput | ClientStats
