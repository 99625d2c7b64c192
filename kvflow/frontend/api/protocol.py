"""OpenAI request bodies as msgspec Structs, and their translation into SamplingParams.

Every problem raises `ApiError(400, message, param)` naming the field. Fields that would change
results and that kvflow does not implement (functions, prompt logprobs, beam search, ...) are
refused by name rather than ignored; fields that change nothing (user, metadata, ...) are
accepted and ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

import math

import msgspec

from kvflow.frontend.api.tool_calls import ToolError, history_message
from kvflow.sampling_params import (MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams,
                                    shorten)

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # kvflow's extension: seconds after which the request is aborted (finish_reason "abort",
    # with what it has); None: no deadline.
    timeout: float | None = None
    # Structured outputs (structured_constraint): OpenAI's response_format, vLLM's
    # structured_outputs, and vLLM's older guided_* fields.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None               # kvflow/frontend/api/tool_calls.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


# Fields kvflow does not implement: the values it accepts (those that change nothing).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: not v,
    "functions": lambda v: not v,               # OpenAI's deprecated form of tools
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "prompt_logprobs": lambda v: v is None,
    "use_beam_search": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "bad_words": lambda v: not v,
    "truncate_prompt_tokens": lambda v: v is None,
    "skip_special_tokens": lambda v: v is True,
    "continue_final_message": lambda v: not v,
    "chat_template": lambda v: v is None,
    "chat_template_kwargs": lambda v: not v,
    "documents": lambda v: not v,
    "logits_processors": lambda v: not v,
    "add_special_tokens": lambda v: v is True,
    "return_tokens_as_token_ids": lambda v: not v,
    "length_penalty": lambda v: v == 1,
    "web_search_options": lambda v: not v,
    "stream_options": lambda v: not (isinstance(v, dict) and v.get("continuous_usage_stats")),
}
_CHAT_ONLY_UNSUPPORTED = {"echo": lambda v: not v}
_COMPLETION_ONLY_UNSUPPORTED = {"tools": lambda v: not v, "tool_choice": lambda v: v is None}
# Fields clients send that change nothing here.
_IGNORED = {"metadata", "store", "service_tier", "reasoning_effort",
            "spaces_between_special_tokens", "echo", "stream_options", "priority",
            "guided_decoding_backend"}


MAX_MESSAGES = 1024      # chat messages per request
MAX_PROMPTS = 1024       # prompts in one completions request


def parse(body: bytes, kind: type[msgspec.Struct], generation: bool = True) -> Any:
    """Decode and type-check a JSON body into `kind`; 400 naming the field otherwise. For a
    generation request (`generation`), fields kvflow does not implement are refused too."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except UnicodeDecodeError:
        raise ApiError(400, "malformed JSON body: it is not valid UTF-8") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the JSON body must be an object")
    raw = {k: v for k, v in raw.items() if v is not None}    # null is "not given"
    unsupported = {**_UNSUPPORTED, **(_CHAT_ONLY_UNSUPPORTED if kind is ChatRequest
                                      else _COMPLETION_ONLY_UNSUPPORTED)}
    if not generation:
        unsupported = {}
    for name, accepted in unsupported.items():
        if name in raw and not accepted(raw[name]):
            raise ApiError(400, f"{name}={shorten(raw[name])} is not supported by kvflow", name)
    unknown = sorted(set(raw) - set(kind.__struct_fields__) - _IGNORED)
    if unknown:                                  # as vLLM does: accepted, but said
        logger.warning("ignoring %d unknown request field(s): %s", len(unknown),
                       shorten(", ".join(unknown[:10]), 200))
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as e:
        match = re.search(r"at `\$\.(\w+)|missing required field `(\w+)`", str(e))
        param = next((g for g in match.groups() if g), None) if match else None
        raise ApiError(400, f"invalid request: {shorten(str(e), 300)}", param) from None


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, strings, token ids, or lists of token ids."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in x)
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise ApiError(400, f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} are "
                            "allowed in one request", "prompt")
    if isinstance(prompt, list) and prompt:
        if is_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(is_ids(p) and p for p in prompt):
            return list(prompt)
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    if prompt == []:
        raise ApiError(400, "prompt is empty", "prompt")
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or "
                        "a list of lists of token ids", "prompt")


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """Messages for the chat template: roles checked, text parts joined, tool calls and
    results checked (tool_calls.history_message)."""
    if not request.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    if len(request.messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages has {len(request.messages)} entries; at most "
                            f"{MAX_MESSAGES} are allowed", "messages")
    out = []
    for i, m in enumerate(request.messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role={shorten(m.role)} is not supported (system, "
                                "developer, user, assistant, tool)", "messages")
        try:
            out.append(history_message(i, m.role, _content(m.content, i), m.tool_calls,
                                       m.tool_call_id))
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None
    return out


def _content(content: str | list[TextPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{i}].content: part type {shorten(part.type)} is not "
                                "supported (only text)", "messages")
    return "\n".join(part.text or "" for part in content)


def check_request_shape(request: _Sampling, max_n: int) -> None:
    """What must hold before any work is done for a request: stream_options only when
    streaming, n within --max-n, a sane deadline."""
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    if not 1 <= request.n <= max_n:
        raise ApiError(400, f"n={shorten(request.n)} must be in [1, {max_n}] (the server's "
                            "--max-n)", "n")
    if request.timeout is not None and not (math.isfinite(request.timeout)
                                            and request.timeout > 0):
        raise ApiError(400, f"timeout={request.timeout!r} must be a positive number of "
                            "seconds", "timeout")


def structured_constraint(request: _Sampling) -> StructuredOutputsParams | None:
    """The request's constraint, from whichever one field gives it: response_format
    (OpenAI: text, json_object, json_schema), structured_outputs (vLLM: json, json_object,
    regex, choice, grammar and the whitespace options) or vLLM's older guided_* fields."""
    given = [name for name in ("structured_outputs", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar")
             if getattr(request, name) is not None]
    fmt = request.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(given)} both constrain the output: send one",
                       given[1])
    if not given:
        return None
    try:
        if given[0] == "response_format":
            return _response_format(fmt)
        if given[0] == "structured_outputs":
            raw = request.structured_outputs
            unknown = sorted(set(raw) - set(StructuredOutputsParams.__struct_fields__)
                             ) if isinstance(raw, dict) else []
            if unknown:
                raise ApiError(400, f"structured_outputs has unknown field(s) "
                                    f"{shorten(unknown)}", "structured_outputs")
            return msgspec.convert(raw, StructuredOutputsParams)
        return StructuredOutputsParams(
            json=request.guided_json, regex=request.guided_regex,
            choice=request.guided_choice, grammar=request.guided_grammar,
            whitespace_pattern=request.guided_whitespace_pattern)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"{given[0]}: {shorten(str(e), 300)}", given[0]) from None


