"""The serving frontend's engine handle: many requests in flight on one engine, under asyncio.

One reader task takes EngineCore's outputs as they come, folds each delta into its request's
tracker (detokenizing, stop strings) and wakes that request's consumer; consumers (the HTTP and
ZMQ servers) never touch the engine's sockets. A consumer opens a request with
`async with engine.request(prompt, params) as stream` and reads news with `await
stream.next()`. Leaving the block before the request finished (a client that went away, a
cancelled task) aborts it, so its blocks are freed at the engine's next step. When the engine
dies, every open stream raises EngineDeadError and `dead` says why (/health turns 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import zmq
import zmq.asyncio

from kvflow.errors import EngineDeadError
from kvflow.frontend.engine_client import MultiprocEngine
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
    def __init__(self, engine: MultiprocEngine, processor: InputProcessor,
                 metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.processor = processor
        self.metrics = metrics
        self.streams: dict[str, RequestStream] = {}
        self.stats = EngineStats()
        self.dead: str | None = engine.dead
        self.num_sent = 0
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: its last count, plus those sent that it had not
        taken in yet when it counted."""
        return self.stats.num_waiting + self.num_sent - self.stats.num_received

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    @asynccontextmanager
    async def request(self, prompt: Prompt, params: SamplingParams
                      ) -> AsyncIterator[RequestStream]:
        """Submit a request (ValueError naming the problem if it is invalid); leaving the
        block before it finished aborts it."""
        stream = self.add(prompt, params)
        try:
            yield stream
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def add(self, prompt: Prompt, params: SamplingParams) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        request_id = str(next(self._ids))
        stream = RequestStream(self.processor.make_tracker(request_id, prompt, params))
        out = stream.output
        try:
            self.engine.add_requests([EngineRequest(request_id, out.prompt_token_ids, params,
                                                    time.time())])
        except EngineDeadError as e:
            self.fail_all(str(e))
            raise
        self.streams[request_id] = stream
        self.num_sent += 1
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at the engine; its abort reply finishes the stream (and counts it)."""
        if self.dead is None and request_id in self.streams:
            self.engine.abort([request_id])

    # --- the reader task -----------------------------------------------------------------

    async def _read_outputs(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(zmq.asyncio.Socket.from_socket(self.engine.output.sock), zmq.POLLIN)
        poller.register(self.engine.sentinel, zmq.POLLIN)
        while self.dead is None:
            await poller.poll()
            try:
                for out in self.engine.drain():
                    self._apply(out)
            except EngineDeadError as e:
                self.fail_all(str(e))
            except Exception as e:          # a bug here must not leave every consumer hanging
                logger.exception("the frontend's output reader failed")
                self.fail_all(f"the frontend's output reader failed: {e!r}")
                self.engine.shutdown()

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

    async def shutdown(self, reason: str = "the server is shutting down") -> None:
        self.fail_all(reason)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.engine.shutdown()
