"""Turns what a user submitted (text, token ids or chat messages + SamplingParams) into a
checked request, raising ValueError before anything runs. Shared by LLM and the server."""
from __future__ import annotations

import numbers
from typing import Any

from kvflow.config import EngineConfig
from kvflow.core.grammar import GrammarCompiler
from kvflow.core.validation import check_request
from kvflow.frontend.api.tool_calls import check_tools, with_tools_in_text
from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.sampling_params import SamplingParams

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, num_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self._grammars: GrammarCompiler | None = None

    def prepare_grammars(self) -> None:
        """A server expects constrained requests: get the grammar engine ready now."""
        self.grammars.prepare()

    @property
    def grammars(self) -> GrammarCompiler:
        """Checks structured-output constraints (built on first use: it loads llguidance's
        view of the tokenizer)."""
        if self._grammars is None:
            model = self.config.model
            self._grammars = GrammarCompiler(model.path, model.vocab_size, model.eos_token_ids,
                                             self.config.grammar_compile_timeout, threads=2)
        return self._grammars

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the chat template; `tools` (OpenAI's tool objects) as the
        server shows them (kvflow/frontend/api/tool_calls.py: to a template that reads
        `tools`, else as a Hermes-style system section)."""
        checked = check_tools(tools) if tools else None
        if self.tokenizer.reads_tools:
            return self.tokenizer.apply_chat_template(messages, tools=checked)
        if checked or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = with_tools_in_text(messages, checked)
        return self.tokenizer.apply_chat_template(messages)

    def make_tracker(self, request_id: str, prompt: Prompt, params: SamplingParams
                     ) -> RequestTracker:
        """A tracker for a valid request; ValueError naming the problem otherwise."""
        return self.make_trackers([request_id], prompt, [params])[0]

    def make_trackers(self, request_ids: list[str], prompt: Prompt,
                      params: list[SamplingParams]) -> list[RequestTracker]:
        """One tracker per SamplingParams (the n choices of one prompt), the prompt tokenized
        once; ValueError naming the problem otherwise. Thread-safe: the server calls it off
        its event loop, since a long prompt takes a while to tokenize."""
        for p in params:
            p.validate()
            if p.structured_outputs is not None:
                self.grammars.check(p.structured_outputs)
        text = prompt if isinstance(prompt, str) else None
        if text is None and not (isinstance(prompt, (list, tuple))
                                 and all(isinstance(t, numbers.Integral)
                                         and not isinstance(t, bool) for t in prompt)):
            raise ValueError(f"a prompt is a string or a list of token ids (ints), not "
                             f"{type(prompt).__name__}: {str(prompt)[:80]}")
        token_ids = (self.encode_prompt(text) if text is not None else [int(t) for t in prompt])
        trackers = []
        for request_id, p in zip(request_ids, params):
            error = check_request(token_ids, p, max_model_len=self.config.model.max_model_len,
                                  vocab_size=self.config.model.vocab_size,
                                  block_size=self.config.cache.block_size,
                                  num_blocks=self.num_blocks)
            if error is not None:
                raise ValueError(error)
            output = RequestOutput(request_id=request_id, prompt=text,
                                   prompt_token_ids=token_ids)
            trackers.append(RequestTracker(output, p, self.tokenizer))
        return trackers

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt; a text too long for max_model_len is refused before
        it is tokenized (it has more tokens than characters / the longest token)."""
        limit = self.config.model.max_model_len
        if len(text) > limit * self.tokenizer.max_token_chars:
            raise ValueError(f"prompt of {len(text)} characters exceeds max_model_len={limit} "
                             f"tokens (it is at least {len(text) // self.tokenizer.max_token_chars}"
                             f" tokens)")
        return self.tokenizer.encode(text)
