"""SamplingParams: what a user asks of one request's decoding, validated at the boundary.

`validate` is the one check of every field, for every way in (LLM, the HTTP API, kvflow's ZMQ
clients) and again in EngineCore: each value must be one the engine can carry (an integer
msgpack and torch can hold, a finite float) and within a bound that keeps one request from
costing the others (stop strings, logit_bias entries). Bounds that need the model (token ids
and top_k against the vocabulary) are `kvflow/core/validation.py`'s.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

# The most top logprobs a request may ask for; the sampler computes a top-k of this size.
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5             # temperatures below this sample greedily
MAX_STOP_STRINGS = 32           # stop strings per request (OpenAI allows 4)
MAX_STOP_STRING_CHARS = 512     # characters per stop string (streamed text is held back by it)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300            # logit_bias entries per request (OpenAI's own limit)
MAX_INT32 = 2**31 - 1           # token counts, ids and top_k: far above any real value
SEED_RANGE = (-(2**63), 2**64 - 1)   # what msgpack carries
MAX_GRAMMAR_BYTES = 64 * 1024   # a structured-output constraint, as JSON (schema, grammar, ...)
MAX_CHOICES = 1024              # strings in a `choice` constraint


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one
    of `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object),
    `regex` (the whole output matches it), `choice` (the output is one of the strings) or
    `grammar` (Lark, or llama.cpp's GBNF; llguidance reads both). JSON may have whitespace
    between tokens as pretty-printing has it (a newline and an indent, never a run of blank
    lines: JSON_WHITESPACE in kvflow/core/grammar.py); `whitespace_pattern` is a regex for it
    instead, and `disable_any_whitespace` allows none. kvflow/core/grammar.py compiles the
    constraint; `check` here bounds only its shape."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def check(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(kinds) != 1:
            raise ValueError("SamplingParams.structured_outputs must set exactly one of json, "
                             f"json_object, regex, choice or grammar (got {kinds or 'none'})")
        if self.choice is not None and not (
                1 <= len(self.choice) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be 1 to "
                             f"{MAX_CHOICES} non-empty strings")
        size = len(msgspec.json.encode(self))
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(f"SamplingParams.structured_outputs is {size} bytes as JSON; at "
                             f"most {MAX_GRAMMAR_BYTES} are allowed")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Decoding settings of one request. temperature 0 (or below 1e-5) means greedy.

    `logprobs=k` returns, per generated token, a dict token id -> logprob of the top k tokens
    plus the sampled one (log-softmax of the raw logits, before temperature or masks).

    Before temperature and the masks, in vLLM's order and with its meaning: `min_tokens` masks
    the EOS ids and `stop_token_ids` until that many tokens are out, `logit_bias` (token id ->
    value) is added to the logits, then `repetition_penalty` (HF's: logit / p if positive else
    logit * p, for every token in the prompt or output), `frequency_penalty` and
    `presence_penalty` (OpenAI's: logit -= frequency * count + presence * (count > 0), counting
    output tokens only). Greedy requests take the argmax of these processed logits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False   # keep a matched stop string in the text
    # Constrained decoding (JSON schema, regex, choice, grammar): kvflow/core/grammar.py.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} must be a "
                                 "finite number")
        checks = (
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or 1 <= self.top_k <= MAX_INT32,
             "must be -1 (off) or >= 1 (and at most the vocabulary size)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", 1 <= self.max_tokens <= MAX_INT32,
             "must be >= 1 (and prompt + max_tokens at most max_model_len)"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be None or in [0, {MAX_LOGPROBS}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("seed", self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             "must be a 64-bit integer"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={shorten(getattr(self, name))} {rule}")
        self._validate_stops()
        self._validate_logit_bias()
        if self.structured_outputs is not None:
            self.structured_outputs.check()

    def _validate_stops(self) -> None:
        stop = self.stop or []
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most "
                             f"{MAX_STOP_STRINGS} are allowed")
        for s in stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"SamplingParams.stop={shorten(s)}: a stop string must have 1 "
                                 f"to {MAX_STOP_STRING_CHARS} characters")
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids has {len(ids)} ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
        bad = next((t for t in ids if not 0 <= t <= MAX_INT32), None)
        if bad is not None:
            raise ValueError(f"SamplingParams.stop_token_ids contains {shorten(bad)}: token ids "
                             f"are in [0, {MAX_INT32}]")

    def _validate_logit_bias(self) -> None:
        """Ids must be >= 0 here; the upper bound (the vocabulary) is check_request's."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"SamplingParams.logit_bias has {len(bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")
        for token_id, value in bias.items():
            if not 0 <= token_id <= MAX_INT32 or not -100 <= value <= 100:
                raise ValueError(f"SamplingParams.logit_bias[{shorten(token_id)}]={value!r}: ids "
                                 "must be >= 0 (in the vocabulary) and values in [-100, 100]")

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before sampling."""
        return (self.min_tokens > 0 or bool(self.logit_bias) or self.repetition_penalty != 1.0
                or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below 1e-5 (vLLM's rule): logits / T would overflow or leave
        every other token a probability of 0 in float32 anyway."""
        return self.temperature < GREEDY_BELOW


def shorten(value: object, limit: int = 60) -> str:
    """A value for an error message, cut: a hostile value must not make a huge message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
