"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar), compiled by
llguidance into a matcher that says, before each token, which tokens may come next.

One entry point per side, no torch:
  * the frontend: `GrammarCompiler.check` (called by InputProcessor) refuses, with a ValueError
    naming it, a constraint llguidance cannot enforce (an unimplemented schema keyword, a bad
    regex) or cannot compile within `grammar_compile_timeout`;
  * EngineCore: `StructuredOutputs` compiles each constrained request in a background thread
    while the request waits outside the scheduler ("compiling": only its own TTFT pays), then
    gives it a `Grammar` that the scheduler advances with every sampled token (`accept`), and
    fills the token bitmask of each constrained row of a step (`fill_masks`) while the
    workers run that step's forward (kvflow/core/executor.py sends it after the plan).
A bitmask row is (vocab + 31) // 32 int32 words; bit t % 32 of word t // 32 set: token t is
allowed. The sampler (kvflow/workers/sampler.py) sets the others to -inf.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np

from kvflow.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from kvflow.core.request import Request

logger = logging.getLogger(__name__)
# Whitespace allowed between JSON tokens unless the request says otherwise: pretty-printing
# (a newline and an indent), never a run of newlines. JSON's own rule (any whitespace) lets a
# small model loop on "\n\n\n..." until max_tokens, leaving invalid JSON; vLLM users meet
# this and must find `disable_any_whitespace`.
JSON_WHITESPACE = r"[ \t]{0,8}(\n[ \t]{0,48})?"
CACHE_SIZE = 256        # compiled constraints kept (agents send the same schema every time)
# llguidance's bounds on one constraint: its size, its lexer's memory (~2 kB a state), and
# the work of one token's mask (its default fuel, ~15 ms at most). A constraint past them
# fails with an error naming the limit. No error message echoes the grammar back.
LIMITS: dict[str, Any] = dict(max_grammar_size=500_000, max_lexer_states=50_000, step_lexer_fuel=200_000,
              verbose_errors=False)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; ValueError if it is not even well-formed."""
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        options: Any = {}
        if spec.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = spec.whitespace_pattern or JSON_WHITESPACE
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
    if spec.regex is not None:
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llg.grammar_from("choice", spec.choice)   # type: ignore[arg-type]
    assert spec.grammar is not None, "StructuredOutputsParams.check ran first"
    try:
        return llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


class DaemonPool:
    """Threads that run submitted calls into Futures, as ThreadPoolExecutor does, but as
    daemons: a compile never delays the exit of EngineCore or the server."""

    def __init__(self, threads: int) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._run, name=f"kvflow-grammar-{i}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.tasks.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self.tasks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:       # noqa: BLE001 (handed to the waiter)
                    future.set_exception(e)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each at most once (an LRU of fresh matchers,
    copied for each request), in `threads` background threads."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 timeout: float, threads: int = 1) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self.pool = DaemonPool(threads)
        self._tokenizer: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llg.LLMatcher | str] = OrderedDict()  # or its error
        self.compile_seconds: list[float] = []       # fresh compiles (benchmarks read them)

    def prepare(self) -> None:
        """Build llguidance's tokenizer in the background now (~0.3 s), so that the first
        constrained request does not wait for it."""
        self.pool.submit(lambda: self.tokenizer)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.tokenizer.vocab_size + 31) // 32

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:   # ~0.3 s: built on the first constrained request
                with open(os.path.join(self.model_path, "tokenizer.json")) as f:
                    text = f.read()
                self._tokenizer = llg.LLTokenizer(
                    text, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llg.LLMatcher:
        """A fresh matcher for the constraint (blocking); ValueError naming the problem."""
        grammar = grammar_text(spec)
        with self._lock:
            entry = self._cache.get(grammar)
            if entry is not None:
                self._cache.move_to_end(grammar)
        if entry is None:
            entry = self._compile(grammar)
            with self._lock:
                self._cache[grammar] = entry
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry.deep_copy()

    def _compile(self, grammar: str) -> llg.LLMatcher | str:
        start = time.perf_counter()
        tokenizer = self.tokenizer
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0,
                                limits=llg.LLParserLimits(**LIMITS))
        if not matcher.is_error():
            # The first mask builds the lexer's start state: part of compiling, and where
            # some grammars first fail.
            scratch = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            matcher.reset()
        self.compile_seconds.append(time.perf_counter() - start)
        if matcher.is_error():
            return f"structured_outputs cannot be enforced: {matcher.get_error()[:500]}"
        return matcher

    def submit(self, spec: StructuredOutputsParams) -> Future:
        return self.pool.submit(self.compile, spec)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError unless the constraint compiles within the timeout (the frontend's
        check; the result is cached, so the engine's own compile of it is a copy)."""
        future = self.submit(spec)
        try:
            future.result(self.timeout)
        except FutureTimeout:
            raise ValueError(f"structured_outputs did not compile within "
                             f"{self.timeout:g} s (--grammar-compile-timeout)") from None


