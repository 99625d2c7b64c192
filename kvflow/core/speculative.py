"""Speculative decoding, EngineCore's half: decide who drafts and how many, propose n-gram
drafts, count acceptance.

Two entry points for the scheduler: `Speculator.propose(request, max_drafts)` says how many
drafts a decoding request verifies this step (possibly none) and, with the n-gram method,
which; with a draft model (method "draft_model") the tokens come from worker rank 0, which
runs the draft (kvflow/workers/draft_model.py), and EngineCore only sets their number.
`Speculator.record` takes back how many the workers accepted. The plan carries both
(`StepPlan.num_spec_tokens`, `spec_token_ids`); the worker puts the drafts after the
request's last token, computes the target's logits at every one of those positions and
samples each position exactly as it would without speculation (same seeded uniform per output
position), then keeps the longest prefix where the sample equals the draft, plus the sample
after it (`accept`, below; kvflow/workers/model_runner.py calls it). Both proposers are
one-hot (a lookup; the draft model's argmax), and for a one-hot proposal that is rejection
sampling: a draft x is kept with probability p(x), and on rejection the token comes from p
without x, renormalised. So the tokens are the target's, and a seeded request gives the same
tokens with and without speculation.

n-gram proposals happen here because EngineCore already holds every request's tokens, needs
no torch and would otherwise wait while the workers run: a lookup is a few dict probes.

The n-gram proposer: prompt lookup (vLLM's "ngram"). For n from prompt_lookup_max down to
prompt_lookup_min, the request's last n tokens are looked up among the n-grams that occurred
earlier in its prompt + output (the most recent occurrence wins), and the tokens that followed
it are the drafts. Each request keeps an index from n-gram to where it last ended, extended
with its new tokens, so a lookup costs O(max - min) dict probes, not a scan of its tokens.

When drafting costs more than it brings, it stops: no drafts in a step with more running
requests than `disable_by_batch_size` (the step is compute-bound there, and every rejected
draft costs a full token of work), and a request whose recent acceptance rate falls below
`min_acceptance_rate` stops drafting for PAUSE_TOKENS tokens, then tries again; each pause
that follows a failed try is twice as long (up to MAX_PAUSE_TOKENS), so a request whose
drafts never fit costs almost nothing; a try that is accepted resets it.
"""
from __future__ import annotations

from kvflow.config import SpeculativeConfig
from kvflow.core.request import Request

PAUSE_TOKENS = 32           # a request with poor acceptance drafts again after this many tokens
MAX_PAUSE_TOKENS = 512      # ... doubled after each failed try, up to this
EMA_WEIGHT = 0.3            # of the latest verification in a request's acceptance rate


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification emits: `sampled` (one per position, len(drafts) + 1) up to
    and including the first one that differs from its draft (all of them when none does)."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return sampled[:m + 1]


class _NgramIndex:
    """n-gram (as a tuple) -> the index of the token that followed its latest occurrence."""

    def __init__(self, low: int, high: int) -> None:
        self.sizes = range(high, low - 1, -1)       # longest first
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0        # n-grams ending before this index are in the maps

    def propose(self, tokens: list[int], k: int) -> list[int]:
        end = len(tokens)
        # Index every n-gram that ends before the last token (the suffix itself is looked up,
        # so it must not find itself).
        for e in range(max(self.indexed, 1), end):
            for n in self.sizes:
                if e >= n:
                    self.maps[n][tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        for n in self.sizes:
            if end > n:
                at = self.maps[n].get(tuple(tokens[end - n:end]))
                if at is not None:
                    return tokens[at:at + k]
        return []


class _RequestSpec:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = (_NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.acceptance = 1.0           # recent acceptance rate (an EMA over verifications)
        self.paused_until = 0           # no drafts until num_output_tokens reaches this
        self.pause = PAUSE_TOKENS       # the next pause's length


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # Totals since start (EngineStats -> the kvflow:spec_decode_* metrics).
        self.num_drafts = 0                 # verifications (requests that drafted, per step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def enabled(self, num_running: int) -> bool:
        """Whether this step drafts at all (off when the batch is large)."""
        limit = self.config.disable_by_batch_size
        return limit == 0 or num_running <= limit

    def propose(self, request: Request, max_drafts: int) -> tuple[int, list[int] | None]:
        """(how many drafts, their tokens) for a request one token behind: at most
        `max_drafts` (what is left of the step's token budget); the tokens are None for a
        draft model (worker rank 0 proposes them). None for constrained requests (their
        masks cover one position), past max_tokens or max_model_len, or while paused."""
        if request.grammar is not None or request.sampling_params.structured_outputs:
            return 0, []
        spec = request.spec
        if spec is None:
            spec = request.spec = _RequestSpec(self.config)
        if request.num_output_tokens < spec.paused_until:
            return 0, []
        k = min(self.config.num_speculative_tokens, max_drafts,
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens)
        if k <= 0:
            return 0, []
        if spec.index is None:
            return k, None
        drafts = spec.index.propose(request.token_ids, k)
        return len(drafts), drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        spec = request.spec
        assert spec is not None
        spec.acceptance += EMA_WEIGHT * (num_accepted / num_drafts - spec.acceptance)
        if spec.acceptance < self.config.min_acceptance_rate:
            spec.paused_until = request.num_output_tokens + spec.pause
            spec.pause = min(2 * spec.pause, MAX_PAUSE_TOKENS)
            spec.acceptance = self.config.min_acceptance_rate    # one good round resumes it
        elif num_accepted:
            spec.pause = PAUSE_TOKENS

    def stats(self) -> dict:
        """The EngineStats fields of speculative decoding."""
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": list(self.accepted_per_pos)}