def _response_format(fmt: Any) -> StructuredOutputsParams:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema "
                                "object", "response_format")
        return StructuredOutputsParams(json=schema)
    raise ApiError(400, f"response_format={shorten(fmt)}: type must be text, json_object or "
                        "json_schema", "response_format")


def choice_params(request: _Sampling, max_tokens: int, logprobs: int | None,
                  constraint: StructuredOutputsParams | None = None) -> list[SamplingParams]:
    """The SamplingParams of each of the request's n choices (n is checked already)."""
    return [sampling_params(request, max_tokens, logprobs, i, constraint)
            for i in range(request.n)]


def sampling_params(request: _Sampling, max_tokens: int, logprobs: int | None,
                    choice: int, constraint: StructuredOutputsParams | None = None
                    ) -> SamplingParams:
    """The SamplingParams of one choice (n > 1 gives each its own seed)."""
    if request.logit_bias is not None and len(request.logit_bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias has {len(request.logit_bias)} entries; at most "
                            f"{MAX_LOGIT_BIAS} are allowed", "logit_bias")
    if request.logit_bias is not None and not all(re.fullmatch(r"-?\d{1,12}", k)
                                                  for k in request.logit_bias):
        raise ApiError(400, "logit_bias keys must be token ids", "logit_bias")
    try:
        return SamplingParams(
            temperature=request.temperature, top_p=request.top_p,
            top_k=-1 if request.top_k in (None, 0) else request.top_k, min_p=request.min_p,
            max_tokens=max_tokens, stop=_stop_list(request.stop),
            stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
            seed=_choice_seed(request.seed, choice), logprobs=logprobs,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=({int(k): v for k, v in request.logit_bias.items()}
                        if request.logit_bias else None),
            min_tokens=request.min_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=constraint)
    except ValueError as e:
        raise value_error(e) from None


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice i's seed: seed + i, wrapped within 64 bits (seed is checked to be 64-bit)."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice + 2**63) % 2**64 - 2**63


def _stop_list(stop: str | list[str] | None) -> list[str] | None:
    if isinstance(stop, str):
        return [stop]
    return stop or None


def value_error(e: ValueError) -> ApiError:
    """The engine's ValueError as a 400, with the field it names as `param`."""
    message = str(e)
    match = re.search(r"SamplingParams\.(\w+)", message)
    if match:
        return ApiError(400, message, match.group(1))
    if "logit_bias" in message:
        return ApiError(400, message, "logit_bias")
    if "structured_outputs" in message:
        return ApiError(400, message, "structured_outputs")
    if "prompt" in message or "max_model_len" in message:
        return ApiError(400, message, "prompt" if "max_tokens" not in message else "max_tokens")
    return ApiError(400, message)
