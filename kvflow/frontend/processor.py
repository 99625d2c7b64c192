"""Turns what a user submitted (text, token ids or chat messages + SamplingParams) into a
checked request, raising ValueError before anything runs. Shared by LLM and the server."""
from __future__ import annotations

import numbers
from typing import Any

from kvflow.config import EngineConfig
from kvflow.core.validation import check_request
from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.sampling_params import SamplingParams

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, num_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages)

    def make_tracker(self, request_id: str, prompt: Prompt, params: SamplingParams
                     ) -> RequestTracker:
        """A tracker for a valid request; ValueError naming the problem otherwise."""
        params.validate()
        text = prompt if isinstance(prompt, str) else None
        if text is None and not (isinstance(prompt, (list, tuple))
                                 and all(isinstance(t, numbers.Integral)
                                         and not isinstance(t, bool) for t in prompt)):
            raise ValueError(f"a prompt is a string or a list of token ids (ints), not "
                             f"{type(prompt).__name__}: {str(prompt)[:80]}")
        token_ids = (self.tokenizer.encode(text) if text is not None
                     else [int(t) for t in prompt])
        error = check_request(token_ids, params, max_model_len=self.config.model.max_model_len,
                              vocab_size=self.config.model.vocab_size,
                              block_size=self.config.cache.block_size,
                              num_blocks=self.num_blocks)
        if error is not None:
            raise ValueError(error)
        output = RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=token_ids)
        return RequestTracker(output, params, self.tokenizer)
