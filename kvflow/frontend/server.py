"""kvflow's own ZMQ endpoint in the serving frontend (`launch.py serve --client-address`).

Clients (kvflow.Client / AsyncClient, DEALER sockets) talk to one ROUTER socket. Every
message is two frames, the API key and the message: with --api-key, a message whose key frame
differs is answered "unauthorized" before the rest is decoded. Each request is admitted like
an HTTP one (--max-waiting-requests: an "overloaded" error at once), tokenized and checked off
the event loop (a bad one gets an error reply naming the problem), then served by its own
task on the shared AsyncEngine: every delta when it streams, the whole output when it
finishes. Requests get server-side ids, so clients can't collide.

The socket is bounded: a message over --max-request-bytes is dropped and logged (libzmq
disconnects a peer whose message exceeds twice that), and a client that does not read its
answers (its queue of MAX_QUEUED_REPLIES replies full) has its request aborted instead of
growing the server's memory.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time

import msgspec
import zmq
import zmq.asyncio

from kvflow.errors import EngineDeadError, EngineOverloadedError
from kvflow.frontend.api.protocol import MAX_MESSAGES
from kvflow.frontend.async_engine import AsyncEngine, RequestStream
from kvflow.frontend.processor import Prompt
from kvflow.ipc.messages import (ClientAbort, ClientOutput, ClientRequest, ClientStats,
                                 ClientStatsRequest, FinishReason, ToServer, ERROR_ENGINE_DEAD,
                                 ERROR_INTERNAL, ERROR_INVALID, ERROR_OVERLOADED,
                                 ERROR_UNAUTHORIZED, INTERNAL_ERROR_PREFIX)
from kvflow.ipc.sockets import Channel
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MAX_QUEUED_REPLIES = 1000     # per client: replies the server holds for a client not reading


class ZmqServer:
    def __init__(self, engine: AsyncEngine, address: str, api_key: str | None = None,
                 max_message_bytes: int = 4 * 2**20) -> None:
        self.engine = engine
        self.api_key = (api_key or "").encode()
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.asyncio.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, MAX_QUEUED_REPLIES)
        sock.setsockopt(zmq.RCVHWM, MAX_QUEUED_REPLIES)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        sock.setsockopt(zmq.SNDBUF, 64 * 1024)        # kernel bytes per client, bounded too
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a full client queue: EAGAIN, not a drop
        sock.bind(address)
        self.clients = Channel[ToServer](sock, ToServer)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._last_log = 0.0

    async def serve_forever(self) -> None:
        while True:
            frames = await self.clients.sock.recv_multipart()   # type: ignore[misc]
            try:
                await self.receive(frames)
            except Exception:                 # one bad message must not stop the ZMQ server
                logger.exception("could not handle a client message")

    async def receive(self, frames: list[bytes]) -> None:
        """[identity, key, message]: the key checked before the message is decoded."""
        if len(frames) != 3:
            self._warn(f"dropped a client message of {len(frames) - 1} frames (expected the "
                       "API key and the message)")
            return
        identity, key, data = frames
        if not secrets.compare_digest(key, self.api_key):
            await self.reply(identity, ClientOutput("", error="invalid or missing API key",
                                                    error_kind=ERROR_UNAUTHORIZED))
            return
        if len(data) > self.max_message_bytes:
            self._warn(f"dropped a {len(data)}-byte client message (the limit is "
                       f"{self.max_message_bytes} bytes, --max-request-bytes)")
            await self.reply(identity, ClientOutput(
                "", error=f"message of {len(data)} bytes exceeds the server's limit of "
                          f"{self.max_message_bytes} bytes", error_kind=ERROR_INVALID))
            return
        await self.handle(identity, self.clients.decode(data))

    def _warn(self, message: str) -> None:
        """Log, at most once a second: a flood of bad messages must not flood the log."""
        now = time.monotonic()
        if now - self._last_log > 1:
            self._last_log = now
            logger.warning(message)

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
            params = _params(msg.sampling_params)
            if msg.timeout is not None and not 0 < msg.timeout < float("inf"):
                raise ValueError(f"timeout={msg.timeout!r} must be a positive number of seconds")
            messages = _messages(msg)
            prompt = None if messages is not None else _prompt(msg)
            async with self.engine.request(prompt, params, msg.timeout, messages) as stream:
                await self._answer(identity, msg, stream)
        except ValueError as e:
            await self.reply(identity, ClientOutput(msg.request_id, error=str(e),
                                                    error_kind=ERROR_INVALID))
        except EngineOverloadedError as e:
            await self.reply(identity, ClientOutput(msg.request_id, error=str(e),
                                                    error_kind=ERROR_OVERLOADED))
        except EngineDeadError as e:          # its first line: no worker traceback
            reason = (str(e).strip().splitlines() or ["the engine is not available"])[0]
            await self.reply(identity, ClientOutput(msg.request_id, error=reason[:300],
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
            kind = None
            if out.finish_reason == FinishReason.ERROR:
                kind = (ERROR_INTERNAL if (out.error or "").startswith(INTERNAL_ERROR_PREFIX)
                        else ERROR_INVALID)
            if not await self.reply(identity, ClientOutput(
                    msg.request_id, text, token_ids, delta.finish_reason, out.num_cached_tokens,
                    logprobs, out.prompt_token_ids if first else None, out.error, kind)):
                return                          # the client is gone or not reading: abort
            first = False
            if finished:
                return

    async def reply(self, identity: bytes, msg: msgspec.Struct) -> bool:
        """Send, never waiting: False when the client is gone or its queue is full."""
        try:
            await self.clients.sock.send_multipart(             # type: ignore[misc]
                [identity, self.clients.encoder.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:          # gone (EHOSTUNREACH) or not reading (EAGAIN)
            self._warn(f"could not answer a client ({e}); its request is aborted")
            return False

    async def close(self) -> None:
        """After the engine failed every open request: let those answers leave, then close."""
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=2)
        self.clients.sock.close(linger=1000)
        self.ctx.term()


def _messages(msg: ClientRequest) -> list[dict[str, str]] | None:
    if msg.messages is not None and len(msg.messages) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(msg.messages)} entries; at most {MAX_MESSAGES} "
                         "are allowed")
    return msg.messages


def _prompt(msg: ClientRequest) -> Prompt:
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
