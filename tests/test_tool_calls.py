"""Structured outputs and tool calling through the OpenAI API: a real `launch.py serve`
(default model, float32) and the `openai` SDK. Outputs are checked against independent
references (jsonschema, json.loads, re.fullmatch, the SDK's own assembly of streamed deltas),
and the hermes parser against exact strings."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from cluster_helpers import ServeProcess, serve_ready
from kvflow.frontend.api.tool_calls import (HermesParser, ToolError, ToolUse, parse,
                                            stream_deltas, with_tools_in_text)
from kvflow.frontend.tokenizer import Tokenizer

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 40},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH,
                                           "description": "Search the web"}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(default_model: str) -> Iterator[ServeProcess]:
    s = serve_ready("--dtype", "float32", "--served-model-name", "default",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    model=default_model, kv_cache_memory_gb=0.2, zmq=False)
    try:
        yield s
    finally:
        s.cleanup()


def client(s: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)


def assembled(chunks: list[Any]) -> Any:
    """The openai SDK's own assembly of a streamed chat completion."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


# --- the hermes parser on exact strings ---------------------------------------------------

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "search", "arguments": {"query": "a <b> c"}}</tool_call>'
TEXTS = {
    "one call": (CALL_A, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "two calls": (CALL_A + "\n" + CALL_B, None,
                  [("get_weather", {"city": "Paris", "unit": "celsius"}),
                   ("search", {"query": "a <b> c"})]),
    "text first": ("Let me look.\n" + CALL_B, "Let me look.", [("search", {"query": "a <b> c"})]),
    "no call": ("It is sunny < 30 degrees.", "It is sunny < 30 degrees.", []),
    "malformed": ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    "unclosed at the end": ('<tool_call>{"name": "search", "arguments": {"query": "x"}}', None,
                            [("search", {"query": "x"})]),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_hermes_parse_and_every_split_streams_the_same(name: str) -> None:
    text, content, calls = TEXTS[name]
    got_content, got_calls = parse(HermesParser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    use = ToolUse(TOOLS, "auto", HermesParser)
    for cut in range(1, len(text)):            # the text in two pieces, cut everywhere
        step = stream_deltas(use)
        pieces = [step(text[:cut], False), step(text[cut:], True)]
        streamed = "".join(p[0] for p in pieces)
        deltas = [d for p in pieces for d in p[1]]
        assert (streamed or None) == content, cut
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"]))
                for d in deltas] == calls, cut


def test_auto_round_trip_through_the_template_and_the_sdk(default_model: str) -> None:
    """The default model's template has no tools: they go into the system message, and a
    call in the history is rendered as the very text the hermes parser reads back; streamed
    as chunks, the openai SDK assembles the same call."""
    tokenizer = Tokenizer(default_model)
    assert not tokenizer.reads_tools
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}]
    messages = with_tools_in_text(history, TOOLS)
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.count("<tools>") == 1 and '"name": "search"' in prompt
    assert "<tool_response>\n-3 degrees\n</tool_response>" in prompt
    assistant_text = messages[2]["content"]
    content, calls = parse(HermesParser, assistant_text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    step = stream_deltas(ToolUse(TOOLS, "auto", HermesParser))
    pieces = [assistant_text[i:i + 7] for i in range(0, len(assistant_text), 7)]
    chunks = []
    for i, piece in enumerate(pieces):
        text, deltas = step(piece, i == len(pieces) - 1)
        delta: dict[str, Any] = {"role": "assistant"} if i == 0 else {}
        if text:
            delta["content"] = text
        if deltas:
            delta["tool_calls"] = deltas
        chunks.append(openai.types.chat.ChatCompletionChunk.model_validate({
            "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "default",
            "choices": [{"index": 0, "delta": delta,
                         "finish_reason": "tool_calls" if i == len(pieces) - 1 else None}]}))
    message = assembled(chunks).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_tool_requests_are_checked() -> None:
    bad = [
        ([{"type": "function", "function": {"name": "has space"}}], "auto", "letters"),
        ([{"type": "function", "function": {"name": "a"}}] * 2, "auto", "twice"),
        ([{"type": "retrieval"}], "auto", "type"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        (TOOLS, "sometimes", "must be"),
        (None, "required", "needs tools"),
        ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)], "auto",
         "at most 128"),
    ]
    for tools, choice, needle in bad:
        with pytest.raises(ToolError, match=needle):
            ToolUse.of(tools, choice, "hermes")
    with pytest.raises(ToolError, match="--enable-auto-tool-choice"):
        ToolUse.of(TOOLS, None, None)


