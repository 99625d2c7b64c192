"""Tool calling on /v1/chat/completions, vLLM's way: one entry point, `ToolUse.of(request)`.

  * `tools` are checked and given to the chat template (as `tools`, the variable HF templates
    read). A template that never mentions `tools` (the default model's) gets them in a system
    section instead, in the Hermes format the `hermes` parser reads, and sees earlier tool
    calls and results as text (as llama.cpp does for templates without tool support).
  * `tool_choice`: "none" (tools shown, nothing parsed), "auto" (the model answers in text or
    with calls, parsed from its text by the server's `--tool-call-parser`; needs
    `--enable-auto-tool-choice`), "required" (decoding constrained to a JSON array of one or
    more {"name", "parameters"} objects, one of the tools' each) or a named function
    (constrained to its parameters' schema: the text is the arguments).
  * Parsing: `parse` for a whole answer, `ToolStream` for a streamed one (the same calls, as
    the deltas the openai SDK assembles).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from kvflow.sampling_params import StructuredOutputsParams, shorten

MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")       # OpenAI's rule for function names


class ToolError(ValueError):
    """A bad `tools`/`tool_choice`/history: the API answers 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str                                  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# --- parsers of the model's text (--tool-call-parser) ------------------------------------

class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text
    around them (Hermes, Qwen2/2.5/3, and what kvflow prompts templates without tools with).
    A block that is not such JSON stays text, as vLLM leaves it."""
    start, end = "<tool_call>", "</tool_call>"

    @staticmethod
    def call(block: str) -> Call | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return Call(obj["name"], json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}


class ToolStream:
    """Splits a growing answer into text and complete calls (auto mode). Text that could be
    the start of a call tag is held back until it is known; trailing whitespace is held
    until more text follows (so whitespace around calls and at the end is not sent)."""

    def __init__(self, parser: type[HermesParser]) -> None:
        self.parser = parser
        self.buffer = ""
        self.in_call = False
        self.held_space = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        content, calls = "", []
        start, end = self.parser.start, self.parser.end
        while True:
            if not self.in_call:
                i = self.buffer.find(start)
                if i < 0:
                    keep = _prefix_overlap(self.buffer, start)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:i]
                self.buffer = self.buffer[i + len(start):]
                self.in_call = True
            else:
                j = self.buffer.find(end)
                if j < 0:
                    break
                block, self.buffer = self.buffer[:j], self.buffer[j + len(end):]
                self.in_call = False
                call = self.parser.call(block)
                if call is None:
                    content += start + block + end
                else:
                    calls.append(call)
        return self._text(content), calls

    def finish(self) -> tuple[str, list[Call]]:
        """What is left at the end: an unclosed call that parses is a call (the model may
        stop without the closing tag), anything else text."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = self.parser.call(rest)
            if call is not None:
                return "", [call]
            rest = self.parser.start + rest
        if not rest.strip():                  # trailing whitespace: not sent
            self.held_space = ""
            return "", []
        return self._text(rest), []

    def _text(self, text: str) -> str:
        """Text to send now: trailing whitespace waits for more text (at the end, or before a
        call, it is dropped), so the text sent does not depend on how it was cut."""
        body = text.rstrip()
        if not body:
            self.held_space += text
            return ""
        out, self.held_space = self.held_space + body, text[len(body):]
        return out


