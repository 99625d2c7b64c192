"""/v1/completions and /v1/chat/completions on the AsyncEngine: one engine request per prompt
and choice, answered whole or as server-sent events in OpenAI's shapes (vLLM's where OpenAI
leaves a choice: choice index = prompt index x n + choice, finish_reason on the chunk that
carries the last text, usage counted once per prompt)."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec

from kvflow.errors import EngineDeadError
from kvflow.frontend.api.protocol import (ApiError, ChatRequest, CompletionRequest,
                                          chat_messages, check_request_shape, choice_params,
                                          completion_prompts, structured_constraint,
                                          value_error)
from kvflow.frontend.api.tool_calls import (ToolError, ToolUse, stream_deltas,
                                            with_tools_in_text)
from kvflow.frontend.async_engine import AsyncEngine, Delta, RequestStream
from kvflow.frontend.processor import Prompt
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.ipc.messages import INTERNAL_ERROR_PREFIX, FinishReason
from kvflow.sampling_params import MAX_LOGPROBS, SamplingParams

_encode = msgspec.json.encode


@dataclass
class Choice:
    index: int
    prompt_index: int
    stream: RequestStream
    echo: str = ""                   # prompt text to put before the output (completions)
    num_text_sent: int = 0           # characters before this chunk (completions' text_offset)
    started: bool = False            # chat: the role was sent
    tool_deltas: Any = None          # chat with tools, streamed: tool_calls.stream_deltas
    num_calls: int = 0               # tool calls sent so far


@dataclass
class Job:
    """One API request: its choices, and what its responses share."""
    kind: str                        # "text_completion" | "chat.completion"
    model: str
    choices: list[Choice] = field(default_factory=list)
    id: str = ""
    created: int = 0
    top_logprobs: int | None = None  # chat: how many alternatives per token
    tools: ToolUse | None = None     # chat: the request's tools (tool_calls.py)

    def __post_init__(self) -> None:
        prefix = "cmpl" if self.kind == "text_completion" else "chatcmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, max_n: int,
                 auto_tool_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_n = max_n
        self.auto_tool_parser = auto_tool_parser   # None: tool_choice "auto" is refused
        self.tokenizer: Tokenizer = engine.processor.tokenizer
        processor = engine.processor
        self.max_context = min(processor.config.model.max_model_len,
                               processor.num_blocks * processor.config.cache.block_size)

    # --- building requests -----------------------------------------------------------------

    def completion_items(self, req: CompletionRequest) -> list[tuple[Prompt, list[SamplingParams]]]:
        """The prompts and their choices' params: cheap checks only (no tokenization)."""
        check_request_shape(req, self.max_n)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs={req.logprobs} must be in [0, {MAX_LOGPROBS}]",
                           "logprobs")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported by "
                                "kvflow", "echo")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, f"best_of={req.best_of} other than n={req.n} is not supported "
                                "by kvflow", "best_of")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = choice_params(req, max_tokens, req.logprobs, structured_constraint(req))
        return [(p, params) for p in completion_prompts(req.prompt)]

    def check_chat(self, req: ChatRequest) -> ToolUse | None:
        """The cheap checks, on the event loop before any work; the request's tool use."""
        check_request_shape(req, self.max_n)
        chat_messages(req)
        try:
            tools = ToolUse.of(req.tools, req.tool_choice, self.auto_tool_parser,
                               req.parallel_tool_calls is not False)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None
        constraint = structured_constraint(req)
        if tools is not None and constraint is not None and tools.constraint() is not None:
            raise ApiError(400, f"tool_choice={tools.mode!r} constrains the output, and so "
                                "does response_format/structured_outputs: send one", "tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs={top} must be in [0, {MAX_LOGPROBS}]",
                           "top_logprobs")
        return tools

    def chat_items(self, req: ChatRequest, tools: ToolUse | None = None
                   ) -> list[tuple[Prompt, list[SamplingParams]]]:
        """The rendered, tokenized conversation and its choices' params (in the engine's
        pool: a chat template over long messages takes a while)."""
        top = req.top_logprobs or 0
        messages = chat_messages(req)
        native = self.tokenizer.reads_tools
        template_tools = None
        if tools is not None:
            messages, template_tools = tools.template_inputs(messages, native)
        elif not native and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = with_tools_in_text(messages, None)
        try:
            text = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt,
                                                      tools=template_tools)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        prompt = self.engine.processor.encode_prompt(text)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:      # OpenAI: what the context (and here the KV cache) leaves
            if len(prompt) >= self.max_context:
                raise ApiError(400, f"the messages are {len(prompt)} tokens: no room left to "
                                    f"answer in a context of {self.max_context}", "messages")
            max_tokens = self.max_context - len(prompt)
        logprobs = top if req.logprobs else None
        constraint = (tools.constraint() if tools is not None else None) or \
            structured_constraint(req)
        return [(prompt, choice_params(req, max_tokens, logprobs, constraint))]

    async def open(self, job: Job, items: list[tuple[Prompt, list[SamplingParams]]],
                   echo: bool = False, timeout: float | None = None) -> None:
        """Tokenize and check every choice (off the event loop), then submit them all, or
        none: a bad one raises ApiError (EngineDeadError if the engine is gone) before any is
        sent. `close` must follow."""
        try:
            prepared = [await self.engine.prepare(prompt, params) for prompt, params in items]
        except ValueError as e:
            raise value_error(e) from None
        try:
            for prompt_index, trackers in enumerate(prepared):
                for tracker in trackers:
                    stream = self.engine.submit(tracker, timeout)
                    text = self._prompt_text(stream) if echo else ""
                    job.choices.append(Choice(len(job.choices), prompt_index, stream, text))
        except BaseException:
            self.close(job)
            raise

    def close(self, job: Job) -> None:
        """Abort what has not finished (a client that went away, an error)."""
        for c in job.choices:
            if not c.stream.finished:
                self.engine.abort(c.stream.request_id)

    def _prompt_text(self, stream: RequestStream) -> str:
        out = stream.output
        return out.prompt if out.prompt is not None else self.tokenizer.decode(
            out.prompt_token_ids)

    # --- whole responses -------------------------------------------------------------------

    async def respond(self, job: Job) -> dict[str, Any]:
        await asyncio.gather(*(_drain(c.stream) for c in job.choices))
        return {"id": job.id, "object": job.kind, "created": job.created, "model": job.model,
                "choices": [self._whole_choice(job, c) for c in job.choices],
                "usage": self.usage(job)}

    def _whole_choice(self, job: Job, c: Choice) -> dict[str, Any]:
        out = c.stream.output
        if job.kind == "text_completion":
            logprobs = (self.completion_logprobs(c, out.token_ids, out.logprobs)
                        if out.logprobs is not None else None)
            return {"index": c.index, "text": c.echo + out.text, "logprobs": logprobs,
                    "finish_reason": out.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        reason = out.finish_reason
        if job.tools is not None:
            content, calls = job.tools.calls(out.text)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.to_openai() for call in calls]}
            reason = job.tools.finish_reason(reason, bool(calls))
        return {"index": c.index, "message": message,
                "logprobs": self.chat_logprobs(job, out.token_ids, out.logprobs),
                "finish_reason": reason}

    def usage(self, job: Job) -> dict[str, Any]:
        firsts = {c.prompt_index: c.stream.output for c in reversed(job.choices)}
        prompt = sum(len(o.prompt_token_ids) for o in firsts.values())
        completion = sum(len(c.stream.output.token_ids) for c in job.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(
                    o.num_cached_tokens for o in firsts.values())}}

    # --- streams ---------------------------------------------------------------------------

    async def events(self, job: Job, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: chunks as choices advance, the usage chunk, [DONE]. An error
        after the stream started is sent as an error event."""
        try:
            async for c, delta in _merged(job.choices):
                yield _sse(self._chunk(job, c, delta, include_usage))
            if include_usage:
                yield _sse({"id": job.id, "object": _chunk_kind(job), "created": job.created,
                            "model": job.model, "choices": [], "usage": self.usage(job)})
        except (ApiError, EngineDeadError) as e:
            yield _sse(error_body(e if isinstance(e, ApiError) else ApiError(
                503, str(e), kind="service_unavailable")))
        yield b"data: [DONE]\n\n"

    def _chunk(self, job: Job, c: Choice, delta: Delta, include_usage: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": c.index}
        if job.kind == "text_completion":
            text = delta.text if c.started else c.echo + delta.text
            choice.update(text=text, logprobs=(self.completion_logprobs(
                c, delta.token_ids, delta.logprobs) if delta.logprobs is not None else None))
            choice.update(finish_reason=delta.finish_reason)
        else:
            message: dict[str, Any] = {"content": delta.text}
            reason = delta.finish_reason
            if job.tools is not None:
                if c.tool_deltas is None:
                    c.tool_deltas = stream_deltas(job.tools)
                content, calls = c.tool_deltas(delta.text, reason is not None)
                message = {"content": content} if content or not calls else {}
                if calls:
                    message["tool_calls"] = calls
                    c.num_calls += len(calls)
                reason = job.tools.finish_reason(reason, c.num_calls > 0)
            if not c.started:
                message = {"role": "assistant", **message}
            choice.update(delta=message, logprobs=self.chat_logprobs(job, delta.token_ids,
                                                                     delta.logprobs),
                          finish_reason=reason)
        c.started = True
        chunk = {"id": job.id, "object": _chunk_kind(job), "created": job.created,
                 "model": job.model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    # --- logprobs --------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, c: Choice, token_ids: list[int],
                            logprobs: list[dict[int, float]] | None) -> dict[str, Any]:
        """The legacy completions shape: tokens, their logprobs, the top ones, offsets."""
        assert logprobs is not None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(len(c.echo) + c.num_text_sent)
            c.num_text_sent += len(text)
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [{self.token_text(k): v for k, v in lp.items()}
                                 for lp in logprobs], "text_offset": offsets}

    def chat_logprobs(self, job: Job, token_ids: list[int],
                      logprobs: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        k = job.top_logprobs or 0
        return {"content": [
            {**self._entry(t, lp[t]), "top_logprobs": [
                self._entry(i, v) for i, v in sorted(lp.items(), key=lambda x: -x[1])[:k]]}
            for t, lp in zip(token_ids, logprobs)]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


async def _drain(stream: RequestStream) -> None:
    while (await stream.next()).finish_reason is None:
        pass
    _check_error(stream)


def _check_error(stream: RequestStream) -> None:
    out = stream.output
    if out.finish_reason == FinishReason.ERROR:
        error = out.error or "the engine rejected the request"
        raise ApiError(500, error, kind="server_error") if error.startswith(
            INTERNAL_ERROR_PREFIX) else ApiError(400, error)


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """Every choice's deltas as they come, until all finished."""
    if len(choices) == 1:                       # the common case: no task per delta
        c, delta = choices[0], Delta("", [], None, None)
        while delta.finish_reason is None:
            delta = await c.stream.next()
            if delta.finish_reason is not None:
                _check_error(c.stream)
            yield c, delta
        return
    pending = {asyncio.ensure_future(c.stream.next()): c for c in choices}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                c = pending.pop(task)
                delta = task.result()
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(c.stream.next())] = c
                else:
                    _check_error(c.stream)
                yield c, delta
    finally:
        for task in pending:
            task.cancel()


def _chunk_kind(job: Job) -> str:
    return "text_completion" if job.kind == "text_completion" else "chat.completion.chunk"


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param,
                      "code": e.status}}
