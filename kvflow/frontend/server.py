"""kvflow's own ZMQ endpoint in the serving frontend (`launch.py serve --client-address`).

Clients (kvflow.Client / AsyncClient, DEALER sockets) talk to one ROUTER socket. Each request
is tokenized and checked (a bad one gets an error reply naming the problem), then served by
its own task on the shared AsyncEngine, next to the HTTP server's requests: every delta when it
streams, the whole output when it finishes. Requests get server-side ids, so clients can't
collide.
"""
from __future__ import annotations

import asyncio
import functools
import logging

import msgspec
import zmq
import zmq.asyncio

from kvflow.errors import EngineDeadError
from kvflow.frontend.async_engine import AsyncEngine, RequestStream
from kvflow.frontend.processor import Prompt
from kvflow.ipc.messages import (ClientAbort, ClientOutput, ClientRequest, ClientStats,
                                 ClientStatsRequest, FinishReason, ToServer, ERROR_ENGINE_DEAD,
                                 ERROR_INVALID)
from kvflow.ipc.sockets import Channel, make_socket
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ZmqServer:
    def __init__(self, engine: AsyncEngine, address: str) -> None:
        self.engine = engine
        self.ctx = zmq.asyncio.Context()
        self.clients = Channel[ToServer](make_socket(self.ctx, zmq.ROUTER, address, bind=True),
                                         ToServer)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}

    async def serve_forever(self) -> None:
        while True:
            frames = await self.clients.sock.recv_multipart()   # type: ignore[misc]
            if len(frames) < 2:
                continue
            try:
                await self.handle(frames[0], self.clients.decode(frames[-1]))
            except Exception:                 # one bad message must not stop the ZMQ server
                logger.exception("could not handle a client message")

    async def handle(self, identity: bytes, msg: ToServer | None) -> None:
        if isinstance(msg, ClientRequest):
            key = (identity, msg.request_id)
            task = asyncio.get_running_loop().create_task(self.serve(identity, msg))
            self.tasks[key] = task
            task.add_done_callback(functools.partial(self._forget, key))
        elif isinstance(msg, ClientAbort):
            running = self.tasks.get((identity, msg.request_id))
            if running is not None:
                running.cancel()                    # leaving the stream aborts the request
        elif isinstance(msg, ClientStatsRequest):
            await self.reply(identity, ClientStats(msg.request_id, self.engine.stats))

    def _forget(self, key: tuple[bytes, str], task: asyncio.Task) -> None:
        if self.tasks.get(key) is task:             # not a later request reusing the id
            del self.tasks[key]

    async def serve(self, identity: bytes, msg: ClientRequest) -> None:
        try:
            prompt, params = _prompt(self.engine, msg), _params(msg.sampling_params)
            async with self.engine.request(prompt, params) as stream:
                await self._answer(identity, msg, stream)
        except ValueError as e:
            await self.reply(identity, ClientOutput(msg.request_id, error=str(e),
                                                    error_kind=ERROR_INVALID))
        except EngineDeadError as e:
            await self.reply(identity, ClientOutput(msg.request_id, error=str(e),
                                                    error_kind=ERROR_ENGINE_DEAD))

    async def _answer(self, identity: bytes, msg: ClientRequest, stream: RequestStream) -> None:
        first = True
        while True:
            delta = await stream.next()
            finished = delta.finish_reason is not None
            if not (msg.stream or finished):
                continue
            out = stream.output
            if msg.stream:
                text, token_ids, logprobs = delta.text, delta.token_ids, delta.logprobs
            else:
                text, token_ids, logprobs = out.text, out.token_ids, out.logprobs
            kind = ERROR_INVALID if out.finish_reason == FinishReason.ERROR else None
            await self.reply(identity, ClientOutput(
                msg.request_id, text, token_ids, delta.finish_reason, out.num_cached_tokens,
                logprobs, out.prompt_token_ids if first else None, out.error, kind))
            first = False
            if finished:
                return

    async def reply(self, identity: bytes, msg: msgspec.Struct) -> None:
        try:
            await self.clients.sock.send_multipart(             # type: ignore[misc]
                [identity, self.clients.encoder.encode(msg)])
        except zmq.ZMQError as e:                    # a vanished client must not stop us
            logger.info("could not answer a client: %s", e)

    async def close(self) -> None:
        """After the engine failed every open request: let those answers leave, then close."""
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=2)
        self.clients.sock.close(linger=1000)
        self.ctx.term()


def _prompt(engine: AsyncEngine, msg: ClientRequest) -> Prompt:
    if msg.messages is not None:
        return engine.processor.render_chat(msg.messages)
    if msg.prompt is not None:
        return msg.prompt
    if msg.prompt_token_ids is not None:
        return msg.prompt_token_ids
    raise ValueError("the request has no prompt, prompt_token_ids or messages")


def _params(raw: msgspec.Raw) -> SamplingParams:
    try:
        return msgspec.msgpack.decode(raw, type=SamplingParams)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:   # ValidationError is a DecodeError
        raise ValueError(str(e)) from None