def _prefix_overlap(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parse(parser: type[HermesParser], text: str) -> tuple[str | None, list[Call]]:
    stream = ToolStream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content += rest
    return (content if content.strip() else None), calls + more


# --- the request's tools -----------------------------------------------------------------

@dataclass
class ToolUse:
    tools: list[dict[str, Any]]           # OpenAI's tool objects, checked
    mode: str                             # "none" | "auto" | "required" | "named"
    parser: type[HermesParser] | None = None
    named: str | None = None
    parallel: bool = True                 # parallel_tool_calls: several calls in one answer

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any, auto_parser: str | None,
           parallel: bool = True) -> "ToolUse | None":
        """The request's tool use, checked; None without tools. `auto_parser`: the server's
        --tool-call-parser when --enable-auto-tool-choice is on, else None. `parallel`
        false: "required" makes exactly one call."""
        if tool_choice is not None and not tools and tool_choice != "none":
            raise ToolError("tool_choice needs tools", "tool_choice")
        if not tools:
            return None
        checked = check_tools(tools)
        names = [t["function"]["name"] for t in checked]
        if tool_choice is None:
            tool_choice = "auto"                    # OpenAI's default with tools
        if tool_choice in ("none", "required"):
            return cls(checked, tool_choice, parallel=parallel)
        if tool_choice == "auto":
            if auto_parser is None:
                raise ToolError('tool_choice "auto" (the default when tools are given) needs '
                                "the server started with --enable-auto-tool-choice and "
                                "--tool-call-parser; send tool_choice \"required\" or a named "
                                "function instead", "tool_choice")
            return cls(checked, "auto", PARSERS[auto_parser])
        name = (tool_choice.get("function") or {}).get("name") if isinstance(
            tool_choice, dict) and tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError(f"tool_choice={shorten(tool_choice)} must be \"none\", \"auto\", "
                            "\"required\" or {\"type\": \"function\", \"function\": {\"name\": "
                            "...}}", "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names the function {shorten(name)}, which is not "
                            "among the tools", "tool_choice")
        return cls(checked, "named", named=name)

    def constraint(self) -> StructuredOutputsParams | None:
        """What decoding is constrained to: the named function's arguments, or (required) an
        array of calls of the tools; nothing for none and auto."""
        params = {t["function"]["name"]: t["function"].get("parameters") or
                  {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=params[self.named])
        if self.mode == "required":
            one_of = [{"type": "object", "additionalProperties": False,
                       "required": ["name", "parameters"],
                       "properties": {"name": {"const": name}, "parameters": schema}}
                      for name, schema in params.items()]
            return StructuredOutputsParams(json={
                "type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}})
        return None

    def calls(self, text: str) -> tuple[str | None, list[Call]]:
        """A whole answer's text and calls."""
        if self.mode == "named":
            assert self.named is not None
            return None, [Call(self.named, text)]
        if self.mode == "required":
            return None, _required_calls(text)
        if self.mode == "auto":
            assert self.parser is not None
            return parse(self.parser, text)
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named
        function keeps "stop", as OpenAI answers it."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    # --- the prompt ---------------------------------------------------------------------

    def template_inputs(self, messages: list[dict[str, Any]], native: bool
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and `tools` for the chat template. `native`: the template reads
        `tools`; otherwise the tools go into the system message and calls and results
        become text (see the module's docstring)."""
        if native:
            return messages, self.tools
        return with_tools_in_text(messages, self.tools), None


def with_tools_in_text(messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For a template without tool support: the tools in the system message, assistant
    calls as `<tool_call>` text, tool results as `<tool_response>` user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(HermesParser.start + "\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False) + "\n" + HermesParser.end for c in m["tool_calls"])
            text = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        section = _tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call functions to answer. These are the functions, with the "
            f"JSON schema of their arguments:\n<tools>\n{listing}\n</tools>\n\nTo call one, "
            "answer with a JSON object in tags, one per call:\n<tool_call>\n"
            '{"name": "the function\'s name", "arguments": {...}}\n</tool_call>')


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's tool objects, checked (ToolError naming the problem) and trimmed."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    seen: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                            "{...}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name={shorten(name)} must be 1 to 64 "
                            "letters, digits, _ or -", "tools")
        if name in seen:
            raise ToolError(f"tools[{i}].function.name={name!r} appears twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        out.append({"type": "function", "function": {
            k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}})
    return out


def _required_calls(text: str) -> list[Call]:
    try:
        items = json.loads(text)
    except ValueError:
        return []                  # cut by max_tokens: no complete call to report
    return [Call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items if isinstance(item, dict) and "name" in item]


def history_message(i: int, role: str, content: str, tool_calls: list[Any] | None,
                    tool_call_id: str | None) -> dict[str, Any]:
    """One message of the conversation for the template, tool parts checked: an
    assistant's calls (arguments given as JSON text, passed on as objects, as HF templates
    expect) and a tool's result."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        if role != "assistant" or not isinstance(tool_calls, list) or len(tool_calls) > MAX_TOOLS:
            raise ToolError(f"messages[{i}].tool_calls: only an assistant message has them, "
                            f"at most {MAX_TOOLS}", "messages")
        calls = []
        for c in tool_calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolError(f"messages[{i}].tool_calls: each is {{\"id\", \"type\": "
                                "\"function\", \"function\": {\"name\", \"arguments\"}}",
                                "messages")
            args = fn.get("arguments") or "{}"
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise ToolError(f"messages[{i}].tool_calls: arguments of {shorten(fn['name'])}"
                                " are not JSON", "messages") from None
            calls.append({"id": c.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": parsed}})
        message["tool_calls"] = calls
    if role == "tool":
        message["tool_call_id"] = tool_call_id
    return message


def stream_deltas(use: ToolUse) -> Callable[[str, bool], tuple[str, list[dict[str, Any]]]]:
    """A function (new text, finished) -> (content to send, tool_call deltas to send) for one
    streamed choice: the deltas the openai SDK assembles by index (the first of a call
    carries id, type and name; the named function's arguments stream as they come)."""
    index = 0
    if use.mode == "named":
        assert use.named is not None
        call = Call(use.named, "")
        started = False

        def named(text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
            nonlocal started
            if not text and (started or not finished):
                return "", []
            delta: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not started:
                delta.update(id=call.id, type="function")
                delta["function"]["name"] = call.name
                started = True
            return "", [delta]
        return named
    if use.mode == "required":
        text_so_far: list[str] = []

        def required(text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
            text_so_far.append(text)
            if not finished:
                return "", []
            return "", [{"index": i, **c.to_openai()}
                        for i, c in enumerate(_required_calls("".join(text_so_far)))]
        return required
    if use.mode == "none":
        return lambda text, finished: (text, [])
    assert use.parser is not None
    stream = ToolStream(use.parser)

    def auto(text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        nonlocal index
        content, calls = stream.feed(text)
        if finished:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        deltas = []
        for c in calls:
            deltas.append({"index": index, **c.to_openai()})
            index += 1
        return content, deltas
    return auto