class Grammar:
    """One request's matcher, advanced by the scheduler with each token it appends."""

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None     # set when the matcher failed: the request fails

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; True when the request must stop: the constraint is
        complete (nothing may follow), or the matcher failed (a limit hit while computing
        its mask; `error` says which)."""
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            self.error = ("structured_outputs: the constraint failed while generating: "
                          + (self.matcher.get_error()[:300] or "no allowed token"))
            return True
        return self.matcher.is_stopped()


class StructuredOutputs:
    """EngineCore's side: requests compiling, and the masks of each step.

    `wakeup_fd` becomes readable when a compile ends, so EngineCore's loop, blocked in poll,
    wakes for it (`drain_wakeups` empties it)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 timeout: float) -> None:
        self.compiler = GrammarCompiler(model_path, vocab_size, eos_token_ids, timeout)
        self.compiler.prepare()
        self.timeout = timeout
        self.compiling: dict[str, tuple[Request, Future, float]] = {}  # id -> request, ...
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._executor: llg.LLExecutor | None = None

    @property
    def wakeup_fd(self) -> int:
        return self._read_fd

    def add(self, request: Request) -> None:
        """Start compiling a constrained request's grammar (a `Request`)."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None, "only constrained requests come here"
        future = self.compiler.submit(spec)
        future.add_done_callback(self._wake)
        self.compiling[request.request_id] = (request, future, time.monotonic())

    def _wake(self, _: Future) -> None:
        try:
            os.write(self._write_fd, b".")
        except OSError:         # closed, or full: EngineCore is stopping or already woken
            pass

    def collect(self) -> tuple[list[Request], list[tuple[str, str]]]:
        """Requests whose grammar is ready (each with its `grammar` set, and advanced over
        the tokens a resumed request had produced), and (request_id, error) of those that
        failed or passed the timeout."""
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (request, future, started) in list(self.compiling.items()):
            if not future.done():
                if now - started > self.timeout:
                    del self.compiling[request_id]
                    failed.append((request_id, f"structured_outputs did not compile within "
                                               f"{self.timeout:g} s (--grammar-compile-timeout)"))
                continue
            del self.compiling[request_id]
            try:
                grammar = Grammar(future.result())
            except ValueError as e:
                failed.append((request_id, str(e)))
                continue
            outputs = request.token_ids[request.num_prompt_tokens:]
            if outputs and not grammar.matcher.consume_tokens(outputs):
                failed.append((request_id, "a resumed request's output does not fit its "
                                           "structured_outputs constraint"))
                continue
            request.grammar = grammar
            ready.append(request)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile ends or `timeout` passes (in-process engine, nothing else
        to do)."""
        futures = [future for _, future, _ in self.compiling.values()]
        if futures:
            import concurrent.futures
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def drain_wakeups(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def abort(self, request_ids: list[str]) -> list[str]:
        """Drop compiling requests among `request_ids`; returns those dropped."""
        return [i for i in request_ids if self.compiling.pop(i, None) is not None]

    def fill_masks(self, grammars: list[Grammar]) -> bytes:
        """The bitmask rows of these grammars, in order, as bytes (int32 words)."""
        if self._executor is None:
            self._executor = llg.LLExecutor(1)   # the workers have the cores during a step
        masks = np.zeros((len(grammars), self.compiler.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(g.matcher, i) for i, g in enumerate(grammars)], masks.ctypes.data,
            masks.shape[1] * 4, len(grammars))
        for i, g in enumerate(grammars):
            if g.matcher.is_error() or not masks[i].any():
                # Failed (a limit): let it sample EOS only; `accept` then fails the request.
                masks[i] = 0
                bits = masks.view(np.uint32)
                for eos in self.compiler.eos_token_ids:
                    bits[i, eos // 32] |= np.uint32(1 << (eos % 32))
        return masks.tobytes()

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)
