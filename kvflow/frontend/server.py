"""The ZMQ server behind `launch.py serve`: the frontend process of the cluster.

Clients (kvflow.Client / AsyncClient, DEALER sockets) talk to one ROUTER socket. The server
tokenizes and checks each request (a bad one gets an error reply, naming the problem), forwards
it to EngineCore, detokenizes the engine's outputs and answers each client: every delta when it
streams, the whole output when it finishes. Requests get server-side ids, so clients can't
collide. One poll loop, no threads, no spinning.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvflow.errors import EngineDeadError
from kvflow.frontend.engine_client import MultiprocEngine
from kvflow.frontend.outputs import RequestTracker
from kvflow.frontend.processor import InputProcessor
from kvflow.ipc.messages import (ERROR_ENGINE_DEAD, ERROR_INVALID, FINISH_ERROR, ClientAbort,
                                 ClientOutput, ClientRequest, ClientStats, ClientStatsRequest,
                                 EngineRequest, EngineStats, FromServer, RequestDelta,
                                 ToServer)
from kvflow.ipc.sockets import Channel, make_socket
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    identity: bytes
    client_request_id: str
    tracker: RequestTracker
    stream: bool
    num_tokens_sent: int = 0


class Server:
    def __init__(self, engine: MultiprocEngine, processor: InputProcessor, address: str) -> None:
        self.engine = engine
        self.processor = processor
        self.ctx = zmq.Context()
        self.clients = Channel[ToServer](make_socket(self.ctx, zmq.ROUTER, address, bind=True),
                                         ToServer)
        self.pending: dict[str, Pending] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.stats = EngineStats()
        self.ids = itertools.count()
        self.dead: str | None = None
        self.wakeup_r, self.wakeup_w = os.pipe()     # signals wake the poll loop
        os.set_blocking(self.wakeup_w, False)

    def serve_forever(self) -> None:
        """Until SIGINT/SIGTERM."""
        old = signal.set_wakeup_fd(self.wakeup_w)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)      # the wakeup fd carries the news
        poller = zmq.Poller()
        poller.register(self.clients.sock, zmq.POLLIN)
        poller.register(self.wakeup_r, zmq.POLLIN)
        engine_items = [self.engine.output.sock, self.engine.sentinel]
        for item in engine_items:
            poller.register(item, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.wakeup_r in ready:
                    logger.warning("signal received; shutting down")
                    return
                if self.clients.sock in ready:
                    self.receive_clients()
                if self.dead is None and any(item in ready for item in engine_items):
                    self.receive_engine()
                if self.dead is not None and engine_items:
                    # The dead engine's socket and pidfd are closed now: polling them would
                    # return at once, forever (a busy loop), so stop watching them.
                    for item in engine_items:
                        poller.unregister(item)
                    engine_items = []
        finally:
            signal.set_wakeup_fd(old)

    # --- clients -------------------------------------------------------------------------

    def receive_clients(self) -> None:
        while self.clients.poll(0):
            frames = self.clients.sock.recv_multipart()
            if len(frames) < 2:
                continue
            identity, msg = frames[0], self.clients.decode(frames[-1])
            if isinstance(msg, ClientRequest):
                self.submit(identity, msg)
            elif isinstance(msg, ClientAbort):
                request_id = self.by_client.get((identity, msg.request_id))
                if request_id is not None:
                    self.engine.abort([request_id])
            elif isinstance(msg, ClientStatsRequest):
                self.reply(identity, ClientStats(msg.request_id, self.stats))

    def submit(self, identity: bytes, msg: ClientRequest) -> None:
        if self.dead is not None:
            self.reply(identity, ClientOutput(msg.request_id, error=self.dead,
                                              error_kind=ERROR_ENGINE_DEAD))
            return
        request_id = str(next(self.ids))
        try:
            tracker = self.processor.make_tracker(request_id, self._prompt(msg),
                                                  _params(msg.sampling_params))
        except ValueError as e:
            self.reply(identity, ClientOutput(msg.request_id, error=str(e),
                                              error_kind=ERROR_INVALID))
            return
        self.pending[request_id] = Pending(identity, msg.request_id, tracker, msg.stream)
        self.by_client[(identity, msg.request_id)] = request_id
        out = tracker.output
        try:
            self.engine.add_requests([EngineRequest(request_id, out.prompt_token_ids,
                                                    tracker.params, time.time())])
        except EngineDeadError as e:
            self.fail_all(str(e))

    def _prompt(self, msg: ClientRequest) -> str | list[int]:
        if msg.messages is not None:
            return self.processor.render_chat(msg.messages)
        if msg.prompt is not None:
            return msg.prompt
        if msg.prompt_token_ids is not None:
            return msg.prompt_token_ids
        raise ValueError("the request has no prompt, prompt_token_ids or messages")

    def reply(self, identity: bytes, msg: msgspec.Struct) -> None:
        try:
            self.clients.send(msg, prefix=[identity])
        except zmq.ZMQError as e:                    # a vanished client must not stop us
            logger.info("could not answer a client: %s", e)

    # --- engine --------------------------------------------------------------------------

    def receive_engine(self) -> None:
        try:
            while (outputs := self.engine.get_outputs(timeout=0)) is not None:
                self.stats = outputs.stats
                for delta in outputs.outputs:
                    self.forward(delta)
        except EngineDeadError as e:
            self.fail_all(str(e))

    def forward(self, delta: RequestDelta) -> None:
        p = self.pending.get(delta.request_id)
        if p is None:
            return
        finished = p.tracker.apply(delta)
        if finished and delta.finish_reason is None:   # a stop string ended it here
            self.engine.abort([delta.request_id])
        out = p.tracker.output
        if finished:
            del self.pending[delta.request_id]
            self.by_client.pop((p.identity, p.client_request_id), None)
        if p.stream or finished:
            self.reply(p.identity, self._client_output(p, finished))

    def _client_output(self, p: Pending, finished: bool) -> ClientOutput:
        out = p.tracker.output
        if p.stream:
            start, p.num_tokens_sent = p.num_tokens_sent, len(out.token_ids)
            text = p.tracker.new_text()
        else:
            start, text = 0, out.text
        kind = ERROR_INVALID if out.finish_reason == FINISH_ERROR else None
        return ClientOutput(
            p.client_request_id, text, out.token_ids[start:],
            out.finish_reason if finished else None, out.num_cached_tokens,
            out.logprobs[start:] if out.logprobs is not None else None,
            out.prompt_token_ids if start == 0 else None, out.error, kind)

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every pending request, and every later one, fails."""
        logger.error("engine is dead: %s", reason)
        self.dead = reason
        for p in self.pending.values():
            self.reply(p.identity, ClientOutput(p.client_request_id, error=reason,
                                                error_kind=ERROR_ENGINE_DEAD))
        self.pending.clear()
        self.by_client.clear()

    def close(self) -> None:
        for p in self.pending.values():          # else their clients would wait forever
            self.reply(p.identity, ClientOutput(p.client_request_id,
                                                error="the server is shutting down",
                                                error_kind=ERROR_ENGINE_DEAD))
        self.clients.sock.close(linger=1000)     # let those answers leave
        self.engine.shutdown()
        self.ctx.destroy(linger=0)
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)


def _params(raw: msgspec.Raw) -> SamplingParams:
    try:
        return msgspec.msgpack.decode(raw, type=SamplingParams)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:   # ValidationError is a DecodeError
        raise ValueError(str(e)) from None
