"""SamplingParams: what a user asks of one request's decoding, validated at the boundary."""
from __future__ import annotations

import msgspec

# The most top logprobs a request may ask for; the sampler computes a top-k of this size.
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Decoding settings of one request. temperature 0 means greedy.

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        checks = (
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be None or in [0, {MAX_LOGPROBS}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop={self.stop!r} must not contain empty strings")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """Ids must be >= 0 here; the upper bound (the vocabulary) is check_request's."""
        for token_id, value in (self.logit_bias or {}).items():
            if token_id < 0 or not -100 <= value <= 100:
                raise ValueError(f"SamplingParams.logit_bias[{token_id}]={value!r}: ids must be "
                                 f">= 0 and values in [-100, 100]")

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before sampling."""
        return (self.min_tokens > 0 or bool(self.logit_bias) or self.repetition_penalty != 1.0
                or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
