"""What users get back, and the per-request state that builds it from engine deltas:
incremental detokenization and stop strings (text is cut before the stop string)."""
from __future__ import annotations

from typing import Callable

import msgspec

from kvflow.frontend.tokenizer import Tokenizer
from kvflow.ipc.messages import FinishReason, RequestDelta
from kvflow.sampling_params import SamplingParams


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestTracker:
    """Follows one request: appends tokens, decodes text, finds stop strings.

    While the request runs, the last (longest stop string - 1) characters are held back from
    streamed text, because they may turn out to be the start of a stop string.
    """

    def __init__(self, output: RequestOutput, params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.output = output
        self.params = params
        self.detokenizer = tokenizer.stream_decoder()
        self.stops = params.stop or []
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.num_text_sent = 0

    def apply(self, delta: RequestDelta,
              abort: Callable[[list[str]], None] | None = None) -> bool:
        """Fold a delta in; returns True when the request is finished. A stop string ends it
        here, where the engine cannot see it: then `abort` tells the engine to stop it."""
        out = self.output
        out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
        if delta.error is not None:
            out.error = delta.error
        for i, token_id in enumerate(delta.new_token_ids):
            out.token_ids.append(token_id)
            if delta.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(delta.logprobs[i])
            if self._add_text(token_id):
                out.finish_reason = FinishReason.STOP
                if abort is not None and delta.finish_reason is None:
                    abort([out.request_id])
                return True
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
        return out.finished

    def _add_text(self, token_id: int) -> bool:
        before = len(self.output.text)
        self.output.text += self.detokenizer.add(token_id)
        # vLLM's rule: stop strings are looked for from the token after the first min_tokens.
        if len(self.output.token_ids) <= self.params.min_tokens:
            return False
        text = self.output.text
        for stop in self.stops:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                keep = len(stop) if self.params.include_stop_str_in_output else 0
                self.output.text = text[:at + keep]
                return True
        return False

    def new_text(self) -> str:
        """Text not streamed yet (all of it once finished, else minus the hold-back)."""
        text = self.output.text
        end = len(text) if self.output.finished else max(0, len(text) - self.hold_back)
        end = max(end, self.num_text_sent)
        piece = text[self.num_text_sent:end]
        self.num_text_sent = end
        return piece
