"""SamplingParams: what a user asks of one request's decoding, validated at the boundary."""
from __future__ import annotations

import msgspec

# The most top logprobs a request may ask for; the sampler computes a top-k of this size.
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Decoding settings of one request. temperature 0 means greedy.

    `logprobs=k` returns, per generated token, a dict token id -> logprob of the top k tokens
    plus the sampled one (log-softmax of the raw logits, before temperature or masks).
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
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop={self.stop!r} must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
