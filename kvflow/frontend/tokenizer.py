"""Tokenizer, chat template and incremental detokenizer, without importing torch.

transformers' fast tokenizers are the `tokenizers` library reading tokenizer.json, and its chat
templates are Jinja rendered in a sandbox; we use the same two pieces directly, because
importing transformers drags torch into the frontend process (tests check we match
transformers' encode and apply_chat_template exactly).
"""
from __future__ import annotations

import json
import os
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, path: str) -> None:
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"model={path!r}: no tokenizer.json in the folder")
        self.tokenizer = HFTokenizer.from_file(tokenizer_file)
        self.config = _read_json(os.path.join(path, "tokenizer_config.json"))
        self.chat_template = self._load_chat_template(path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # The longest text one token can stand for (in characters of its vocabulary entry;
        # byte-level entries hold at least one character per character of text): a text of
        # more than n * this characters is more than n tokens, known without tokenizing it.
        self.max_token_chars = max(
            len(self.tokenizer.id_to_token(i) or "") for i in range(self.vocab_size)) or 1

    def _load_chat_template(self, path: str) -> str | None:
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                return f.read()
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token: str) -> str | None:
        value = self.config.get(token)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @property
    def reads_tools(self) -> bool:
        """Whether the chat template renders `tools` (HF's variable for tool definitions)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        bos, eos = self.token_text("bos_token") or "", self.token_text("eos_token") or ""
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos, tools=tools)
        except (TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
            # e.g. a message without 'role', or a content of the wrong type: a bad request
            raise ValueError(f"chat template: {type(e).__name__}: {str(e)[:200]}") from None

    def stream_decoder(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.tokenizer)


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time (tokenizers' DecodeStream)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text (may be "" while a character is incomplete)."""
        piece = self.stream.step(self.tokenizer, token_id) or ""
        self.text += piece
        return piece


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
