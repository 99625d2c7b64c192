"""The Python client library for `launch.py serve`.

    c = Client("tcp://127.0.0.1:5555")
    c.generate("Hello", SamplingParams(max_tokens=32))       # a RequestOutput
    for delta in c.stream("Tell me a story"): print(delta.text, end="")

A Client is for one thread and one request at a time; AsyncClient keeps many in flight.
Errors come back as exceptions: ValueError for a rejected request (with the server's message),
EngineOverloadedError when the server's queue is full (retry later), PermissionError for a
wrong or missing `api_key` (the server's --api-key), EngineDeadError when the engine is gone,
TimeoutError when `timeout` passes with no news. Every message carries the API key in a frame
of its own, checked before the server decodes the rest.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Iterator

import msgspec
import zmq
import zmq.asyncio

from kvflow.errors import EngineDeadError, EngineOverloadedError
from kvflow.frontend.outputs import RequestOutput
from kvflow.ipc.messages import (ERROR_ENGINE_DEAD, ERROR_INTERNAL, ERROR_OVERLOADED,
                                 ERROR_UNAUTHORIZED,
                                 ClientAbort, ClientOutput, ClientRequest, ClientStats,
                                 ClientStatsRequest, EngineStats, FromServer)
from kvflow.sampling_params import SamplingParams

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FromServer)


def _request(prompt: str | list[int] | None, messages: list[dict[str, str]] | None,
             params: SamplingParams | None, stream: bool, timeout: float | None = None
             ) -> ClientRequest:
    raw = msgspec.Raw(_encoder.encode(params or SamplingParams()))
    if isinstance(prompt, str):
        return ClientRequest(uuid.uuid4().hex, raw, prompt=prompt, stream=stream,
                             timeout=timeout)
    if prompt is not None:
        return ClientRequest(uuid.uuid4().hex, raw, prompt_token_ids=list(prompt), stream=stream,
                             timeout=timeout)
    return ClientRequest(uuid.uuid4().hex, raw, messages=messages, stream=stream,
                         timeout=timeout)


def _check(msg: ClientOutput) -> None:
    if msg.error_kind == ERROR_ENGINE_DEAD:
        raise EngineDeadError(msg.error)
    if msg.error_kind == ERROR_OVERLOADED:
        raise EngineOverloadedError(msg.error)
    if msg.error_kind == ERROR_UNAUTHORIZED:
        raise PermissionError(msg.error)
    if msg.error_kind == ERROR_INTERNAL:
        raise RuntimeError(msg.error)
    if msg.error is not None:
        raise ValueError(msg.error)


def _to_output(msg: ClientOutput, prompt: str | None) -> RequestOutput:
    return RequestOutput(request_id=msg.request_id, prompt=prompt,
                         prompt_token_ids=msg.prompt_token_ids or [], text=msg.text,
                         token_ids=msg.token_ids, finish_reason=msg.finish_reason,
                         num_cached_tokens=msg.num_cached_tokens, logprobs=msg.logprobs)


def _merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    if total is None:
        return msgspec.structs.replace(delta, token_ids=list(delta.token_ids))
    total.text += delta.text
    total.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        total.logprobs = (total.logprobs or []) + delta.logprobs
    total.finish_reason = delta.finish_reason
    total.num_cached_tokens = max(total.num_cached_tokens, delta.num_cached_tokens)
    return total


class Client:
    def __init__(self, address: str, timeout: float | None = None,
                 api_key: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout_ms = None if timeout is None else int(timeout * 1000)
        self.key = (api_key or "").encode()

    def _send(self, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([self.key, _encoder.encode(msg)])

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 deadline: float | None = None) -> RequestOutput:
        """`deadline`: seconds after which the server aborts the request and answers with
        what it has (finish_reason "abort")."""
        return self._whole(_request(prompt, None, params, stream=False, timeout=deadline),
                           prompt if isinstance(prompt, str) else None)

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None,
             deadline: float | None = None) -> RequestOutput:
        return self._whole(_request(None, messages, params, stream=False, timeout=deadline),
                           None)

    def stream(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
               messages: list[dict[str, str]] | None = None, deadline: float | None = None
               ) -> Iterator[RequestOutput]:
        """Deltas (new text and tokens); closing the iterator early aborts the request."""
        req = _request(prompt, messages, params, stream=True, timeout=deadline)
        self._send(req)
        finished = False
        try:
            while not finished:
                msg = self._recv(req.request_id)
                finished = msg.finish_reason is not None
                yield _to_output(msg, prompt if isinstance(prompt, str) else None)
        finally:
            if not finished and not self.sock.closed:
                self.abort(req.request_id)

    def _whole(self, req: ClientRequest, prompt: str | None) -> RequestOutput:
        self._send(req)
        return _to_output(self._recv(req.request_id), prompt)

    def abort(self, request_id: str) -> None:
        self._send(ClientAbort(request_id))

    def stats(self) -> EngineStats:
        request_id = uuid.uuid4().hex
        self._send(ClientStatsRequest(request_id))
        msg = self._recv(request_id)
        assert isinstance(msg, ClientStats)
        return msg.stats

    def _recv(self, request_id: str) -> Any:
        """The next message for `request_id` (late messages of closed requests are skipped)."""
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no answer from the server for request {request_id}")
            msg = _decoder.decode(self.sock.recv())
            if msg.request_id == "" and isinstance(msg, ClientOutput):
                _check(msg)                 # about this connection: a wrong API key
            if msg.request_id != request_id:
                continue
            if isinstance(msg, ClientOutput):
                _check(msg)
            return msg

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Many requests in flight over one socket; a reader task routes messages to requests."""

    def __init__(self, address: str, timeout: float | None = None,
                 api_key: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout = timeout
        self.key = (api_key or "").encode()
        self.queues: dict[str, asyncio.Queue] = {}
        self.reader: asyncio.Task | None = None

    async def _send(self, msg: msgspec.Struct) -> None:
        await self.sock.send_multipart([self.key, _encoder.encode(msg)])

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            msg = _decoder.decode(await self.sock.recv())
            if msg.request_id == "":        # about this connection (a wrong API key): all
                for each in self.queues.values():
                    each.put_nowait(msg)
                continue
            queue = self.queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)

    async def _open(self, request_id: str, payload: msgspec.Struct) -> asyncio.Queue:
        if self.reader is None:
            self.reader = asyncio.get_running_loop().create_task(self._read())
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        await self._send(payload)
        return queue

    async def _next(self, queue: asyncio.Queue, request_id: str) -> Any:
        try:
            msg = await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from the server for request {request_id}") from None
        if isinstance(msg, ClientOutput):
            _check(msg)
        return msg

    async def stream(self, prompt: str | list[int] | None = None,
                     params: SamplingParams | None = None,
                     messages: list[dict[str, str]] | None = None,
                     deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        req = _request(prompt, messages, params, stream=True, timeout=deadline)
        queue = await self._open(req.request_id, req)
        finished = False
        try:
            while not finished:
                msg = await self._next(queue, req.request_id)
                finished = msg.finish_reason is not None
                yield _to_output(msg, prompt if isinstance(prompt, str) else None)
        finally:
            self.queues.pop(req.request_id, None)
            if not finished:
                await self.abort(req.request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       deadline: float | None = None) -> RequestOutput:
        total = None
        async for delta in self.stream(prompt, params, deadline=deadline):
            total = _merge(total, delta)
        assert total is not None
        return total

    async def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None,
                   deadline: float | None = None) -> RequestOutput:
        total = None
        async for delta in self.stream(None, params, messages=messages, deadline=deadline):
            total = _merge(total, delta)
        assert total is not None
        return total

    async def abort(self, request_id: str) -> None:
        await self._send(ClientAbort(request_id))

    async def stats(self) -> EngineStats:
        request_id = uuid.uuid4().hex
        queue = await self._open(request_id, ClientStatsRequest(request_id))
        try:
            msg = await self._next(queue, request_id)
        finally:
            self.queues.pop(request_id, None)
        assert isinstance(msg, ClientStats)
        return msg.stats

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.ctx.destroy(linger=0)
