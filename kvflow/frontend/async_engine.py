"""The serving frontend's engine handle: many requests in flight on one engine, under asyncio.

One reader task takes EngineCore's outputs as they come, folds each delta into its request's
tracker (detokenizing, stop strings) and wakes that request's consumer; consumers (the HTTP and
ZMQ servers) never touch the engine's sockets. A consumer opens a request with
`async with engine.request(prompt, params) as stream` and reads news with `await
stream.next()`. Leaving the block before the request finished (a client that went away, a
cancelled task) aborts it, so its blocks are freed at the engine's next step. When the engine
dies, every open stream raises EngineDeadError and `dead` says why (/health turns 503).

Admission is one path for every client: `admission(n)` refuses at once
(EngineOverloadedError) when `max_waiting` requests already wait, counting those still being
tokenized; `prepare` tokenizes and checks in a thread pool, so a long prompt never stalls the
loop (other streams, /health); `submit` queues at the engine, with an optional deadline after
which the request is aborted (finish_reason "abort", with what it has).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import zmq

from kvflow.errors import EngineDeadError, EngineOverloadedError
from kvflow.frontend.supervisor import SupervisedEngine
from kvflow.frontend.metrics import Metrics
from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.frontend.processor import InputProcessor, Prompt
from kvflow.ipc.messages import EngineOutputs, EngineRequest, EngineStats, FinishReason
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    """What a request gained since the consumer last looked."""
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class RequestStream:
    def __init__(self, tracker: RequestTracker) -> None:
        self.tracker = tracker
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.changed = asyncio.Event()
        self.dead: str | None = None
        self.num_tokens_taken = 0
        self.deadline: asyncio.TimerHandle | None = None

    @property
    def request_id(self) -> str:
        return self.tracker.output.request_id

    @property
    def output(self) -> RequestOutput:
        return self.tracker.output

    @property
    def finished(self) -> bool:
        return self.output.finished or self.dead is not None

    async def next(self) -> Delta:
        """The news since the last call, waiting for some; EngineDeadError if the engine died
        (or the server is shutting down). Call it until `finish_reason` is set."""
        while True:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            delta = self.take()
            if delta.token_ids or delta.text or delta.finish_reason is not None:
                return delta
            self.changed.clear()
            await self.changed.wait()

    def take(self) -> Delta:
        out = self.output
        start, self.num_tokens_taken = self.num_tokens_taken, len(out.token_ids)
        logprobs = out.logprobs[start:] if out.logprobs is not None else None
        return Delta(self.tracker.new_text(), out.token_ids[start:], logprobs, out.finish_reason)


class AsyncEngine:
    def __init__(self, engine: SupervisedEngine, processor: InputProcessor,
                 metrics: Metrics | None = None, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.processor = processor
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.streams: dict[str, RequestStream] = {}
        self.stats = EngineStats()
        self.dead: str | None = engine.dead
        self.num_sent = 0
        self.num_admitting = 0          # admitted, still being tokenized
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self.draining: str | None = None    # why new requests are refused (a SIGTERM)
        if metrics is not None:
            engine.on_restart = metrics.record_restart
        # Tokenization and chat templates run here, off the event loop (tokenizers releases
        # the GIL while it encodes). Two threads: this machine's cores, not more.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-tokenize")

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: its last count, plus those sent that it had not
        taken in yet when it counted, plus those admitted and still being tokenized."""
        return (self.stats.num_waiting + self.num_sent - self.stats.num_received
                + self.num_admitting)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    @contextmanager
    def admission(self, num_new: int) -> Iterator[None]:
        """Hold room for `num_new` requests while they are prepared and submitted: refuses at
        once (EngineOverloadedError) when the queue is full, EngineDeadError when the engine
        is gone. A request larger than the whole queue is a ValueError (it never fits)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.draining is not None:
            raise EngineOverloadedError(self.draining)
        limit = self.max_waiting
        if limit is not None:
            if num_new > limit:
                raise ValueError(f"the request needs {num_new} engine requests (prompts x n) "
                                 f"but at most {limit} may wait (--max-waiting-requests)")
            if self.num_waiting + num_new > limit:
                raise EngineOverloadedError(
                    f"{self.num_waiting} requests are already waiting (the server's "
                    f"--max-waiting-requests is {limit}); retry later")
        self.num_admitting += num_new
        try:
            yield
        finally:
            self.num_admitting -= num_new

    async def prepare(self, prompt: Prompt, params: list[SamplingParams]
                      ) -> list[RequestTracker]:
        """Tokenize and check (in the pool): one tracker per SamplingParams; ValueError
        naming the problem otherwise."""
        ids = [str(next(self._ids)) for _ in params]
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.processor.make_trackers, ids, prompt, params)

    async def run_blocking(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run a CPU-heavy frontend function (a chat template) in the pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @asynccontextmanager
    async def request(self, prompt: Prompt | None, params: SamplingParams,
                      timeout: float | None = None,
                      messages: list[dict[str, str]] | None = None
                      ) -> AsyncIterator[RequestStream]:
        """Admit, prepare (render `messages` when given) and submit a request (ValueError
        naming the problem if it is invalid); leaving the block before it finished aborts
        it."""
        with self.admission(1):
            if messages is not None:
                prompt = await self.run_blocking(self.processor.render_chat, messages)
            assert prompt is not None
            [tracker] = await self.prepare(prompt, [params])
            stream = self.submit(tracker, timeout)
        try:
            yield stream
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def submit(self, tracker: RequestTracker, timeout: float | None = None) -> RequestStream:
        """Queue a prepared request at the engine; after `timeout` seconds it is aborted."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        stream = RequestStream(tracker)
        out = stream.output
        try:
            self.engine.add_requests([EngineRequest(out.request_id, out.prompt_token_ids,
                                                    tracker.params, time.time())])
        except EngineDeadError as e:
            self.fail_all(str(e))
            raise
        self.streams[out.request_id] = stream
        self.num_sent += 1
        if timeout is not None:
            stream.deadline = asyncio.get_running_loop().call_later(
                timeout, self.abort, out.request_id)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at the engine; the abort's reply (answered by the supervisor at once)
        finishes the stream (and counts it)."""
        if self.dead is None and request_id in self.streams:
            self.engine.abort([request_id])

    # --- the reader task -----------------------------------------------------------------

    async def _read_outputs(self) -> None:
        """Wake on the engine's fds (its output socket's ZMQ_FD, its pidfd, the supervisor's
        wake pipe), watched by the loop for as long as that engine lives: one set of readers
        per engine, not one per poll (a zmq.asyncio poll wraps and registers every socket
        again, ~0.2 ms of this process's CPU a token at concurrency 1). ZMQ_FD only signals
        changes, so drain() empties the output socket (until ZMQ_EVENTS has no POLLIN) before
        every wait. A restart swaps the readers right after the drain() that retired the
        engine, before the loop runs any other callback: no transport of this loop can be
        handed an fd number the old engine closed while that number is still watched here."""
        loop = asyncio.get_running_loop()
        generation, watched = -1, list[int]()
        waiter: asyncio.Future[None] | None = None

        def wake() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        try:
            while self.dead is None:
                if generation != self.engine.generation:    # restarted: other fds to watch
                    for fd in watched:
                        loop.remove_reader(fd)
                    generation = self.engine.generation
                    watched = [int(item.getsockopt(zmq.FD)) if isinstance(item, zmq.Socket)
                               else item for item in self.engine.pollables()]
                    for fd in watched:
                        loop.add_reader(fd, wake)
                try:
                    for out in self.engine.drain():
                        self._apply(out)
                except EngineDeadError as e:
                    self.fail_all(str(e))
                    break
                except Exception as e:      # a bug here must not leave every consumer hanging
                    logger.exception("the frontend's output reader failed")
                    self.fail_all(f"the frontend's output reader failed: {e!r}")
                    self.engine.shutdown()
                    break
                if generation != self.engine.generation:
                    continue
                # A hung engine wakes nobody: look at least every second (the supervisor's
                # watchdog runs in drain()).
                waiter = loop.create_future()
                timer = loop.call_later(1.0, wake)
                await waiter
                timer.cancel()
        finally:
            for fd in watched:
                loop.remove_reader(fd)

    def _apply(self, outputs: EngineOutputs) -> None:
        self.stats = outputs.stats
        if self.metrics is not None:
            self.metrics.record_stats(outputs.stats)
        now = time.perf_counter()
        for delta in outputs.outputs:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            finished = stream.tracker.apply(delta, self.engine.abort)
            self._record_tokens(stream, len(delta.new_token_ids), delta.queue_seconds, now)
            if finished:
                del self.streams[delta.request_id]
                if stream.deadline is not None:
                    stream.deadline.cancel()
                self._record_finished(stream, now)
            stream.changed.set()

    def _record_tokens(self, stream: RequestStream, num_new: int, queue_seconds: float,
                       now: float) -> None:
        if self.metrics is None or num_new == 0:
            return
        first = stream.last_token_time is None
        if first:
            self.metrics.record_first_token(len(stream.output.prompt_token_ids),
                                            now - stream.arrival, queue_seconds)
        gap = None if stream.last_token_time is None else now - stream.last_token_time
        self.metrics.record_tokens(num_new, gap)
        stream.last_token_time = now

    def _record_finished(self, stream: RequestStream, now: float) -> None:
        if self.metrics is not None:
            out = stream.output
            self.metrics.record_finished(out.finish_reason or FinishReason.ABORT,
                                         len(out.prompt_token_ids), len(out.token_ids),
                                         now - stream.arrival)

    def fail_all(self, reason: str) -> None:
        """The engine is gone (or the server stops): every open request, and every later
        one, fails with `reason`."""
        if self.dead is None:
            logger.error("engine is dead: %s", reason)
        self.dead = self.dead or reason
        now = time.perf_counter()
        for stream in self.streams.values():
            stream.dead = reason
            stream.output.finish_reason = stream.output.finish_reason or FinishReason.ERROR
            self._record_finished(stream, now)
            stream.changed.set()
        self.streams.clear()
        if self.metrics is not None:
            self.metrics.record_stats(EngineStats(prefix_cache_queries=self.stats
                                                  .prefix_cache_queries,
                                                  prefix_cache_hits=self.stats.prefix_cache_hits,
                                                  num_preemptions=self.stats.num_preemptions))

    def abort_all(self) -> None:
        """Abort every open request: each finishes with what it has (finish_reason
        "abort")."""
        for request_id in list(self.streams):
            self.abort(request_id)

    async def shutdown(self, reason: str = "the server is shutting down") -> None:
        self.fail_all(reason)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
