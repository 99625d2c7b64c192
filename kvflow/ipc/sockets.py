"""The one socket helper: typed send/receive of msgspec messages over ZMQ.

A malformed or unexpected message is logged and dropped (`recv` returns None), never fatal:
a stray client or a garbled frame must not take a process down.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from kvflow.ipc.auth import ClusterKeys

logger = logging.getLogger(__name__)
T = TypeVar("T")


def ipc_address(name: str, directory: str | None = None) -> str:
    """A fresh ipc:// path in a private temp directory."""
    directory = directory or tempfile.mkdtemp(prefix="kvflow-")
    return f"ipc://{os.path.join(directory, name)}"


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool,
                identity: bytes | None = None, keys: ClusterKeys | None = None) -> zmq.Socket:
    """`keys`: CURVE with the cluster's keys (several nodes: tcp), server when binding."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)            # never block process exit on unsent messages
    if kind in (zmq.PUSH, zmq.PUB, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.SNDHWM, 0)        # never drop (PUB) or block on a full queue
    if kind in (zmq.PULL, zmq.SUB, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        keys.secure(sock, server=bind)
    (sock.bind if bind else sock.connect)(address)
    return sock


class Channel(Generic[T]):
    """A socket plus an encoder and a decoder for the message union it carries."""

    def __init__(self, sock: zmq.Socket, decode_type: Any) -> None:
        self.sock = sock
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(decode_type)

    def send(self, msg: msgspec.Struct, prefix: list[bytes] | None = None) -> None:
        data = self.encoder.encode(msg)
        if prefix:
            self.sock.send_multipart([*prefix, data], copy=False)
        else:
            self.sock.send(data, copy=False)

    def decode(self, data: bytes) -> T | None:
        try:
            return self.decoder.decode(data)  # type: ignore[no-any-return]
        except (msgspec.DecodeError, UnicodeDecodeError) as e:   # invalid UTF-8 is the latter
            logger.warning("dropped a malformed message (%d bytes): %s", len(data), e)
            return None

    def recv(self) -> T | None:
        """One message (blocking); None if it was malformed."""
        frames = self.sock.recv_multipart(copy=True)
        return self.decode(frames[-1])

    def poll(self, timeout_ms: int | None) -> bool:
        return bool(self.sock.poll(timeout_ms))