# --- through the server ---------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_validate(server: ServeProcess, choice: str) -> None:
    """Constrained decoding: arguments always validate against the tool's schema, greedy and
    three seeded choices (n=3); streamed, the SDK assembles the same call as the whole
    answer; finish_reason as OpenAI gives it."""
    tool_choice: Any = ("required" if choice == "required" else
                        {"type": "function", "function": {"name": "search"}})
    c = client(server)
    kw: dict[str, Any] = dict(model="default", messages=ASK, tools=TOOLS, max_tokens=120,
                              tool_choice=tool_choice, parallel_tool_calls=False)
    greedy = c.chat.completions.create(temperature=0, **kw)
    seeded = c.chat.completions.create(temperature=0.9, seed=3, n=3, **kw)
    for answer in greedy.choices + seeded.choices:
        assert answer.finish_reason == ("tool_calls" if choice == "required" else "stop")
        [call] = answer.message.tool_calls
        assert choice == "required" or call.function.name == "search"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    whole = greedy.choices[0].message.tool_calls[0]
    streamed = assembled(list(c.chat.completions.create(temperature=0, stream=True, **kw)))
    [call] = streamed.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        (whole.function.name, json.loads(whole.function.arguments))
    assert streamed.choices[0].finish_reason == greedy.choices[0].finish_reason


def test_history_with_calls_and_auto(server: ServeProcess) -> None:
    """A conversation with an assistant call and its tool result is accepted (auto: the
    model may answer in text); content and calls are whatever the parser finds in the
    text, and streaming gives the same."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_9", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "21 degrees and sunny"}]
    c = client(server)
    kw: dict[str, Any] = dict(model="default", messages=history, tools=TOOLS, max_tokens=40,
                              temperature=0)
    whole = c.chat.completions.create(**kw)
    streamed = assembled(list(c.chat.completions.create(stream=True, **kw)))
    # tool_choice "none": the same prompt (tools shown), nothing parsed: the raw text.
    none = c.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.finish_reason in ("stop", "length") and not none.message.tool_calls
    text = none.message.content
    content, calls = parse(HermesParser, text or "")
    assert whole.choices[0].message.content == (content if calls else text)
    assert len(whole.choices[0].message.tool_calls or []) == len(calls)
    assert (streamed.choices[0].message.content or "").rstrip() == \
        (whole.choices[0].message.content or "").rstrip()


def test_response_format_and_structured_outputs(server: ServeProcess) -> None:
    c = client(server)
    base: dict[str, Any] = dict(model="default", messages=ASK, max_tokens=100)
    for seed in (None, 1, 2):
        r = c.chat.completions.create(
            temperature=0 if seed is None else 0.8, seed=seed, **base,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "weather", "schema": WEATHER,
                                             "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    r = c.chat.completions.create(
        model="default", temperature=0, response_format={"type": "json_object"},
        max_tokens=300, messages=[{"role": "user", "content": "Give me a tiny JSON object "
                                                                "with a city and its country."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model="default", prompt="The date is", max_tokens=20,
                             temperature=0.5, seed=7,
                             extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)
    r = c.chat.completions.create(temperature=0, **base,
                                  extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert r.choices[0].message.content in ("sunny", "rainy", "cloudy")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        temperature=0.8, seed=5, stream=True, **base,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SEARCH}}))
    jsonschema.validate(json.loads(streamed), SEARCH)


@pytest.mark.parametrize("extra, needle, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "uniqueItems",
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "send one",
     "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one",
     "structured_outputs"),
    ({"structured_outputs": {"rgex": "a"}}, "unknown field", "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "json_schema", "response_format"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "send one", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters", "tools"),
    ({"messages": [{"role": "tool", "content": "x", "tool_calls": [{}]}]}, "assistant",
     "messages"),
])
def test_bad_constraints_are_400s_and_the_server_serves_on(server: ServeProcess,
                                                           extra: dict, needle: str,
                                                           param: str) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=extra.pop("messages", ASK),
                                  max_tokens=5, extra_body=extra)
    assert needle in e.value.message and e.value.body["param"] == param
    r = c.chat.completions.create(model="default", messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_compile_timeout_is_a_400(default_model: str) -> None:
    """A schema of 300 patterned properties takes milliseconds to compile: past a timeout
    of a microsecond it is a 400 naming the flag."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"}
                                            for i in range(300)}}
    s = serve_ready("--dtype", "float32", "--served-model-name", "default",
                    "--grammar-compile-timeout", "0.000001", model=default_model,
                    kv_cache_memory_gb=0.1, zmq=False)
    try:
        c = client(s)
        with pytest.raises(openai.BadRequestError, match="grammar-compile-timeout"):
            c.chat.completions.create(model="default", messages=ASK, max_tokens=5,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "big", "schema": big}})
        r = c.chat.completions.create(model="default", messages=ASK, max_tokens=3)
        assert len(r.choices[0].message.content or "") > 0
    finally:
        s.cleanup()


def test_llm_chat_with_tools_sees_what_the_server_shows(server: ServeProcess,
                                                        default_model: str) -> None:
    """LLM.chat(tools=...) renders the tools as the server does: greedy text equals the
    server's answer with tool_choice "none" (tools shown, nothing parsed)."""
    from kvflow import LLM, SamplingParams
    with LLM(default_model, in_process=True, dtype="float32", kv_cache_memory_gb=0.1) as llm:
        [out] = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False,
                         tools=TOOLS)
    r = client(server).chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                               tool_choice="none", temperature=0,
                                               max_tokens=24)
    assert r.choices[0].message.content == out.text
